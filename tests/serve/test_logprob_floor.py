"""A logprob of -inf is served as -9999.0, as vLLM serves it (JSON has no infinity).

Under ``logprobs_mode="processed_logprobs"`` the tokens that top-k masked have a logprob of -inf.
Before, a whole response holding one failed to render (a 500 naming a ValueError) and a stream
wrote it as ``null``, which the OpenAI client's float fields do not accept. Checked against the
same LLM's ``generate`` with the same seed, run before it is served: the -inf entries and only
they are -9999.0, and the others are its values."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from conftest import MODEL_NAME, _llm, start_server
from deepinfer.runtime.sampling_params import SamplingParams

PROMPT = "The capital of France is"
ASK = {"max_tokens": 4, "temperature": 1.0, "top_k": 2, "seed": 11}
TOP = 5


@pytest.fixture(scope="module")
def served() -> Any:
    llm = _llm(max_num_seqs=4, logprobs_mode="processed_logprobs")
    sp = SamplingParams(max_tokens=4, temperature=1.0, top_k=2, seed=11, logprobs=TOP)
    ref = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0]
    with start_server(llm) as server:
        yield server, ref


def _floored(lp: dict[int, float]) -> dict[int, float]:
    return {k: -9999.0 if v == -math.inf else v for k, v in lp.items()}


def test_the_reference_has_masked_entries(served):
    _, ref = served
    # top-k 2 keeps two tokens a step: the other three of the top 5 are -inf
    assert all(sum(v == -math.inf for v in lp.values()) == TOP - 2 for lp in ref.logprobs)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_floor_minus_inf(served, stream):
    import httpx

    server, ref = served
    body = {"model": MODEL_NAME, "prompt": PROMPT, "logprobs": TOP, "return_tokens_as_token_ids": True,
            "stream": stream, **ASK}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
        tokens = [t for p in parts for t in p["tokens"]]
        top = [t for p in parts for t in p["top_logprobs"]]
        token_lps = [t for p in parts for t in p["token_logprobs"]]
    else:
        lp = r.json()["choices"][0]["logprobs"]
        tokens, top, token_lps = lp["tokens"], lp["top_logprobs"], lp["token_logprobs"]
    assert [int(t.split(":")[1]) for t in tokens] == list(ref.token_ids)
    got = [{int(k.split(":")[1]): v for k, v in d.items()} for d in top]
    want = [_floored(lp) for lp in ref.logprobs]
    assert got == [pytest.approx(w, abs=1e-4) for w in want]
    assert token_lps == [pytest.approx(lp[t], abs=1e-4) for t, lp in zip(ref.token_ids, ref.logprobs, strict=True)]


def test_chat_floors_minus_inf_and_the_openai_client_reads_it(served):
    import openai

    server, _ = served
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    resp = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                          logprobs=True, top_logprobs=TOP, extra_body={"top_k": 2, "seed": 11},
                                          max_tokens=4, temperature=1.0)
    content = resp.choices[0].logprobs.content
    assert content and all(sorted(t.logprob for t in e.top_logprobs)[:TOP - 2] == [-9999.0] * (TOP - 2)
                           for e in content)
    assert all(e.logprob > -9999.0 for e in content)  # the sampled token is one top-k kept
