"""Continuous batching across HTTP requests, client disconnects at each stage, and /metrics."""

from __future__ import annotations

import asyncio
import time

import httpx
from conftest import API_KEY, MODEL_NAME, metrics, wait_until
from deepinfer.runtime.sampling_params import SamplingParams

TOPICS = ["cats", "rain", "trains", "bread", "music", "the sea", "chess", "winter", "bees", "maps",
          "clocks", "rivers", "tea", "stars", "glass", "wolves"]
PROMPTS = [f"A short note about {t}:" for t in TOPICS]
LONG = {"max_tokens": 400, "temperature": 0, "extra_body": {"ignore_eos": True}}


def _abort_count(url: str) -> float:
    return metrics(url)['deepinfer:request_success_total{finished_reason=abort}']


def _all_blocks_free(url: str) -> bool:
    m = metrics(url)
    return m["deepinfer:kv_cache_free_blocks"] == m["deepinfer:kv_cache_total_blocks"]


def test_16_concurrent_streams_each_equal_their_request_alone(server, async_client, reference_llm):
    before = metrics(server.url)

    async def one(c, prompt):
        stream = await c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0,
                                            stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def all_of_them():
        async with async_client() as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, p) for p in PROMPTS)), 300)

    texts = asyncio.run(all_of_them())
    alone = [reference_llm.generate([p], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
             for p in PROMPTS]
    assert texts == [ro.outputs[0].text for ro in alone]
    after = metrics(server.url)
    generated = sum(len(ro.outputs[0].token_ids) for ro in alone)
    prompt_tokens = sum(len(ro.prompt_token_ids) for ro in alone)
    assert after["deepinfer:generation_tokens_total"] - before["deepinfer:generation_tokens_total"] == generated
    assert after["deepinfer:prompt_tokens_total"] - before["deepinfer:prompt_tokens_total"] == prompt_tokens
    assert (after["deepinfer:e2e_request_latency_seconds_count"]
            - before["deepinfer:e2e_request_latency_seconds_count"]) == len(PROMPTS)
    assert (after["deepinfer:time_to_first_token_seconds_count"]
            - before["deepinfer:time_to_first_token_seconds_count"]) == len(PROMPTS)
    assert (after["deepinfer:request_generation_tokens_sum"]
            - before["deepinfer:request_generation_tokens_sum"]) == generated
    # one inter-token gap per token after each request's first (one token per step each)
    assert (after["deepinfer:inter_token_latency_seconds_count"]
            - before["deepinfer:inter_token_latency_seconds_count"]) == generated - len(PROMPTS)
    assert (after["deepinfer:request_queue_time_seconds_count"]
            - before["deepinfer:request_queue_time_seconds_count"]) == len(PROMPTS)
    finished = sum(after[f"deepinfer:request_success_total{{finished_reason={r}}}"]
                   - before[f"deepinfer:request_success_total{{finished_reason={r}}}"] for r in ("stop", "length"))
    assert finished == len(PROMPTS)


def test_a_client_closing_its_stream_aborts_it_within_2s_and_others_are_unaffected(server, async_client,
                                                                                   reference_llm):
    url = server.url

    async def closing_one(c):
        stream = await c.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], stream=True, **LONG)
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        await stream.close()
        return time.monotonic()

    async def normal(c, prompt):
        stream = await c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    # Alone: the abort shows in the metrics and every block is free again within 2 s.
    aborts = _abort_count(url)

    async def alone():
        async with async_client() as c:
            return await asyncio.wait_for(closing_one(c), 120)

    closed_at = asyncio.run(alone())
    wait_until(lambda: _abort_count(url) == aborts + 1 and _all_blocks_free(url), 2.0,
               "the closed stream's request is aborted and its KV blocks are free")
    assert time.monotonic() - closed_at < 2.0
    assert metrics(url)["deepinfer:num_requests_running"] == 0

    # With others in the batch: they complete exactly as alone.
    async def mixed():
        async with async_client() as c:
            others = [asyncio.ensure_future(normal(c, p)) for p in PROMPTS[1:4]]
            await closing_one(c)
            return await asyncio.wait_for(asyncio.gather(*others), 300)

    texts = asyncio.run(mixed())
    alone_refs = [reference_llm.generate([p], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
                  for p in PROMPTS[1:4]]
    assert texts == [ro.outputs[0].text for ro in alone_refs]
    wait_until(lambda: _abort_count(url) == aborts + 2 and _all_blocks_free(url), 2.0, "second abort")


def test_a_client_leaving_while_its_request_waits_aborts_it(server, served_llm):
    """Every batch slot busy: a non-streamed request waits, its client gives up, it never runs."""
    url = server.url
    slots = served_llm.engine.cfg.max_num_seqs
    aborts = _abort_count(url)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL_NAME, "prompt": "Tell me a long story.", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120, headers=headers) as http:
        streams, lines = [], []
        try:
            for _ in range(slots):
                cm = http.stream("POST", f"{url}/v1/completions", json=body)
                r = cm.__enter__()
                streams.append(cm)
                assert r.status_code == 200
                lines.append(r.iter_lines())  # kept: dropping the iterator closes the connection
                next(lines[-1])  # its first token: it holds a batch slot now
            assert metrics(url)["deepinfer:num_requests_running"] == slots
            before_prompt = metrics(url)["deepinfer:prompt_tokens_total"]
            try:
                httpx.post(f"{url}/v1/completions", headers=headers, timeout=0.5,
                           json={"model": MODEL_NAME, "prompt": "Waiting here", "max_tokens": 4})
                raise AssertionError("the request did not wait for a batch slot")
            except httpx.ReadTimeout:
                left_at = time.monotonic()
            wait_until(lambda: _abort_count(url) == aborts + 1, 2.0, "the waiting request is aborted")
            assert time.monotonic() - left_at < 2.0
            assert metrics(url)["deepinfer:num_requests_waiting"] == 0
            assert metrics(url)["deepinfer:prompt_tokens_total"] == before_prompt  # it was never prefilled
        finally:
            for cm in streams:
                cm.__exit__(None, None, None)
    wait_until(lambda: _abort_count(url) == aborts + 1 + slots and _all_blocks_free(url), 2.0,
               "the decoding requests are aborted when their clients close")


def test_prefix_cache_counters_count_a_repeated_prompt(server, client):
    prompt = "Here is a long shared system prompt that many requests repeat word for word. " * 3
    before = metrics(server.url)
    for _ in range(2):
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0)
    after = metrics(server.url)
    block = server.state.llm.engine.cfg.block_size
    n = len(server.state.tokenizer(prompt).input_ids)
    hits = after["deepinfer:prefix_cache_hits_total"] - before["deepinfer:prefix_cache_hits_total"]
    queries = after["deepinfer:prefix_cache_queries_total"] - before["deepinfer:prefix_cache_queries_total"]
    assert queries == 2 * n
    assert hits == (n - 1) // block * block  # the second request's full blocks (its last token is recomputed)


def test_metrics_after_the_load_show_nothing_running_and_every_block_free(server):
    wait_until(lambda: metrics(server.url)["deepinfer:num_requests_running"] == 0, 5.0, "idle")
    m = metrics(server.url)
    assert m["deepinfer:num_requests_running"] == 0 and m["deepinfer:num_requests_waiting"] == 0
    assert m["deepinfer:kv_cache_free_blocks"] == m["deepinfer:kv_cache_total_blocks"] > 0
    assert m["deepinfer:kv_cache_usage_perc"] == 0
    assert server.state.in_flight == 0
