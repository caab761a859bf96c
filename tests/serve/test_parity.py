"""OpenAI/vLLM parity of the server (issue 26): echo, cached tokens in usage, the context-length
error's code, the chat stream's shape, conversations that cannot be answered, CORS with
credentials, and vLLM's request/iteration metrics counted exactly."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from conftest import API_KEY, MODEL_NAME, metrics, start_server
from deepinfer.runtime.sampling_params import SamplingParams

PROMPT = "The capital of France is"
AUTH = {"authorization": f"Bearer {API_KEY}"}


def _sse(url: str, path: str, body: dict[str, Any]) -> list[Any]:
    events = []
    with httpx.stream("POST", f"{url}{path}", json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ---- completions: echo ----------------------------------------------------------------------------
def test_echo_puts_the_prompt_first_in_every_choice(client, reference_llm):
    ref = reference_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, echo=True, n=2)
    assert [c.text for c in resp.choices] == [PROMPT + ref.outputs[0].text] * 2
    ids = list(reference_llm.text_tokenizer(PROMPT).input_ids)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=5, temperature=0, echo=True)
    assert by_ids.choices[0].text == reference_llm.text_tokenizer.decode(ids) + ref.outputs[0].text
    assert resp.usage.completion_tokens == 2 * len(ref.outputs[0].token_ids)  # the echo is not generated


def test_echo_with_logprobs_gives_the_prompt_tokens_logprobs_first(client, reference_llm):
    ids = list(reference_llm.text_tokenizer(PROMPT).input_ids)
    ref = reference_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3, logprobs=2,
                                                          prompt_logprobs=2), use_tqdm=False)[0]
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                     logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    lp = resp.choices[0].logprobs
    out = ref.outputs[0]
    assert lp.tokens == [f"token_id:{t}" for t in ids + list(out.token_ids)]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first prompt token has none
    want = [None, *(p[t] for t, p in zip(ids[1:], ref.prompt_logprobs[1:], strict=True)),
            *(p[t] for t, p in zip(out.token_ids, out.logprobs, strict=True))]
    assert lp.token_logprobs[1:] == pytest.approx(want[1:], abs=1e-4)
    assert {int(k.split(":")[1]): v for k, v in lp.top_logprobs[1].items()} == pytest.approx(
        ref.prompt_logprobs[1], abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo_streams_the_prompt_in_the_first_chunk(server, client):
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    events = _sse(server.url, "/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4,
                                                  "temperature": 0, "echo": True, "stream": True})
    assert events[0]["choices"][0]["text"].startswith(PROMPT)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == whole.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs_alone(server, client, reference_llm, stream):
    # OpenAI's legacy scoring of a prompt (vLLM's echo without generation): nothing generated is
    # returned or counted; the prompt tokens' logprobs are the reference's prompt logprobs
    ids = list(reference_llm.text_tokenizer(PROMPT).input_ids)
    ref = reference_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                                 use_tqdm=False)[0]
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1,
            "return_tokens_as_token_ids": True}
    if stream:
        events = _sse(server.url, "/v1/completions", {**body, "stream": True,
                                                       "stream_options": {"include_usage": True}})
        choices = [e["choices"][0] for e in events[:-2]]
        text = "".join(c["text"] for c in choices)
        tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
        token_lps = [t for c in choices if c["logprobs"] for t in c["logprobs"]["token_logprobs"]]
        finish, usage = choices[-1]["finish_reason"], events[-2]["usage"]
    else:
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text, tokens, token_lps = choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]
        finish, usage = choice["finish_reason"], r.json()["usage"]
    assert text == PROMPT and tokens == [f"token_id:{t}" for t in ids]
    assert token_lps[0] is None
    assert token_lps[1:] == pytest.approx([p[t] for t, p in zip(ids[1:], ref.prompt_logprobs[1:], strict=True)],
                                          abs=1e-4)
    assert finish == "length" and usage["completion_tokens"] == 0 and usage["prompt_tokens"] == len(ids)
    bare = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60,
                      json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 0})
    assert bare.status_code == 400 and bare.json()["error"]["param"] == "max_tokens"  # only with echo


# ---- return_token_ids (vLLM's) -------------------------------------------------------------------
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_return_token_ids_gives_the_prompt_ids_and_each_choice_s_ids(server, reference_llm, kind, n):
    # non-streamed: against the reference's prompt and output ids; streamed: the prompt's ids
    # once (each completions choice's first chunk, chat's first chunk), the chunks' ids joined
    # equal to the non-streamed ones
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0.8, "seed": 3, "n": n,
                            "return_token_ids": True}
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, n=n)
    if kind == "chat":
        path, body["messages"] = "/v1/chat/completions", CHAT
        ref = reference_llm.chat(CHAT, params, use_tqdm=False)[0]
    else:
        path, body["prompt"] = "/v1/completions", PROMPT
        ref = reference_llm.generate([PROMPT], params, use_tqdm=False)[0]
    r = httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    whole = r.json()
    prompt_ids = whole["prompt_token_ids"] if kind == "chat" else None
    for choice, out in zip(whole["choices"], ref.outputs, strict=True):
        assert choice["token_ids"] == list(out.token_ids)
        if kind != "chat":
            prompt_ids = choice["prompt_token_ids"]
        assert prompt_ids == list(ref.prompt_token_ids)
    events = _sse(server.url, path, {**body, "stream": True})[:-1]
    streamed: dict[int, list[int]] = {i: [] for i in range(n)}
    prompts_seen: list[Any] = []
    for e in events:
        if "prompt_token_ids" in e:
            prompts_seen.append(e["prompt_token_ids"])
        for c in e["choices"]:
            streamed[c["index"]] += c["token_ids"]
            if "prompt_token_ids" in c:
                prompts_seen.append(c["prompt_token_ids"])
    assert streamed == {c["index"]: c["token_ids"] for c in whole["choices"]}
    assert prompts_seen == [list(ref.prompt_token_ids)] * (1 if kind == "chat" else n)
    plain = httpx.post(f"{server.url}{path}", json={**body, "return_token_ids": False}, headers=AUTH,
                       timeout=120).json()
    assert "prompt_token_ids" not in plain and all("token_ids" not in c for c in plain["choices"])


# ---- usage: cached tokens -------------------------------------------------------------------------
def test_usage_reports_the_prefix_cache_hits_as_cached_tokens(server, client):
    prompt = "A shared preamble that a second request repeats word for word, to hit the cache. " * 3
    block = server.state.llm.engine.cfg.block_size
    first = client.completions.create(model=MODEL_NAME, prompt=prompt + "One", max_tokens=1, temperature=0)
    second = client.completions.create(model=MODEL_NAME, prompt=prompt + "One", max_tokens=1, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    n_full = len(server.state.tokenizer(prompt + "One").input_ids)
    assert second.usage.prompt_tokens_details.cached_tokens == (n_full - 1) // block * block
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=1)
    assert chat.usage.prompt_tokens_details.cached_tokens >= 0


# ---- errors ---------------------------------------------------------------------------------------
def test_too_long_prompt_has_openais_code(client):
    for kwargs in ({"prompt": "word " * 600, "max_tokens": 4}, {"prompt": "Hi there", "max_tokens": 511}):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL_NAME, **kwargs)
        assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "word " * 600}])
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"


def test_a_conversation_ending_in_two_assistant_messages_is_400(client):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                {"role": "assistant", "content": "How can I help?"}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)
    assert info.value.param == "messages" and "two assistant" in info.value.message
    # one assistant message last is a conversation to continue: accepted
    client.chat.completions.create(model=MODEL_NAME, messages=messages[:2], max_tokens=2)


# ---- the chat stream's shape ----------------------------------------------------------------------
def test_chat_stream_role_chunk_then_text_then_an_empty_finish_chunk(server, client):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6,
            "temperature": 0, "stream": True}
    events = _sse(server.url, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-1]]
    assert chunks[0]["delta"] == {"role": "assistant", "content": ""} and chunks[0]["finish_reason"] is None
    assert all(set(c["delta"]) == {"content"} and c["finish_reason"] is None for c in chunks[1:-1])
    assert chunks[-1]["delta"] == {} and chunks[-1]["finish_reason"] == "length"
    # and the official client reads it
    streamed = client.chat.completions.create(**{k: v for k, v in body.items() if k != "stream"}, stream=True)
    parts = list(streamed)
    assert parts[0].choices[0].delta.role == "assistant"
    assert parts[-1].choices[0].finish_reason == "length" and parts[-1].choices[0].delta.content is None
    whole = client.chat.completions.create(**{k: v for k, v in body.items() if k != "stream"})
    assert "".join(p.choices[0].delta.content or "" for p in parts) == whole.choices[0].message.content


# ---- CORS with credentials ------------------------------------------------------------------------
@pytest.mark.parametrize("origins", [["http://app.example"], ["*"]])
def test_cors_allows_credentials_and_echoes_the_origin(served_llm, origins):
    origin = "http://app.example"
    with start_server(served_llm, allowed_origins=origins) as s:
        r = httpx.get(f"{s.url}/v1/models", headers={"origin": origin})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == origin  # never "*" with credentials
        assert r.headers["access-control-allow-credentials"] == "true"
        pre = httpx.options(f"{s.url}/v1/chat/completions", headers={
            "origin": origin, "access-control-request-method": "POST",
            "access-control-request-headers": "authorization,content-type"})
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == origin
        assert pre.headers["access-control-allow-credentials"] == "true"


# ---- vLLM's metrics, counted exactly --------------------------------------------------------------
def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_vllm_request_and_iteration_metrics_count_exactly(server, client):
    state = server.state
    prompt = "Count these metrics exactly, please:"
    n_prompt = len(state.tokenizer(prompt).input_ids)
    before, steps = metrics(server.url), state.engine.num_steps
    resp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, n=2, temperature=0.8, seed=3,
                                     extra_body={"ignore_eos": True})
    after, steps = metrics(server.url), state.engine.num_steps - steps
    assert resp.usage.completion_tokens == 8
    d = lambda name: _delta(before, after, f"deepinfer:{name}")  # noqa: E731
    assert d("request_params_n_count") == 1 and d("request_params_n_sum") == 2
    assert d("request_params_max_tokens_count") == 1 and d("request_params_max_tokens_sum") == 4
    assert d("iteration_tokens_total_count") == steps  # one observation per engine step
    assert d("iteration_tokens_total_sum") == n_prompt + 8  # the prompt at its first token + every token
    for phase in ("inference", "prefill", "decode"):
        assert d(f"request_{phase}_time_seconds_count") == 1
    assert d("request_inference_time_seconds_sum") == pytest.approx(
        d("request_prefill_time_seconds_sum") + d("request_decode_time_seconds_sum"), abs=1e-6)
    assert d("request_decode_time_seconds_sum") > 0
    info = [k for k in after if k.startswith("deepinfer:cache_config_info")]
    assert len(info) == 1 and after[info[0]] == 1
    cfg = state.llm.engine.cfg
    assert f"block_size={cfg.block_size}" in info[0] and f"num_gpu_blocks={cfg.num_blocks}" in info[0]
    assert "enable_prefix_caching=True" in info[0] and "cache_dtype=float32" in info[0]
    text = httpx.get(f"{server.url}/metrics").text
    for name, kind in (("iteration_tokens_total", "histogram"), ("request_params_n", "histogram"),
                       ("request_params_max_tokens", "histogram"), ("request_inference_time_seconds", "histogram"),
                       ("request_prefill_time_seconds", "histogram"), ("request_decode_time_seconds", "histogram"),
                       ("cache_config_info", "gauge")):
        assert f"# TYPE deepinfer:{name} {kind}" in text
