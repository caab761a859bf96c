"""``SamplingParams(logprobs=-1)`` / ``prompt_logprobs=-1`` (issue 26): the whole vocabulary's
logprobs, as vLLM's (tests/v1/sample/test_logprobs.py: -1 = vocab size, bounded by
``LLM(max_logprobs=...)`` where -1 means no cap).

Each position must hold every token of the vocabulary with transformers' log_softmax (computed
here on the same tiny random model), the chosen token first, then descending; the sum over the
chosen tokens is ``cumulative_logprob``; the prompt's positions as well (position 0: None).
"""

from __future__ import annotations

import pickle

import pytest
import torch
from tiny_models import save_tiny_model, save_tiny_tokenizer

VOCAB = 64
PROMPT = [5, 9, 17, 33, 4]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-lp-all")
    model = save_tiny_model(path, "llama", seed=5, vocab=VOCAB)
    save_tiny_tokenizer(path, vocab=VOCAB)
    return str(path), model


def _llm(path: str, **kw):
    from deepinfer import LLM

    opts = dict(dtype="float32", max_model_len=64, cpu_kv_cache_bytes=8 << 20, num_threads=1, max_logprobs=-1)
    opts.update(kw)
    return LLM(path, **opts)


def _hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), -1)


def _check_position(m, chosen: int, want: torch.Tensor) -> None:
    assert len(m) == VOCAB
    keys = list(m)
    assert keys[0] == chosen and sorted(keys) == list(range(VOCAB))
    rest = [m[t] for t in keys[1:]]
    assert rest == sorted(rest, reverse=True)  # then by descending logprob
    got = torch.tensor([m[t] for t in range(VOCAB)])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_whole_vocabulary_per_output_token_for_each_sample(tiny):
    from deepinfer import SamplingParams

    path, model = tiny
    llm = _llm(path)
    sp = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=5, logprobs=-1, ignore_eos=True)
    assert sp.logprobs == -1 and sp == sp.clone() and pickle.loads(pickle.dumps(sp)).logprobs == -1
    out = llm.generate(PROMPT, sp, use_tqdm=False)[0]
    assert len(out.outputs) == 2
    for c in out.outputs:  # each sample's rows are its own (reference along its own tokens)
        toks = list(c.token_ids)
        ref = _hf_logprobs(model, PROMPT + toks)[len(PROMPT) - 1:-1]
        assert len(c.logprobs) == len(toks)
        for m, t, want in zip(c.logprobs, toks, ref, strict=True):
            _check_position(m, t, want)
        assert c.cumulative_logprob == pytest.approx(sum(m[t] for m, t in zip(c.logprobs, toks, strict=True)),
                                                     abs=1e-4)
    assert dict(out.outputs[0].logprobs[0]) == dict(out.outputs[0].logprobs[0].items())  # plain dict on demand


def test_whole_vocabulary_prompt_logprobs(tiny):
    from deepinfer import SamplingParams

    path, model = tiny
    llm = _llm(path)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=-1), use_tqdm=False)[0]
    ref = _hf_logprobs(model, PROMPT)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for p in range(1, len(PROMPT)):
        _check_position(out.prompt_logprobs[p], PROMPT[p], ref[p - 1])
    assert out.outputs[0].logprobs is None  # only what was asked
    one = llm.generate([7], SamplingParams(max_tokens=1, prompt_logprobs=-1), use_tqdm=False)[0]
    assert one.prompt_logprobs == [None]  # a one-token prompt, as vLLM


def test_mixed_batch_and_stream_deltas(tiny):
    from deepinfer import SamplingParams

    path, _ = tiny
    llm = _llm(path)
    full = SamplingParams(temperature=0, max_tokens=6, logprobs=-1, ignore_eos=True)
    top = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    a, b = llm.generate([PROMPT, PROMPT[:3]], [full, top], use_tqdm=False)
    assert all(len(m) == VOCAB for m in a.outputs[0].logprobs)
    assert all(len(d) in (3, 4) and isinstance(d, dict) for d in b.outputs[0].logprobs)  # untouched top-k
    streamed = []
    for delta in llm.stream(PROMPT, full):
        for c in delta.outputs:
            assert len(c.logprobs) == len(c.token_ids)
            streamed.extend(c.logprobs)
    assert len(streamed) == len(a.outputs[0].logprobs)
    for got, want in zip(streamed, a.outputs[0].logprobs, strict=True):  # (batched vs alone: float noise)
        assert next(iter(got)) == next(iter(want))
        torch.testing.assert_close(torch.tensor([got[t] for t in range(VOCAB)]),
                                   torch.tensor([want[t] for t in range(VOCAB)]), atol=2e-5, rtol=0)


def test_raw_logits_mode_reports_whole_logit_rows(tiny):
    from deepinfer import SamplingParams

    path, model = tiny
    llm = _llm(path, logprobs_mode="raw_logits")
    c = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, logprobs=-1, ignore_eos=True),
                     use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + list(c.token_ids)])).logits[0].float()
    for i, m in enumerate(c.logprobs):
        torch.testing.assert_close(torch.tensor([m[t] for t in range(VOCAB)]), logits[len(PROMPT) - 1 + i],
                                   atol=2e-4, rtol=0)


def test_max_logprobs_bounds_the_whole_vocabulary(tiny):
    from deepinfer import SamplingParams

    path, _ = tiny
    sp = SamplingParams(max_tokens=1, logprobs=-1)
    with pytest.raises(ValueError, match=r"logprobs=-1 \(the whole vocabulary, 64 tokens\) is more than "
                                         r"max_logprobs=20"):
        _llm(path, max_logprobs=20).generate(PROMPT, sp, use_tqdm=False)  # vLLM's default refuses it too
    with pytest.raises(ValueError, match="max_logprobs=63"):
        _llm(path, max_logprobs=63).generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=-1),
                                             use_tqdm=False)
    out = _llm(path, max_logprobs=64).generate(PROMPT, sp, use_tqdm=False)[0]  # a cap of the vocabulary size
    assert len(out.outputs[0].logprobs[0]) == VOCAB
    with pytest.raises(ValueError, match=r"-2 must be >= 0 \(or None, or -1 for the whole vocabulary\)"):
        SamplingParams(logprobs=-2)


def test_overlap_loop_stays_synchronous_with_the_same_rows(tiny):
    """With overlap scheduling on (the CUDA default; forced here on CPU) a logprobs=-1 request,
    like any logprobs request, keeps the loop synchronous: its rows are those of the plain loop."""
    from deepinfer import SamplingParams

    path, _ = tiny
    sp = SamplingParams(temperature=0.9, seed=4, max_tokens=8, logprobs=-1, ignore_eos=True)
    prompts = [PROMPT, PROMPT[:2], PROMPT[1:]]
    sync = _llm(path, overlap_scheduling=False).generate(prompts, sp, use_tqdm=False)
    ahead_llm = _llm(path, overlap_scheduling=True)
    ahead = ahead_llm.generate(prompts, sp, use_tqdm=False)
    assert ahead_llm.engine.overlap is not None and ahead_llm.engine.overlap.num_ahead == 0
    for a, b in zip(sync, ahead, strict=True):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        for ma, mb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            torch.testing.assert_close(torch.tensor([ma[t] for t in range(VOCAB)]),
                                       torch.tensor([mb[t] for t in range(VOCAB)]), atol=1e-5, rtol=0)
