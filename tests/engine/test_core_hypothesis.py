"""Property test: for scheduler configurations drawn by hypothesis, the C++ scheduler matches the
reference step by step and keeps every block invariant (see test_core_reference.run_workload)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_core_reference import run_workload


@st.composite
def configs(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 5, 16]))
    max_model_len = draw(st.integers(8, 48))
    lookahead = draw(st.sampled_from([0, 0, 2]))
    min_blocks = -(-(max_model_len + lookahead) // block_size)
    chunked = draw(st.booleans())
    return dict(
        num_blocks=min_blocks + draw(st.integers(0, 30)),
        block_size=block_size,
        max_num_seqs=draw(st.integers(3, 8)),
        max_num_batched_tokens=draw(st.integers(max_model_len if not chunked else 4, 64)),
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 7])),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        enable_prefix_caching=draw(st.booleans()),
        watermark=0.0,
        num_lookahead_slots=lookahead,
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), seed=st.integers(0, 2**20))
def test_random_configs_match_reference(cfg, seed):
    run_workload(seed, cfg, steps=60)
