"""vLLM's served beam search (``use_beam_search``): the ``n`` choices are the ``n`` best beams,
best first, scored ``cum_logprob / len ** length_penalty``. Checked against the offline search
(``LLM.beam_search`` on an independent LLM, itself checked against an exhaustive search in
``tests/runtime/test_beam_search.py``): the same token ids per beam, the text of those ids without
a final end-of-sequence token, the finish reasons; whole and streamed, both routes, through the
engine thread and the engine-core process. Fields a search does not use are 400s naming them."""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import API_KEY, MODEL_NAME, read_until_listening, start_serve_process

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The three primary colours are"


def _expected(llm: Any, prompt_ids: list[int], width: int, max_tokens: int, length_penalty: float = 1.0):
    """(token ids, text, finish reason) of each beam of the offline search, best first."""
    from deepinfer.runtime.beam_search import BeamSearchParams

    out = llm.beam_search([{"prompt_token_ids": prompt_ids}],
                          BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=length_penalty))[0]
    eos = set(llm.eos_token_ids)
    rows = []
    for seq in out.sequences:
        ids = seq.output_token_ids
        shown = ids[:-1] if seq.finish_reason == "stop" and ids[-1] in eos else ids
        rows.append((ids, llm.text_tokenizer.decode(shown, skip_special_tokens=True), seq.finish_reason))
    return rows


def _post(url: str, route: str, body: dict[str, Any]) -> Any:
    import httpx

    r = httpx.post(f"{url}/v1/{route}", json={"model": MODEL_NAME, **body}, headers=HEADERS, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _served(url: str, route: str, body: dict[str, Any]):
    out = _post(url, route, {**body, "use_beam_search": True, "return_token_ids": True})
    key = "text" if route == "completions" else "message"
    rows = []
    for c in sorted(out["choices"], key=lambda c: c["index"]):
        text = c["text"] if key == "text" else c["message"]["content"]
        rows.append((c["token_ids"], text, c["finish_reason"]))
    return rows, out["usage"]


@pytest.mark.parametrize(("width", "max_tokens", "length_penalty"), [(1, 6, 1.0), (3, 6, 1.0), (4, 5, 0.5)])
def test_completions_beams_are_the_offline_search(server, reference_llm, width, max_tokens, length_penalty):
    ids = list(reference_llm.text_tokenizer(PROMPT).input_ids)
    got, usage = _served(server.url, "completions", {"prompt": PROMPT, "n": width, "max_tokens": max_tokens,
                                                     "length_penalty": length_penalty})
    assert got == _expected(reference_llm, ids, width, max_tokens, length_penalty)
    assert usage["prompt_tokens"] == len(ids)
    assert usage["completion_tokens"] == sum(len(r[0]) for r in got)


def test_chat_beams_are_the_offline_search(server, reference_llm):
    messages = [{"role": "user", "content": "Name a fruit."}]
    ids = reference_llm.apply_chat_template(messages)["prompt_token_ids"]
    got, _ = _served(server.url, "chat/completions", {"messages": messages, "n": 3, "max_tokens": 8})
    assert got == _expected(reference_llm, ids, 3, 8)


def test_a_streamed_search_joins_to_the_whole_one(server):
    import httpx

    body = {"model": MODEL_NAME, "prompt": PROMPT, "n": 3, "max_tokens": 6, "use_beam_search": True, "stream": True,
            "stream_options": {"include_usage": True}}
    whole = _post(server.url, "completions", {k: v for k, v in body.items() if k not in ("stream", "stream_options")})
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=HEADERS, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                if c["finish_reason"]:
                    finish[c["index"]] = c["finish_reason"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert finish == {c["index"]: c["finish_reason"] for c in whole["choices"]}
    assert usage == whole["usage"]


def test_beam_search_through_the_engine_core_process(reference_llm):
    proc = start_serve_process()
    lines: list[str] = []
    try:
        url = read_until_listening(proc, lines, 180)
        import httpx

        r = httpx.post(f"{url}/v1/completions", timeout=300, json={
            "model": "m", "prompt": PROMPT, "n": 3, "max_tokens": 6, "use_beam_search": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        got = [(c["token_ids"], c["text"], c["finish_reason"]) for c in r.json()["choices"]]
        ids = list(reference_llm.text_tokenizer(PROMPT).input_ids)
        assert got == _expected(reference_llm, ids, 3, 6)
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"use_beam_search": True, "n": 11}, "n", "--max-num-seqs 8"),  # (the server's bound comes first here)
    ({"use_beam_search": True, "top_p": 0.5}, "top_p", "not used by beam search"),
    ({"use_beam_search": True, "stop": ["."]}, "stop", "not used by beam search"),
    ({"use_beam_search": True, "logprobs": 0}, "logprobs", "not used by beam search"),
    ({"use_beam_search": True, "response_format": {"type": "json_object"}}, "response_format", "not used by beam"),
    ({"length_penalty": 0.5}, "length_penalty", "applies to beam search only"),
])
def test_a_field_a_search_cannot_use_is_a_400_naming_it(server, extra, param, words):
    import httpx

    r = httpx.post(f"{server.url}/v1/completions", headers=HEADERS, timeout=60,
                   json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_the_beam_width_is_bounded():
    from deepinfer.runtime.sampling_params import SamplingParams
    from deepinfer.serve.protocol import APIError, CompletionRequest, beam_search_params

    req = CompletionRequest(prompt="Hi", n=11, use_beam_search=True)
    with pytest.raises(APIError, match=r"n \(the beam width\) must be in \[1, 10\]") as err:
        beam_search_params(req, SamplingParams(n=11, max_tokens=4))
    assert err.value.param == "n"
    req = CompletionRequest(prompt="Hi", n=2, use_beam_search=True, length_penalty=float("inf"))
    with pytest.raises(APIError, match="length_penalty must be a finite number"):
        beam_search_params(req, SamplingParams(n=2, max_tokens=4))


def test_values_that_change_nothing_are_accepted(server, reference_llm):
    # clients that always send the sampling defaults (top_p 1, top_k -1, a text response format,
    # a seed) still get the search; each of these changes nothing in it
    ids = list(reference_llm.text_tokenizer(PROMPT).input_ids)
    got, _ = _served(server.url, "completions", {
        "prompt": PROMPT, "n": 2, "max_tokens": 4, "top_p": 1.0, "top_k": -1, "min_p": 0, "seed": 7,
        "repetition_penalty": 1, "presence_penalty": 0.0, "stop": [], "logit_bias": {},
        "response_format": {"type": "text"}})
    assert got == _expected(reference_llm, ids, 2, 4)
