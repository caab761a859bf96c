"""vLLM's request extras: ``allowed_token_ids``, ``bad_words``, ``truncate_prompt_tokens`` (both
routes) and ``add_special_tokens`` (completions). Greedy replies are checked against the reference
``LLM.generate`` with the same parameters on the same prompt ids; bad values are 400s naming the
field (vLLM's tests of truncation check the same: the prompt count, and 400s for 0, negatives
and more than the context)."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import API_KEY, MODEL_NAME
from deepinfer.runtime.sampling_params import SamplingParams

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a colour."}]


def _post(server: Any, path: str, body: dict[str, Any]) -> Any:
    import httpx

    return httpx.post(f"{server.url}{path}", json={"model": MODEL_NAME, **body}, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"})


def _ids(reference_llm: Any, text: str) -> list[int]:
    return list(reference_llm.get_tokenizer()(text).input_ids)


def _generate(reference_llm: Any, ids: list[int], **params: Any) -> Any:
    sp = SamplingParams(temperature=0, max_tokens=8, **params)
    return reference_llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].outputs[0]


def _completion(server: Any, **body: Any) -> dict[str, Any]:
    r = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_allowed_token_ids_bound_the_reply_as_in_generate(server, reference_llm):
    ids = _ids(reference_llm, PROMPT)
    free = _generate(reference_llm, ids)
    allowed = sorted({*free.token_ids[1:4], 11, 28, 30})  # not the free reply's first token
    want = _generate(reference_llm, ids, allowed_token_ids=allowed)
    assert set(want.token_ids) <= set(allowed) and want.token_ids != free.token_ids
    got = _completion(server, allowed_token_ids=allowed)
    assert got["choices"][0]["text"] == want.text


def test_bad_words_are_never_generated_as_in_generate(server, reference_llm):
    ids = _ids(reference_llm, PROMPT)
    free = _generate(reference_llm, ids)
    word = free.text.split()[0]
    want = _generate(reference_llm, ids, bad_words=[word])
    assert want.text != free.text
    got = _completion(server, bad_words=[word])
    assert got["choices"][0]["text"] == want.text
    chat = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "temperature": 0,
                                                   "bad_words": [word]})
    assert chat.status_code == 200, chat.text


@pytest.mark.parametrize("keep", [3, 1])
def test_truncate_prompt_tokens_keeps_the_last_tokens(server, reference_llm, keep):
    ids = _ids(reference_llm, PROMPT)
    got = _completion(server, truncate_prompt_tokens=keep)
    assert got["usage"]["prompt_tokens"] == keep
    assert got["choices"][0]["text"] == _generate(reference_llm, ids[-keep:]).text
    echoed = _completion(server, truncate_prompt_tokens=keep, echo=True, max_tokens=1)
    assert echoed["choices"][0]["text"].startswith(reference_llm.get_tokenizer().decode(ids[-keep:]))
    whole = _completion(server, truncate_prompt_tokens=-1)  # -1: max_model_len, more than the prompt
    assert whole["usage"]["prompt_tokens"] == len(ids)
    chat = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "truncate_prompt_tokens": keep})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == keep


def test_add_special_tokens_reaches_the_tokenizer(server):
    # the default model's tokenizer adds no special token to a text; a stand-in that adds a BOS
    # when asked shows which the server asked for
    state = server.state
    real = state.tokenizer

    class WithBos:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def __call__(self, text: str, add_special_tokens: bool = True) -> Any:
            from types import SimpleNamespace

            ids = list(real(text, add_special_tokens=False).input_ids)
            return SimpleNamespace(input_ids=([1] if add_special_tokens else []) + ids)

    n = len(real(PROMPT, add_special_tokens=False).input_ids)
    state.tokenizer = WithBos()
    try:
        assert _completion(server)["usage"]["prompt_tokens"] == n + 1
        assert _completion(server, add_special_tokens=False)["usage"]["prompt_tokens"] == n
    finally:
        state.tokenizer = real


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "[1, 512]"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "[1, 512]"),
    ({"truncate_prompt_tokens": 513}, "truncate_prompt_tokens", "[1, 512]"),
    ({"truncate_prompt_tokens": 2.5}, "truncate_prompt_tokens", ""),
    ({"allowed_token_ids": [10**9]}, "allowed_token_ids", "10000000"),
    ({"allowed_token_ids": []}, "allowed_token_ids", ""),
    ({"bad_words": [""]}, "bad_words", "empty"),
    ({"bad_words": ["   "]}, "bad_words", "no tokens"),
    ({"bad_words": ["w"] * 257}, "bad_words", "at most 256"),
    ({"bad_words": "word"}, "bad_words", ""),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_extras_are_400_naming_the_field(server, body, param, words, path):
    prompt = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": CHAT}
    r = _post(server, path, {**prompt, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
