"""A step that raises fails the requests of that step only; the server keeps serving; /health."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from conftest import MODEL_NAME, metrics, wait_until
from deepinfer.runtime.sampling_params import SamplingParams

POISON = 48000  # a token id no test prompt contains: its prefill raises
LONG = {"max_tokens": 400, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def faulty(served_llm):
    """The served model raises inside any step that prefills the POISON token."""
    runner = served_llm.runner
    execute = runner.execute

    def execute_or_fail(**kwargs):
        if (kwargs["input_ids"] == POISON).any():
            raise RuntimeError("injected fault in the model")
        return execute(**kwargs)

    runner.execute = execute_or_fail
    yield
    del runner.execute


def test_a_failed_step_fails_only_its_requests(faulty, server, client, reference_llm):
    url = server.url
    engine = server.state.llm.engine
    slots = engine.cfg.max_num_seqs
    before = metrics(url)
    streams = [client.completions.create(model=MODEL_NAME, prompt=f"Story number {i}:", stream=True, **LONG)
               for i in range(slots)]
    iters = [iter(s) for s in streams]
    for it in iters:
        next(it)  # each holds a batch slot now
    results: dict[str, object] = {}

    def call(name, prompt):
        try:
            results[name] = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0)
        except openai.APIError as exc:
            results[name] = exc

    poisoned = threading.Thread(target=call, args=("poisoned", [1, 2, POISON, 3]))
    poisoned.start()
    wait_until(lambda: metrics(url)["deepinfer:num_requests_waiting"] == 1, 30, "the poisoned request waits")
    survivor_prompt = "The survivor says"
    survivor = threading.Thread(target=call, args=("survivor", survivor_prompt))
    survivor.start()
    wait_until(lambda: metrics(url)["deepinfer:num_requests_waiting"] == 2, 30, "the survivor waits behind it")

    streams[0].close()  # frees one slot: the next step runs the 7 decodes and the poisoned prefill
    poisoned.join(60)
    survivor.join(120)
    assert isinstance(results["poisoned"], openai.InternalServerError)
    assert "injected fault" in results["poisoned"].message
    for it in iters[1:]:  # the decodes in that step: an error event in their streams
        with pytest.raises(openai.APIError, match="injected fault"):
            for _ in range(1000):
                next(it)
    ref = reference_llm.generate([survivor_prompt], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert results["survivor"].choices[0].text == ref.outputs[0].text  # waiting, not in the step: unharmed

    after = metrics(url)
    errors = "deepinfer:request_success_total{finished_reason=error}"
    assert after[errors] - before[errors] == slots  # 7 decodes + the poisoned prefill
    assert after["deepinfer:num_requests_running"] == 0
    assert after["deepinfer:kv_cache_free_blocks"] == after["deepinfer:kv_cache_total_blocks"]
    assert httpx.get(f"{url}/health").status_code == 200
    assert server.state.llm.engine is engine  # the engine abandoned the step; nothing was rebuilt
    again = client.completions.create(model=MODEL_NAME, prompt=survivor_prompt, max_tokens=6, temperature=0)
    assert again.choices[0].text == ref.outputs[0].text


def test_a_failed_stream_gets_an_error_event_then_done(faulty, server):
    from conftest import API_KEY

    lines = []
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": MODEL_NAME, "prompt": [5, POISON], "max_tokens": 4, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert len(lines) == 2 and '"error"' in lines[0] and "injected fault" in lines[0]
    assert lines[1] == "data: [DONE]"


def test_an_error_building_one_requests_output_costs_no_other_request_a_token(server, client, reference_llm):
    """The text of one request fails (in the step where another decodes): that request gets a
    500, the other stream keeps every token."""
    mark = 47000
    engine = server.state.llm.engine
    fill_text = engine._fill_text

    def failing(ro, state):
        if mark in state.prompt_ids:
            raise TypeError("text of this request failed")
        return fill_text(ro, state)

    engine._fill_text = failing
    try:
        prompt = "The capital of France is"
        stream = iter(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                                stream=True))
        text = next(stream).choices[0].text
        with pytest.raises(openai.InternalServerError, match="text of this request failed"):
            client.completions.create(model=MODEL_NAME, prompt=[5, mark], max_tokens=3, temperature=0)
        text += "".join(chunk.choices[0].text for chunk in stream)
    finally:
        del engine._fill_text
    ref = reference_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert text == ref.outputs[0].text
    m = metrics(server.url)
    assert m["deepinfer:kv_cache_free_blocks"] == m["deepinfer:kv_cache_total_blocks"]


def test_health_is_503_once_the_engine_thread_died(served_llm):
    from conftest import start_server

    with start_server(served_llm) as s:
        assert httpx.get(f"{s.url}/health").status_code == 200
        engine = s.state.engine

        def die():
            raise SystemError("the engine thread's loop itself broke")

        engine._take_commands = lambda block: die()
        engine.abort("wake-up")  # the thread wakes, runs the broken loop and dies
        wait_until(lambda: not engine.alive, 10, "the engine thread died")
        r = httpx.get(f"{s.url}/health")
        assert r.status_code == 503 and "loop itself broke" in r.json()["error"]["message"]
        r = httpx.post(f"{s.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503
