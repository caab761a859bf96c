"""Shared helpers of the engine tests (scheduler, blocks, outputs)."""

from __future__ import annotations

import numpy as np
import pytest
from deepinfer_engine import _engine as E


def make_scheduler(**overrides) -> E.Scheduler:
    cfg = dict(
        num_blocks=64,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        max_model_len=64,
        vocab_size=100,
        eos_token_id=1,
        watermark=0.0,
    )
    cfg.update(overrides)
    return E.Scheduler(**cfg)


# Scheduler.add_request's own keywords; every other one is a SamplingParams field.
REQUEST_KEYWORDS = frozenset({"arrival_time", "output_kind", "priority", "eos_token_id", "cache_salt"})


def add_request(sched, request_id, prompt, **kw):
    """Scheduler.add_request from one flat dict of keywords (tables of test cases): the sampling
    fields become the SamplingParams, arrival_time / output_kind / priority / eos_token_id /
    cache_salt stay keywords."""
    params = E.SamplingParams(**{k: v for k, v in kw.items() if k not in REQUEST_KEYWORDS})
    return sched.add_request(request_id, prompt, params, **{k: v for k, v in kw.items() if k in REQUEST_KEYWORDS})


def run_step(sched: E.Scheduler, tokens=None):
    """schedule() + update() with the given tokens (default: token 7 for every sample row)."""
    out = sched.schedule()
    info = dict(
        seq_ids=out.seq_ids.tolist(),
        num_tokens=out.num_scheduled_tokens.tolist(),
        computed=out.num_computed_tokens.tolist(),
        samples=out.num_samples.tolist(),
        is_prefill=out.is_prefill.tolist(),
        preempted=out.preempted_seq_ids.tolist(),
        ignored=out.ignored_seq_ids.tolist(),
        blocks_to_copy=out.blocks_to_copy.tolist(),
        states_to_clone=out.states_to_clone.tolist(),
        states_to_zero=out.states_to_zero.tolist(),
        rows=out.num_sample_rows,
    )
    if tokens is None:
        tokens = [7] * out.num_sample_rows
    sched.update(np.asarray(tokens, dtype=np.int32))
    assert sched.check_invariants() == ""
    return info


@pytest.fixture
def sched_factory():
    return make_scheduler
