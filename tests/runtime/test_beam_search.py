"""``LLM.beam_search`` (vLLM's interface and score; issue 26), on a tiny random float32 Llama.

Reference: an exhaustive beam search written here over transformers' own logits of the same
weights (every vocabulary token expanded from every beam, logprobs from a full forward of each
sequence): the returned sequences, their order and cumulative logprobs must match. Also as vLLM's
tests check: width 1 is the greedy completion; a concurrency limit gives the same outputs.
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import save_tiny_model, save_tiny_tokenizer

EOS = 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from deepinfer import LLM

    path = tmp_path_factory.mktemp("tiny-beam")
    model = save_tiny_model(path, "llama", seed=7, vocab=64)
    save_tiny_tokenizer(path, vocab=64)
    llm = LLM(str(path), dtype="float32", max_model_len=64, cpu_kv_cache_bytes=8 << 20, num_threads=1)
    return llm, model


def _reference(model, prompt: list[int], width: int, max_tokens: int, length_penalty: float,
               ignore_eos: bool = False) -> list[tuple[list[int], float]]:
    """Exhaustive beam search (full vocabulary) over transformers' log-softmax, float64 scores."""
    def score(tokens, cum):
        n = len(tokens) - (1 if tokens[-1] == EOS else 0)
        return cum / n ** length_penalty

    live, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        cands = []
        for tokens, cum in live:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1].double()
            lp = torch.log_softmax(logits, -1)
            for t in range(lp.shape[0]):
                child = (tokens + [t], cum + float(lp[t]))
                (done if t == EOS and not ignore_eos else cands).append(child)
        live = sorted(cands, key=lambda c: score(*c), reverse=True)[:width]
    return sorted(done + live, key=lambda c: score(*c), reverse=True)[:width]


@pytest.mark.parametrize("width,length_penalty", [(2, 1.0), (3, 0.5), (4, 1.0)])
def test_beam_search_matches_an_exhaustive_reference(tiny, width, length_penalty):
    from deepinfer.runtime.beam_search import BeamSearchParams

    llm, model = tiny
    prompts = [[1, 17, 33, 5], [1, 40]]
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=width, max_tokens=6, length_penalty=length_penalty))
    assert len(outs) == 2
    for prompt, out in zip(prompts, outs, strict=True):
        ref = _reference(model, prompt, width, 6, length_penalty)
        assert [s.tokens for s in out.sequences] == [r[0] for r in ref]
        for s, (_, cum) in zip(out.sequences, ref, strict=True):
            assert math.isclose(s.cum_logprob, cum, rel_tol=1e-4, abs_tol=1e-4)
            assert s.tokens[:len(prompt)] == prompt and s.output_token_ids == s.tokens[len(prompt):]
            assert len(s.logprobs) == len(s.output_token_ids)
            assert s.finish_reason == ("stop" if s.tokens[-1] == EOS else "length")
            assert s.text == llm.text_tokenizer.decode(s.tokens)


def test_beam_width_one_is_the_greedy_completion(tiny):
    from deepinfer import SamplingParams
    from deepinfer.runtime.beam_search import BeamSearchParams

    llm, _ = tiny
    prompt = {"prompt_token_ids": [1, 9, 21, 30, 44]}
    (beam,) = llm.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=8, ignore_eos=True))
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert beam.sequences[0].output_token_ids == list(greedy.outputs[0].token_ids)


def test_concurrency_limit_gives_the_same_outputs(tiny):
    from deepinfer.runtime.beam_search import BeamSearchParams

    llm, _ = tiny
    prompts = [{"prompt_token_ids": [1, 3 + i, 50 - i]} for i in range(5)]
    params = BeamSearchParams(beam_width=3, max_tokens=5)
    whole = llm.beam_search(prompts, params)
    limited = llm.beam_search(prompts, params, concurrency_limit=2)
    assert [[s.tokens for s in o.sequences] for o in whole] == [[s.tokens for s in o.sequences] for o in limited]


def test_beams_stop_at_the_context_limit(tiny):
    from deepinfer.runtime.beam_search import BeamSearchParams

    llm, _ = tiny
    prompt = list(range(3, 3 + 60))  # 60 of max_model_len=64 tokens: room for 4 new ones
    (out,) = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True))
    assert all(len(s.tokens) == 64 and s.finish_reason == "length" for s in out.sequences)


def test_bad_beam_search_arguments_name_the_field(tiny):
    from deepinfer.runtime.beam_search import BeamSearchParams

    llm, _ = tiny
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=-1.0)
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search(["t5"], {"beam_width": 2})
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search(["t5"], BeamSearchParams(beam_width=2, max_tokens=2), concurrency_limit=0)
