"""vLLM's ``cache_salt`` request field: a request reuses prefix-cached KV only of requests with the
same salt, so one tenant cannot learn another's prompts from how fast its own come back. Seen from
a client through ``usage.prompt_tokens_details.cached_tokens``, through the in-process engine
thread and the engine-core process (where the salt crosses a process boundary)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from conftest import API_KEY, MODEL_NAME, read_until_listening, start_serve_process

# (the in-process server asks for the key; the serve process has none and ignores it)
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _cached_tokens(url: str, model: str, prompt: str, salt: str | None, route: str = "completions") -> tuple[int, str]:
    """(cached prompt tokens, text) of a greedy 4-token request with ``salt`` (None: no field)."""
    import httpx

    body: dict[str, Any] = {"model": model, "max_tokens": 4, "temperature": 0}
    if route == "completions":
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(f"{url}/v1/{route}", json=body, headers=HEADERS, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    text = choice["text"] if route == "completions" else choice["message"]["content"]
    return out["usage"]["prompt_tokens_details"]["cached_tokens"], text


def _check_isolation(url: str, model: str, route: str) -> None:
    # a prompt no other test sends, several blocks long
    # (unsalted, a chat prompt may hit the chat template's opening, which other tests' requests share)
    prompt = f"Tenant report {uuid.uuid4().hex}: " + "the quarterly numbers were fine, " * 12
    salt_a, salt_b = f"tenant-a-{uuid.uuid4().hex}", f"tenant-b-{uuid.uuid4().hex}"
    plain, text = _cached_tokens(url, model, prompt, None, route)
    again, text_again = _cached_tokens(url, model, prompt, None, route)
    assert again > plain and text_again == text  # the unsalted cache works (the test can see a hit)
    assert _cached_tokens(url, model, prompt, salt_a, route) == (0, text)  # another salt: no reuse
    assert _cached_tokens(url, model, prompt, salt_a, route) == (again, text)  # its own: reused
    assert _cached_tokens(url, model, prompt, salt_b, route)[0] == 0
    assert _cached_tokens(url, model, prompt, None, route)[0] == again  # the unsalted cache is intact


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_cache_salt_isolates_prefix_cache_in_the_engine_thread(server, route):
    _check_isolation(server.url, MODEL_NAME, route)


def test_cache_salt_isolates_prefix_cache_through_the_engine_core_process():
    proc = start_serve_process()
    lines: list[str] = []
    try:
        url = read_until_listening(proc, lines, 180)
        _check_isolation(url, "m", "completions")
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize(("salt", "words"), [("", "non-empty"), (5, "string"), ("\ud800", "Unicode")])
def test_a_bad_cache_salt_is_a_400_naming_it(server, salt, words):
    import json

    import httpx

    body = json.dumps({"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, "cache_salt": salt})
    r = httpx.post(f"{server.url}/v1/completions", content=body, timeout=60,
                   headers={"Content-Type": "application/json", **HEADERS})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "cache_salt" and words in err["message"], err

