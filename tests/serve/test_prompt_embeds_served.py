"""Served prompt embeddings (issue 26): ``/v1/completions`` with ``prompt_embeds`` (vLLM's: base64
of ``torch.save(tensor[L, hidden])``), behind ``--enable-prompt-embeds``.

The expectation is the same prompt sent as token ids. Hostile payloads (bad base64, a pickle that
is not a tensor, a wrong shape, an oversized body) are 400s naming ``prompt_embeds``; without the
option it is a 400 too.
"""

from __future__ import annotations

import base64
import io
import os

import httpx
import pytest
import torch
from conftest import MODEL_NAME, _llm, start_server


@pytest.fixture(scope="module")
def embeds_llm():
    return _llm(enable_prompt_embeds=True, max_num_seqs=4)


@pytest.fixture(scope="module")
def server(embeds_llm):
    with start_server(embeds_llm) as s:
        yield s


def _b64(tensor: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return base64.b64encode(buf.getvalue()).decode()


def _post(server, body):
    return httpx.post(f"{server.url}/v1/completions", json={"model": MODEL_NAME, **body}, timeout=120)


def _embeds(llm, ids):
    with torch.no_grad():
        return llm.runner.model.embed_tokens(torch.tensor(ids)).float()


def test_served_embeds_equal_token_prompt(server, embeds_llm):
    ids = embeds_llm.text_tokenizer("The capital of France is").input_ids
    greedy = {"max_tokens": 8, "temperature": 0}
    want = _post(server, {"prompt": ids, **greedy})
    got = _post(server, {"prompt_embeds": _b64(_embeds(embeds_llm, ids)), **greedy})
    assert want.status_code == got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
    assert got.json()["usage"]["prompt_tokens"] == len(ids)
    two = _post(server, {"prompt_embeds": [_b64(_embeds(embeds_llm, ids)), _b64(_embeds(embeds_llm, ids[:3]))],
                         **greedy})
    assert two.status_code == 200 and [c["index"] for c in two.json()["choices"]] == [0, 1]
    assert two.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]


class _NotATensor:
    def __reduce__(self):
        return (os.getpid, ())  # a pickle that would run code if loaded without weights_only


@pytest.mark.parametrize(("payload", "words"), [
    ("not base64!", "not valid base64"),
    (base64.b64encode(b"\x00" * 64).decode(), "not a torch.save'd tensor"),
    ("pickle", "not a torch.save'd tensor"),
    ("wide", "must have shape (L, 576)"),
    ("huge", "larger than"),
])
def test_bad_payloads_are_400(server, payload, words):
    if payload == "pickle":
        buf = io.BytesIO()
        torch.save(_NotATensor(), buf)
        payload = base64.b64encode(buf.getvalue()).decode()
    elif payload == "wide":
        payload = _b64(torch.zeros(4, 32))
    elif payload == "huge":
        payload = "A" * (4 * 512 * 576 * 2)
    r = _post(server, {"prompt_embeds": payload, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt_embeds" and words in err["message"]


def test_prompt_and_echo_and_penalties(server, embeds_llm):
    e = _b64(_embeds(embeds_llm, [1, 2, 3]))
    r = _post(server, {"prompt_embeds": e, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_embeds"
    r = _post(server, {"prompt_embeds": e, "echo": True, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    r = _post(server, {"prompt_embeds": e, "repetition_penalty": 1.3, "max_tokens": 2})
    assert r.status_code == 400 and "repetition_penalty" in r.json()["error"]["message"]
    assert _post(server, {"prompt_embeds": e, "max_tokens": 2}).status_code == 200  # still serving


def test_without_the_option_it_is_400(served_llm):
    with start_server(served_llm) as s:
        r = _post(s, {"prompt_embeds": _b64(torch.zeros(3, 576)), "max_tokens": 2})
    assert r.status_code == 400 and "--enable-prompt-embeds" in r.json()["error"]["message"]


def test_wire_format_round_trip():
    from deepinfer.serve.engine_thread import embeds_from_wire, embeds_to_wire

    t = torch.randn(5, 7)
    assert torch.equal(embeds_from_wire(embeds_to_wire(t)), t)
    with pytest.raises(ValueError, match="malformed"):
        embeds_from_wire([b"\x00" * 8, [5, 7]])


def test_engine_core_process_carries_the_embeddings(embeds_llm):
    """``deepinfer serve`` (its engine-core process: the embeddings cross the ZeroMQ socket)."""
    import signal
    import threading

    from conftest import read_until_listening, start_serve_process

    proc = start_serve_process("--enable-prompt-embeds")
    lines: list[str] = []
    try:
        url = read_until_listening(proc, lines, 180)
        threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
        ids = embeds_llm.text_tokenizer("Once upon a time").input_ids
        body = {"model": "m", "max_tokens": 6, "temperature": 0}
        want = httpx.post(f"{url}/v1/completions", json={**body, "prompt": ids}, timeout=120)
        got = httpx.post(f"{url}/v1/completions", json={**body, "prompt_embeds": _b64(_embeds(embeds_llm, ids))},
                         timeout=120)
        assert want.status_code == got.status_code == 200, got.text
        assert got.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except Exception:
            proc.kill()
            proc.wait(10)


def test_data_parallel_replicas_take_the_embeddings(embeds_llm):
    """Two CPU replicas behind one front end: the rows cross the replica's command queue."""
    from conftest import LLM_KWARGS, ServerThread
    from deepinfer.serve import ServeConfig, build_app
    from deepinfer.serve.replicas import ReplicaSet

    replicas = ReplicaSet({**LLM_KWARGS, "max_num_seqs": 4, "device": "cpu", "num_threads": 1,
                           "enable_prompt_embeds": True}, 2)
    try:
        with ServerThread(build_app(replicas, ServeConfig(served_model_names=[MODEL_NAME]))) as s:
            ids = embeds_llm.text_tokenizer("Once upon a time").input_ids
            body = {"max_tokens": 6, "temperature": 0}
            want = _post(s, {"prompt": ids, **body})
            e = _b64(_embeds(embeds_llm, ids))
            got = [_post(s, {"prompt_embeds": e, **body}) for _ in range(2)]  # (one on each replica)
            assert want.status_code == 200 and all(g.status_code == 200 for g in got), got[0].text
            assert {g.json()["choices"][0]["text"] for g in got} == {want.json()["choices"][0]["text"]}
    finally:
        replicas.stop()
