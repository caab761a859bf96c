"""No wrong KV is ever served: a shadow KV cache records, for every (block, offset) slot, the exact
token prefix whose KV it holds. Before each step every scheduled sequence's computed positions must
hold its own prefix (prefix-cache hits, forks, copy-on-write, preemption); then the step "writes" its
new positions. With hash_bits=2 every block hash collides with others: the verification against
stored tokens must turn those into misses."""

from __future__ import annotations

import random

import numpy as np
import pytest
from conftest import make_scheduler
from deepinfer_engine import _engine as E


def shadow_run(seed: int, hash_bits: int, steps: int = 150, num_blocks: int = 40):
    rng = random.Random(seed)
    bs = 4
    s = make_scheduler(
        num_blocks=num_blocks,
        block_size=bs,
        max_model_len=32,
        max_num_batched_tokens=24,
        max_num_seqs=6,
        hash_bits=hash_bits,
        vocab_size=12,
        eos_token_id=None,
    )
    # Few distinct tokens and shared prefixes: many equal blocks under different prefixes.
    prefixes = [[rng.randrange(3) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    kv: dict[tuple[int, int], tuple] = {}
    next_id = 0
    served = 0
    for _ in range(steps):
        for _ in range(rng.choice([0, 1, 1, 2])):
            prompt = list(rng.choice(prefixes))[: rng.randrange(1, 20)] + [
                rng.randrange(3) for _ in range(rng.randrange(0, 6))
            ]
            s.add_request(
                f"r{next_id}",
                prompt or [0],
                E.SamplingParams(max_tokens=rng.randrange(1, 10), n=rng.choice([1, 1, 2])),
            )
            next_id += 1
        out = s.schedule()
        for src, dst in out.blocks_to_copy.tolist():
            for o in range(bs):
                if (src, o) in kv:
                    kv[(dst, o)] = kv[(src, o)]
                else:
                    kv.pop((dst, o), None)
        for sid, n, computed in zip(
            out.seq_ids.tolist(),
            out.num_scheduled_tokens.tolist(),
            out.num_computed_tokens.tolist(),
        ):
            q = s.get_sequence(sid)
            table, tokens = q.block_table.tolist(), q.token_ids.tolist()
            for p in range(computed):
                assert kv.get((table[p // bs], p % bs)) == tuple(tokens[: p + 1]), (
                    f"sequence {sid} position {p}: block {table[p // bs]} holds another prefix's KV"
                )
                served += 1
            for p in range(computed, computed + n):
                kv[(table[p // bs], p % bs)] = tuple(tokens[: p + 1])
        s.update(np.asarray([rng.randrange(3) for _ in range(out.num_sample_rows)], dtype=np.int32))
        assert s.check_invariants() == ""
    return s, served


@pytest.mark.parametrize("seed", range(8))
def test_forced_hash_collisions_never_serve_a_wrong_block(seed):
    s, served = shadow_run(seed, hash_bits=2)
    # Collisions were certain (4 possible hashes), the cache still served verified hits.
    assert s.block_manager.num_cached_blocks <= 4
    assert s.get_stats()["prefix_cache_hits"] > 0
    assert served > 0


@pytest.mark.parametrize("seed", range(8))
def test_full_hashes_serve_right_blocks_under_pressure(seed):
    s, served = shadow_run(seed, hash_bits=64, num_blocks=12)
    st = s.get_stats()
    assert st["prefix_cache_hits"] > 0 and st["num_preemptions_total"] > 0
    assert served > 0


def test_collision_hook_changes_only_hits_not_schedules_of_unshared_prompts():
    # Prompts with no common prefix: a 1-bit hash collides constantly, yet nothing is ever hit.
    s = make_scheduler(hash_bits=1)
    for k in range(6):
        s.add_request(f"r{k}", [10 + k] * 9, E.SamplingParams(max_tokens=1))
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update(np.full(out.num_sample_rows, 7, np.int32))
    st = s.get_stats()
    assert st["prefix_cache_hits"] == 0 and st["prefix_cache_queries"] == 6 * 9
    assert s.block_manager.num_cached_blocks <= 2
