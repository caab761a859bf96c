"""The OpenAI API through the official ``openai`` client (sync and async) against in-process
``LLM.generate`` / ``LLM.chat`` on an independent LLM with the same weights."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from conftest import API_KEY, MODEL_NAME
from deepinfer.runtime.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
IDS = {"return_tokens_as_token_ids": True}


def ids_of(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.split(":", 1)[1]) for t in tokens]


def reference(llm: Any, prompt: Any, **params: Any) -> Any:
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]


def test_models_lists_the_served_names(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME, "alias"]


def test_greedy_completions_equal_llm_generate_token_for_token(client, reference_llm):
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=8, temperature=0,
                                     logprobs=0, extra_body=IDS)
    assert [c.index for c in resp.choices] == [0, 1]
    n_prompt = n_completion = 0
    for choice, prompt in zip(resp.choices, PROMPTS, strict=True):
        ref = reference(reference_llm, prompt, temperature=0, max_tokens=8)
        assert ids_of(choice.logprobs.tokens) == list(ref.outputs[0].token_ids)
        assert choice.text == ref.outputs[0].text
        assert choice.finish_reason == ref.outputs[0].finish_reason
        n_prompt += len(ref.prompt_token_ids)
        n_completion += len(ref.outputs[0].token_ids)
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (n_prompt, n_completion)
    assert resp.usage.total_tokens == n_prompt + n_completion


def test_token_id_prompts_equal_string_prompts(client, reference_llm):
    ids = list(reference_llm.tokenizer(PROMPTS[0]).input_ids)
    a = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=5, temperature=0)
    b = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=5, temperature=0)
    assert a.choices[0].text == b.choices[0].text and a.usage.prompt_tokens == len(ids)


def test_greedy_chat_equals_llm_chat_async(async_client, reference_llm):
    async def go():
        async with async_client() as c:
            return await c.chat.completions.create(model="alias", messages=CHAT, max_completion_tokens=10,
                                                   temperature=0, logprobs=True, extra_body=IDS)

    resp = asyncio.run(go())
    ref = reference_llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    msg = resp.choices[0]
    assert msg.message.role == "assistant"
    assert ids_of([t.token for t in msg.logprobs.content]) == list(ref.outputs[0].token_ids)
    assert msg.message.content == ref.outputs[0].text
    assert msg.finish_reason == ref.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert resp.model == "alias"


def _sse_events(server_url: str, path: str, body: dict[str, Any]) -> list[Any]:
    """Raw SSE data payloads ("[DONE]" kept as the string)."""
    events = []
    with httpx.stream("POST", f"{server_url}{path}", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
            else:
                assert line == "", line
    return events


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_stream_deltas_join_to_the_non_streamed_text(server, client, kind):
    common = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0.7, "seed": 11, "n": 2}
    if kind == "chat":
        path, body = "/v1/chat/completions", {**common, "messages": CHAT}
        whole = client.chat.completions.create(**body)
        texts = {c.index: c.message.content for c in whole.choices}
    else:
        path, body = "/v1/completions", {**common, "prompt": PROMPTS[0]}
        whole = client.completions.create(**body)
        texts = {c.index: c.text for c in whole.choices}
    events = _sse_events(server.url, path, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    # (cached_tokens may differ: the streamed request finds the first one's prompt cached)
    usage_chunk["usage"].pop("prompt_tokens_details")
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole.usage.model_dump(
        exclude_none=True, exclude={"prompt_tokens_details"})
    chunks = events[:-2]
    assert all(c["usage"] is None for c in chunks)
    joined: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, list[str]] = {0: [], 1: []}
    roles = []
    for c in chunks:
        (choice,) = c["choices"]
        i = choice["index"]
        assert not finishes[i], f"choice {i} got a chunk after its finish chunk"
        if kind == "chat":
            delta = choice["delta"]
            if "role" in delta:
                roles.append(i)
            joined[i] += delta.get("content") or ""
        else:
            joined[i] += choice["text"]
        if choice["finish_reason"] is not None:
            finishes[i].append(choice["finish_reason"])
    assert joined == texts
    assert finishes == {c.index: [c.finish_reason] for c in whole.choices}  # exactly one each
    if kind == "chat":
        assert roles == [0, 1]  # each choice opens with the role, before any content


def test_stream_through_the_client_sync_and_async(client, async_client):
    body = {"model": MODEL_NAME, "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0}
    whole = client.completions.create(**body).choices[0].text
    sync_text = "".join(c.choices[0].text for c in client.completions.create(**body, stream=True) if c.choices)

    async def go():
        async with async_client() as c:
            stream = await c.completions.create(**body, stream=True)
            return "".join([c.choices[0].text async for c in stream if c.choices])

    assert sync_text == whole == asyncio.run(go())


def test_n2_with_a_seed_is_reproducible_and_equals_llm(client, reference_llm):
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 1.0, "n": 2, "seed": 1234,
            "extra_body": IDS, "logprobs": 0}
    a = client.completions.create(**body)
    b = client.completions.create(**body)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    ref = reference(reference_llm, PROMPTS[0], temperature=1.0, max_tokens=8, n=2, seed=1234)
    assert [ids_of(c.logprobs.tokens) for c in a.choices] == [list(c.token_ids) for c in ref.outputs]
    assert a.usage.completion_tokens == sum(len(c.token_ids) for c in ref.outputs)


def test_stop_strings_end_the_text_as_in_llm(client, reference_llm):
    free = reference(reference_llm, PROMPTS[1], temperature=0, max_tokens=16).outputs[0].text
    stop = free.strip().split()[2]  # a word in the middle of the greedy continuation
    ref = reference(reference_llm, PROMPTS[1], temperature=0, max_tokens=16, stop=[stop]).outputs[0]
    assert ref.finish_reason == "stop" and stop not in ref.text
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                     stop=[stop])
    assert resp.choices[0].text == ref.text
    assert resp.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                       stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == ref.text


def test_completion_logprobs_equal_llm(client, reference_llm):
    ref = reference(reference_llm, PROMPTS[0], temperature=0, max_tokens=6, logprobs=3).outputs[0]
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                     logprobs=3, extra_body=IDS)
    lp = resp.choices[0].logprobs
    assert ids_of(lp.tokens) == list(ref.token_ids)
    for got, token, top, want in zip(lp.token_logprobs, ref.token_ids, lp.top_logprobs, ref.logprobs, strict=True):
        assert got == pytest.approx(want[token], abs=1e-4)
        assert {int(k.split(":")[1]): v for k, v in top.items()} == pytest.approx(want, abs=1e-4)


def test_chat_top_logprobs_equal_llm(client, reference_llm):
    ref = reference_llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=5, logprobs=2), use_tqdm=False)[0]
    resp = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body=IDS)
    content = resp.choices[0].logprobs.content
    for entry, token, want in zip(content, ref.outputs[0].token_ids, ref.outputs[0].logprobs, strict=True):
        assert entry.token == f"token_id:{token}" and entry.logprob == pytest.approx(want[token], abs=1e-4)
        best = sorted(want.items(), key=lambda kv: -kv[1])[:2]
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == [
            (f"token_id:{k}", pytest.approx(v, abs=1e-4)) for k, v in best]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"best_of": 2}, "best_of", "not supported"),
    ({"suffix": "x"}, "suffix", "not supported"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"temperature": -1}, "temperature", ">= 0"),
    ({"n": 0}, "n", ">= 1"),
    ({"n": 9}, "n", "--max-num-seqs 8"),
    ({"logprobs": 50}, "logprobs", "<= 20"),
    ({"logprobs": -1}, "logprobs", "only offline"),  # the offline API's whole vocabulary, not served
    ({"logit_bias": {"999999": 1.0}}, "logit_bias", "vocabulary"),
    ({"frequency_penalty": 3}, "frequency_penalty", "[-2, 2]"),
    ({"max_tokens": 600}, "max_tokens", "512"),
    ({"prompt": "word " * 600}, "prompt", "512"),
    ({"prompt": [999999]}, "prompt", "vocabulary"),
    ({"made_up": 1}, "made_up", "unrecognized"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream"),
])
def test_bad_completion_parameters_are_400_naming_the_param(client, body, param, words):
    args = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 4, **body}
    known = {k: args.pop(k) for k in list(args) if k in ("made_up", "stream_options")}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**args, extra_body=known)
    assert info.value.param == param
    assert words in info.value.message


def test_too_long_prompt_names_both_counts(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="Hi there", max_tokens=511)
    assert info.value.param == "max_tokens"
    assert "512" in info.value.message and "511" in info.value.message


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"name": 5}}]}, "tools[0]"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
])
def test_bad_chat_parameters_are_400_naming_the_param(client, body, param):
    args = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 4, **body}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**args)
    assert info.value.param == param


def test_unknown_model_is_404_listing_the_served_names(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=2)
    assert info.value.param == "model"
    assert MODEL_NAME in info.value.message and "alias" in info.value.message


def test_missing_or_wrong_key_is_401(server):
    for key in ("wrong", ""):
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key or "x", max_retries=0,
                          default_headers={} if key else {"Authorization": ""})
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200  # health needs no key


def test_tokenize_detokenize_and_version(server, reference_llm):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPTS[0]}, headers=headers).json()
    assert r["tokens"] == list(reference_llm.tokenizer(PROMPTS[0]).input_ids) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 512
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}, headers=headers).json()
    assert chat["tokens"] == reference_llm.apply_chat_template(CHAT)["prompt_token_ids"]
    d = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}, headers=headers).json()
    assert d["prompt"] == reference_llm.tokenizer.decode(r["tokens"])
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [10**9]}, headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    v = httpx.get(f"{server.url}/version").json()
    assert set(v) == {"version", "engine_version"}
    assert httpx.get(f"{server.url}/nope").json()["error"]["message"] == "Not Found"


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_continuous_usage_stats_give_every_chunk_the_usage_so_far(server, client, kind, n):
    # vLLM's stream_options.continuous_usage_stats (with include_usage): each chunk's usage counts
    # the tokens sent up to and with it; the last equals the non-streamed usage
    common = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0.7, "seed": 5, "n": n}
    if kind == "chat":
        path, body = "/v1/chat/completions", {**common, "messages": CHAT}
        whole = client.chat.completions.create(**body)
    else:
        path, body = "/v1/completions", {**common, "prompt": PROMPTS[1]}
        whole = client.completions.create(**body)
    events = _sse_events(server.url, path, {**body, "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    assert events[-1] == "[DONE]"
    chunks, last = events[:-2], events[-2]
    want = whole.usage.model_dump(exclude_none=True, exclude={"prompt_tokens_details"})
    last["usage"].pop("prompt_tokens_details")
    assert last["choices"] == [] and last["usage"] == want
    counts = []
    for c in chunks:
        u = c["usage"]
        assert u["prompt_tokens"] == want["prompt_tokens"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        counts.append(u["completion_tokens"])
    assert counts == sorted(counts) and counts[-1] == want["completion_tokens"]
    assert counts[0] <= n  # (chat's first chunks are the roles, before any token)
    plain = _sse_events(server.url, path, {**body, "stream": True, "stream_options": {
        "include_usage": False, "continuous_usage_stats": True}})  # (only with include_usage, as vLLM)
    assert all("usage" not in c for c in plain[:-1])
