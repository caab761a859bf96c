"""Speculative decoding metrics: ``deepinfer bench --speculative-oracle`` and the /metrics
``spec_decode_*`` counters fed from ``EngineLoop.stats()``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_bench_speculative_oracle_reports_full_acceptance():
    pytest.importorskip("deepinfer_engine", reason="the C++ engine (deepinfer-engine) is not built/installed")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-m", "deepinfer", "bench", "--threads", "1", "--num-prompts", "2",
                          "--input-len", "8", "--output-len", "12", "--quiet", "--device", "cpu",
                          "--speculative-oracle", "--speculative-config",
                          '{"method": "ngram", "num_speculative_tokens": 3}'],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("speculative decoding:"))
    # every draft of a recorded greedy run is kept: 12 tokens = 3 steps of 1 + 3 after the first token
    rate = float(line.split("acceptance rate ")[1].split(",")[0])
    length = float(line.split("mean accepted length ")[1].split(",")[0])
    assert rate > 0.9 and length > 3.5, line
    assert "per-position acceptance [" in line


def test_bench_speculative_oracle_with_a_draft_model_reports_its_cost(default_gguf):
    pytest.importorskip("deepinfer_engine", reason="the C++ engine (deepinfer-engine) is not built/installed")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    cfg = f'{{"method": "draft_model", "model": "{default_gguf}", "num_speculative_tokens": 3}}'
    out = subprocess.run([sys.executable, "-m", "deepinfer", "bench", "--threads", "1", "--num-prompts", "2",
                          "--input-len", "8", "--output-len", "12", "--quiet", "--device", "cpu",
                          "--speculative-oracle", "--speculative-config", cfg],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("speculative decoding:"))
    assert float(line.split("acceptance rate ")[1].split(",")[0]) > 0.9, line
    ms = float(line.split("draft model ")[1].split(" ms per drafting step")[0])
    assert ms > 0, line


def test_metrics_counters_follow_the_engine_totals():
    pytest.importorskip("prometheus_client", reason="prometheus_client (the serve extra) is not installed")
    from deepinfer.serve.metrics import ServerMetrics

    m = ServerMetrics("m", max_model_len=128, num_blocks=8)
    base = {"num_running": 1, "num_waiting": 0, "num_preempted": 0, "kv_usage": 0.1, "num_free_blocks": 7,
            "num_preemptions_total": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0}
    m.observe_engine(dict(base, spec_decode_num_drafts=4, spec_decode_num_draft_tokens=12,
                          spec_decode_num_accepted_tokens=7, spec_decode_num_accepted_tokens_per_pos=[4, 2, 1]))
    m.observe_engine(dict(base, spec_decode_num_drafts=5, spec_decode_num_draft_tokens=15,
                          spec_decode_num_accepted_tokens=9, spec_decode_num_accepted_tokens_per_pos=[5, 3, 1]))
    text = m.exposition().decode()
    assert 'deepinfer:spec_decode_num_drafts_total{model_name="m"} 5.0' in text
    assert 'deepinfer:spec_decode_num_draft_tokens_total{model_name="m"} 15.0' in text
    assert 'deepinfer:spec_decode_num_accepted_tokens_total{model_name="m"} 9.0' in text
    assert 'deepinfer:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 3.0' in text
    m.engine_replaced()  # a fresh engine counts from zero: its totals add on
    m.observe_engine(dict(base, spec_decode_num_drafts=2, spec_decode_num_draft_tokens=6,
                          spec_decode_num_accepted_tokens=1, spec_decode_num_accepted_tokens_per_pos=[1, 0, 0]))
    assert 'deepinfer:spec_decode_num_drafts_total{model_name="m"} 7.0' in m.exposition().decode()


def test_engine_loop_stats_carry_the_spec_totals(loaded_default, tokenizer):
    from deepinfer.runtime.sampling_params import SamplingParams
    from test_speculative_engine import NGRAM, make_loop, run

    loop = make_loop(loaded_default, tokenizer, NGRAM)
    run(loop, [tokenizer.encode("a b c d a b c d a b c d a b")], SamplingParams(temperature=0, max_tokens=16))
    st = loop.stats()
    s = loop.speculator.stats
    assert st["spec_decode_num_draft_tokens"] == s.num_draft_tokens > 0
    assert st["spec_decode_num_accepted_tokens_per_pos"] == s.accepted_per_pos
    assert "num_running" in st
    assert "spec_decode_num_drafts" not in make_loop(loaded_default, tokenizer).stats()
