"""``LLM(logprobs_mode=...)`` (issue 26): vLLM's four modes, each against a reference computed here
from transformers' logits on the same tiny random model.

raw_logits / raw_logprobs: the model's logits (or their log_softmax) before any processing.
processed_logits / processed_logprobs: after logit bias, frequency penalty (counted by hand from
the output so far), temperature and top-k (greedy rows: no temperature, no cut, as vLLM's).
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import save_tiny_model, save_tiny_tokenizer

VOCAB = 64
PROMPT = [5, 9, 17, 33, 4]
BIAS = {7: 2.5, 40: -1.5}
K = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-lpmode")
    model = save_tiny_model(path, "llama", seed=3, vocab=VOCAB)
    save_tiny_tokenizer(path, vocab=VOCAB)
    return str(path), model


def _llm(path: str, mode: str):
    from deepinfer import LLM

    return LLM(path, dtype="float32", max_model_len=64, cpu_kv_cache_bytes=8 << 20, num_threads=1,
               logprobs_mode=mode)


def _hf_logits(model, tokens: list[int]) -> torch.Tensor:
    """transformers' logits [len(tokens), V] (row i scores token i + 1)."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def _reference(model, out_ids: list[int], mode: str, greedy: bool) -> list[torch.Tensor]:
    """What each output position's logprobs must report in ``mode`` ([V] per position)."""
    logits = _hf_logits(model, PROMPT + out_ids)[len(PROMPT) - 1:-1]
    rows = []
    for i, raw in enumerate(logits):
        if mode.startswith("raw"):
            x = raw
        else:
            x = raw.clone()
            for t, b in BIAS.items():
                x[t] += b
            counts = torch.bincount(torch.tensor(out_ids[:i], dtype=torch.int64), minlength=VOCAB).float()
            x = x - 0.4 * counts
            if not greedy:
                x = x / 0.8
                kth = x.topk(K).values[-1]
                x = x.masked_fill(x < kth, float("-inf"))
        rows.append(torch.log_softmax(x, -1) if mode.endswith("logprobs") else x)
    return rows


def _check(c, ref: list[torch.Tensor], k: int) -> None:
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) == len(ref)
    total = 0.0
    for tok, entry, want in zip(c.token_ids, c.logprobs, ref, strict=True):
        items = list(entry.items())
        assert items[0][0] == tok  # the sampled token first
        assert items[0][1] == pytest.approx(float(want[tok]), abs=2e-4)
        total += items[0][1]
        top = want.topk(k)
        got = dict(items)
        for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            if math.isinf(v):
                assert got[t] == v
            else:
                assert got[t] == pytest.approx(v, abs=2e-4)
        assert set(got) == set(top.indices.tolist()) | {tok}
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-3)  # the sum of what is reported


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_each_mode_matches_transformers_reference(tiny, mode):
    from deepinfer import SamplingParams

    path, model = tiny
    llm = _llm(path, mode)
    sampled = SamplingParams(temperature=0.8, top_k=K, seed=11, max_tokens=6, logprobs=4, logit_bias=BIAS,
                             frequency_penalty=0.4, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, logprobs=4, logit_bias=BIAS, frequency_penalty=0.4,
                            ignore_eos=True)
    outs = llm.generate([PROMPT, PROMPT], [sampled, greedy], use_tqdm=False)  # one batch, mixed rows
    for out, is_greedy in zip(outs, (False, True), strict=True):
        c = out.outputs[0]
        _check(c, _reference(model, list(c.token_ids), mode, is_greedy), 4)


def test_processed_mode_of_an_all_greedy_batch(tiny):
    from deepinfer import SamplingParams

    path, model = tiny
    llm = _llm(path, "processed_logits")
    sp = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, logit_bias=BIAS, frequency_penalty=0.4,
                        ignore_eos=True)
    c = llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0]
    _check(c, _reference(model, list(c.token_ids), "processed_logits", True), 3)


def test_prompt_logprobs_stay_raw_logprobs(tiny):
    from deepinfer import SamplingParams

    path, model = tiny
    llm = _llm(path, "processed_logits")
    out = llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=2, temperature=0.5, top_k=3),
                       use_tqdm=False)[0]
    ref = torch.log_softmax(_hf_logits(model, PROMPT), -1)
    assert out.prompt_logprobs[0] is None
    for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry[PROMPT[i]] == pytest.approx(float(ref[i - 1, PROMPT[i]]), abs=2e-4)


def test_bad_mode_and_speculative_are_refused():
    from deepinfer.runtime.engine_args import EngineArgs

    assert EngineArgs().logprobs_mode == "raw_logprobs"  # vLLM's default
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        EngineArgs(logprobs_mode="logits")
    with pytest.raises(ValueError, match="logprobs_mode='raw_logits' does not run with speculative"):
        EngineArgs(logprobs_mode="raw_logits", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
