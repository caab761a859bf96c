"""Test helper: an EngineLoop over the session's default model with chosen scheduler settings."""

from __future__ import annotations

import pytest
import torch
from deepinfer.runtime.sampling_params import SamplingParams


def make_loop(loaded, tokenizer, *, num_blocks=256, block_size=16, max_num_seqs=32, max_num_batched_tokens=512,
              max_model_len=512, prefix_caching=True, chunked_prefill=True, seed=0):
    pytest.importorskip("deepinfer_engine", reason="the C++ engine (deepinfer-engine) is not built/installed")
    from deepinfer.runtime.engine.loop import EngineConfig, EngineLoop
    from deepinfer.runtime.worker.model_runner import ModelRunner

    runner = ModelRunner(loaded, num_blocks=num_blocks, block_size=block_size, device=torch.device("cpu"),
                         dtype=torch.float32)
    cfg = EngineConfig(block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                       vocab_size=loaded.config.vocab_size, eos_token_id=loaded.config.eos_token_ids[0],
                       enable_chunked_prefill=chunked_prefill, enable_prefix_caching=prefix_caching, seed=seed)
    return EngineLoop(runner, tokenizer, cfg)


def run_all(loop, prompts, params):
    """Add every prompt, step until all finish; outputs in prompt order, plus the step count."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    ids = []
    for p, sp in zip(prompts, params, strict=True):
        rid = loop.new_request_id()
        loop.add_request(rid, p, sp)
        ids.append(rid)
    done = {}
    steps = 0
    while len(done) < len(ids):
        for ro in loop.step():
            if ro.finished:
                done[ro.request_id] = ro
        steps += 1
        assert steps < 10_000
    return [done[r] for r in ids], steps
