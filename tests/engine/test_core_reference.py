"""The C++ Scheduler against the pure-Python reference, step by step, on randomized workloads
(arrivals, prompt lengths, prefix sharing, priorities, aborts at any time, n > 1, memory pressure),
with the invariants checked after every schedule() and update()."""

from __future__ import annotations

import random

import numpy as np
import pytest
from conftest import add_request
from deepinfer_engine import _engine as E
from reference import RefScheduler
from reference.scheduler import RUNNING, STOPPED

VOCAB = 40
EOS = 1


def _configs():
    base = dict(
        num_blocks=48,
        block_size=4,
        max_num_seqs=6,
        max_num_batched_tokens=24,
        max_model_len=48,
        enable_chunked_prefill=True,
        long_prefill_token_threshold=0,
        policy="fcfs",
        enable_prefix_caching=True,
        watermark=0.05,
        num_lookahead_slots=0,
    )
    yield "fcfs", base
    yield "priority", {**base, "policy": "priority"}
    yield (
        "pressure",
        {**base, "num_blocks": 16, "max_model_len": 40, "watermark": 0.0, "max_num_seqs": 8},
    )
    yield "threshold", {**base, "long_prefill_token_threshold": 5, "block_size": 3}
    yield "no_chunking", {**base, "enable_chunked_prefill": False, "max_num_batched_tokens": 48}
    yield (
        "no_prefix_cache",
        {**base, "enable_prefix_caching": False, "num_blocks": 20, "watermark": 0.0},
    )
    yield "lookahead", {**base, "num_lookahead_slots": 3, "num_blocks": 24, "policy": "priority"}


CONFIGS = dict(_configs())


def _compare_step(c_out, r_out):
    c_sched = list(
        zip(
            c_out.seq_ids.tolist(),
            c_out.num_scheduled_tokens.tolist(),
            c_out.num_computed_tokens.tolist(),
            c_out.num_samples.tolist(),
            c_out.is_prefill.tolist(),
        )
    )
    assert c_sched == r_out["scheduled"]
    assert c_out.preempted_seq_ids.tolist() == r_out["preempted"]
    assert c_out.ignored_seq_ids.tolist() == r_out["ignored"]
    assert c_out.num_sample_rows == sum(s[3] for s in r_out["scheduled"])
    assert c_out.num_decodes == sum(1 for s in r_out["scheduled"] if not s[4])


def _finished_pairs(sched):
    info = E.get_finished_seqs_info(sched)
    return sorted(zip(info["seq_ids"].tolist(), info["statuses"].tolist()))


def run_workload(seed: int, cfg: dict, steps: int = 120):
    rng = random.Random(seed)
    c = E.Scheduler(**cfg, vocab_size=VOCAB, eos_token_id=EOS)
    r = RefScheduler(**cfg, eos_token_id=EOS)
    prefixes = [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(4, 30))] for _ in range(3)]
    unfinished: set[str] = set()
    next_id = 0
    totals = dict(preempted=0, ignored=0, hits=0, forks=0, aborted=0)

    def abort_one():
        live = sorted(
            rid for rid in unfinished if any(s.status < STOPPED for s in r.groups[rid].seqs)
        )
        if live:
            rid = rng.choice(live)
            assert c.abort_request(rid) >= 1
            r.abort(rid)
            unfinished.discard(rid)
            totals["aborted"] += 1

    for _ in range(steps):
        for _ in range(rng.choice([0, 0, 0, 1, 1, 2])):
            if rng.random() < 0.6:
                prompt = list(rng.choice(prefixes))[: rng.randrange(1, 31)]
            else:
                prompt = []
            prompt += [
                rng.randrange(2, VOCAB) for _ in range(rng.randrange(0 if prompt else 1, 20))
            ]
            if rng.random() < 0.04:
                prompt += [5] * (cfg["max_model_len"] + 1 - len(prompt))  # too long: ignored
            max_tokens = rng.randrange(1, 14)
            params = dict(
                max_tokens=max_tokens,
                min_tokens=rng.choice([0, 0, min(2, max_tokens)]),
                n=rng.choice([1, 1, 1, 2, 3]),
                priority=rng.randrange(3),
                ignore_eos=rng.random() < 0.2,
                stop_token_ids=rng.choice([None, None, [2, 3]]),
            )
            rid = f"r{next_id}"
            next_id += 1
            sid = add_request(c, rid, prompt, **params)
            assert sid == r.add_request(rid, prompt, **params)
            unfinished.add(rid)
        if rng.random() < 0.08:
            abort_one()  # between update and schedule (reported with the next step)

        c_out = c.schedule()
        r_out = r.schedule()
        _compare_step(c_out, r_out)
        assert c.check_invariants() == ""
        totals["preempted"] += len(r_out["preempted"])
        totals["ignored"] += len(r_out["ignored"])
        totals["forks"] += sum(1 for s in r_out["scheduled"] if s[3] > 1)
        if rng.random() < 0.05:
            abort_one()  # while the step runs: its rows must be ignored
        rows = c_out.num_sample_rows
        tokens = [EOS if rng.random() < 0.08 else rng.randrange(2, VOCAB) for _ in range(rows)]
        c.update(np.asarray(tokens, dtype=np.int32))
        r.update(tokens)
        assert c.check_invariants() == ""
        assert _finished_pairs(c) == sorted(r.finished)
        assert c.block_manager.num_free_blocks == r.bm.num_free()
        assert c.block_manager.num_cached_blocks == len(r.bm.cache)
        for g in list(r.groups.values()):
            if g.request_id in unfinished and all(s.status >= STOPPED for s in g.seqs):
                unfinished.discard(g.request_id)
        # Every running sequence agrees on tokens and computed count.
        for s in r.running:
            cs = c.get_sequence(s.seq_id)
            assert cs.status == E.SequenceStatus.RUNNING and s.status == RUNNING
            assert cs.num_computed_tokens == s.num_computed
            assert cs.token_ids.tolist() == s.tokens
        stats = c.get_stats()
        assert stats["num_running"] == len(r.running)
        assert stats["num_waiting"] + stats["num_preempted"] == len(r.waiting) + len(r.preempted)
    totals["hits"] = c.block_manager.prefix_cache_hit_rate
    assert c.get_stats()["prefix_cache_hits"] == r.bm.hits
    assert c.get_stats()["prefix_cache_queries"] == r.bm.queries
    return totals


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", range(6))
def test_matches_reference(name, seed):
    run_workload(seed * 1000 + len(name), CONFIGS[name])


def test_workloads_exercise_every_path():
    """The randomized workloads do reach preemption, ignoring, prefix hits, forks and aborts."""
    seen = dict(preempted=0, ignored=0, hits=0.0, forks=0, aborted=0)
    for name, cfg in CONFIGS.items():
        for seed in range(3):
            t = run_workload(seed * 1000 + len(name), cfg)
            for k in seen:
                seen[k] += t[k]
    assert all(v > 0 for v in seen.values()), seen
