"""The sampling-parameter bounds are one rule: the engine's (C++ validate_sampling_params, used by
Scheduler.add_request; SequenceMetadataPool.add_sequence checks logit_bias / logprobs the same way)
and the runtime's SamplingParams accept and refuse exactly the same values at every boundary."""

from __future__ import annotations

import math

import pytest
from deepinfer.runtime.sampling_params import SamplingParams
from deepinfer_engine import _engine as E

EPS = 1e-3
CASES = {
    "temperature": [0.0, -EPS, 1.5, math.inf, math.nan],
    "top_p": [0.0, EPS, 1.0, 1.0 + EPS, math.nan],
    "min_p": [0.0, -EPS, 1.0, 1.0 + EPS, math.nan],
    "presence_penalty": [-2.0, -2.0 - EPS, 2.0, 2.0 + EPS, math.nan],
    "frequency_penalty": [-2.0, -2.0 - EPS, 2.0, 2.0 + EPS, math.inf],
    "repetition_penalty": [0.0, EPS, 1.0, 100.0, math.inf, math.nan],
    "max_tokens": [0, 1, 5],
    "min_tokens": [-1, 0, 5, 6],      # max_tokens = 5
    "logprobs": [0, 1, 20, 21],
    "prompt_logprobs": [0, 20, 21],
    "logit_bias": [{3: 100.0}, {3: -100.0}, {3: 100.0 + EPS}, {3: -100.0 - EPS}, {3: math.inf}, {3: math.nan},
                   {3: 0.5}],
    "top_k": [-1, 1, 50],             # 0: SamplingParams's alias of -1 (vLLM), mapped before the engine
    "n": [0, 1, 3],
}


def _python_accepts(field, value):
    kw = {field: value}
    if field == "min_tokens":
        kw["max_tokens"] = 5
    try:
        SamplingParams(**kw)
        return True
    except (ValueError, TypeError):
        return False


def _engine_accepts(field, value):
    s = E.Scheduler(64, block_size=4, max_num_seqs=8, max_model_len=64, max_num_batched_tokens=64, vocab_size=100)
    kw = {field: value}
    if field == "min_tokens":
        kw["max_tokens"] = 5
    try:
        s.add_request("r", [1, 2, 3], **kw)
        return True
    except ValueError:
        return False


def _pool_accepts(field, value):
    try:
        E.SequenceMetadataPool().add_sequence(seq_id=0, request_id="r", token_ids=[1, 2], num_prompt_tokens=2,
                                              num_computed_tokens=0, num_new_tokens=2, block_table=[0],
                                              **{field: value})
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("field", sorted(CASES))
def test_python_and_engine_bounds_agree(field):
    for value in CASES[field]:
        assert _python_accepts(field, value) == _engine_accepts(field, value), (field, value)


@pytest.mark.parametrize("field", ["logit_bias", "logprobs", "prompt_logprobs"])
def test_standalone_pool_rows_follow_the_same_bounds(field):
    for value in CASES[field]:
        assert _pool_accepts(field, value) == _engine_accepts(field, value), (field, value)


def test_the_boundaries_are_where_the_docs_say():
    assert _engine_accepts("logit_bias", {3: 100.0}) and not _engine_accepts("logit_bias", {3: 100.5})
    assert _engine_accepts("logprobs", 20) and not _engine_accepts("logprobs", 21)
