"""vLLM's request id: the body's ``request_id`` or the ``X-Request-Id`` header (the header first,
as vLLM reads them) names the response (``cmpl-<id>``, ``chatcmpl-<id>``), whole or streamed, so a
gateway can follow a request through its logs. The engine's own ids stay unique: two clients that
send the same id each get their own completion."""

from __future__ import annotations

import json
import threading

import pytest
from conftest import API_KEY, MODEL_NAME

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _post(url: str, route: str, body: dict, headers: dict | None = None):
    import httpx

    return httpx.post(f"{url}/v1/{route}", json=body, headers={**HEADERS, **(headers or {})}, timeout=120)


def _completion(prompt: str, **extra) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **extra}


def test_the_request_id_names_the_response(server):
    r = _post(server.url, "completions", _completion("Hi", request_id="gw-42:a/b"))
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "cmpl-gw-42:a/b"
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "request_id": "gw-43"}
    assert _post(server.url, "chat/completions", chat).json()["id"] == "chatcmpl-gw-43"


def test_the_header_comes_before_the_field(server):
    r = _post(server.url, "completions", _completion("Hi", request_id="from-body"), {"X-Request-Id": "from-header"})
    assert r.json()["id"] == "cmpl-from-header"


def test_without_an_id_each_response_gets_its_own(server):
    ids = {_post(server.url, "completions", _completion("Hi")).json()["id"] for _ in range(3)}
    assert len(ids) == 3 and all(i.startswith("cmpl-") and len(i) == 5 + 32 for i in ids)


def test_every_streamed_chunk_carries_the_id(server):
    import httpx

    body = _completion("Hi", request_id="stream-7", stream=True)
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=HEADERS, timeout=120) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    assert chunks and {c["id"] for c in chunks} == {"cmpl-stream-7"}


def test_two_clients_with_one_id_get_their_own_completions(server):
    # the same id at once, streamed and not: each response must be its own prompt's completion
    prompts = ["The capital of France is", "One, two, three,", "def add(a, b):", "Once upon a time"]
    alone = [_post(server.url, "completions", _completion(p)).json()["choices"][0]["text"] for p in prompts]
    got: dict[int, str] = {}

    def one(i: int) -> None:
        got[i] = _post(server.url, "completions", _completion(prompts[i], request_id="same")).json()["choices"][0]["text"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got.get(i) for i in range(len(prompts))] == alone


@pytest.mark.parametrize(("where", "value"), [("field", ""), ("field", "a b"), ("field", "x" * 129),
                                              ("field", "line\nbreak"), ("field", "caf\u00e9"), ("header", "a b")])
def test_a_request_id_that_cannot_go_into_a_log_line_is_a_400(server, where, value):
    body = _completion("Hi", **({"request_id": value} if where == "field" else {}))
    r = _post(server.url, "completions", body, {"X-Request-Id": value} if where == "header" else None)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "request_id" and "printable ASCII" in err["message"], err
