"""Greedy parity with transformers through the real serving loop (C++ engine + model + sampler).

Prompts of different lengths run in one batch: whole prompts, prompts split by chunked prefill,
with prefix caching on (shared system prompt, second pass served from the cache) and off, and
with a KV cache so small that the scheduler must preempt.
"""

from __future__ import annotations

import pytest
from deepinfer.runtime.sampling_params import SamplingParams
from engine_helpers import make_loop, run_all

N_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
SYSTEM = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face. "
          "Answer briefly and precisely.<|im_end|>\n")
QUESTIONS = ["What is 2+2?", "Name a color.", "Why is the sky blue? Explain it to a child in simple words.", "Hi"]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    shared = [tokenizer(SYSTEM + f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n").input_ids
              for q in QUESTIONS]
    plain = [tokenizer(t).input_ids for t in ["The quick brown fox", "1, 2, 3, 4,", "def fib(n):"]]
    return shared + plain + [[42]]


def _check(outs, prompts, hf_greedy):
    for p, o in zip(prompts, outs, strict=True):
        assert list(o.outputs[0].token_ids) == hf_greedy(p, N_NEW), f"prompt of {len(p)} tokens"


def test_one_batch_no_prefix_cache(loaded_default, tokenizer, hf_greedy, prompts):
    loop = make_loop(loaded_default, tokenizer, prefix_caching=False)
    outs, _ = run_all(loop, prompts, GREEDY)
    _check(outs, prompts, hf_greedy)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_chunked_prefill_splits_prompts(loaded_default, tokenizer, hf_greedy, prompts):
    loop = make_loop(loaded_default, tokenizer, prefix_caching=False, max_num_batched_tokens=16, block_size=8)
    assert max(len(p) for p in prompts) > 16
    outs, steps = run_all(loop, prompts, GREEDY)
    _check(outs, prompts, hf_greedy)
    assert steps > N_NEW + sum(len(p) for p in prompts) // 16 - 1


def test_prefix_cache_shared_system_prompt(loaded_default, tokenizer, hf_greedy, prompts):
    loop = make_loop(loaded_default, tokenizer, prefix_caching=True, block_size=4)
    first, _ = run_all(loop, prompts, GREEDY)
    second, _ = run_all(loop, prompts, GREEDY)
    _check(first, prompts, hf_greedy)
    _check(second, prompts, hf_greedy)
    cached = [o.metrics["num_cached_tokens"] for o in second[:len(QUESTIONS)]]
    assert min(cached) >= 16, cached  # the shared system prompt came from the cache
    assert loop.scheduler.get_stats()["prefix_cache_hits"] > 0


def test_tiny_kv_cache_forces_preemption(loaded_default, tokenizer, hf_greedy, prompts):
    # 4-token blocks; the longest sequence needs ~17 blocks, all of them together far more than 24.
    loop = make_loop(loaded_default, tokenizer, prefix_caching=False, num_blocks=24, block_size=4,
                     max_model_len=96)
    outs, _ = run_all(loop, prompts, GREEDY)
    _check(outs, prompts, hf_greedy)
    assert loop.scheduler.get_stats()["num_preemptions_total"] > 0
