"""No wrong KV is ever served: a shadow KV cache records, for every (block, offset) slot, the exact
token prefix whose KV it holds. Before each step every scheduled sequence's computed positions must
hold its own prefix (prefix-cache hits, forks, copy-on-write, preemption); then the step "writes" its
new positions. With hash_bits=2 every block hash collides with others: the verification against
stored tokens must turn those into misses. With cache salts, a slot's KV is also recorded with the
salt of the request that wrote it, and a request may only read its own salt's KV."""

from __future__ import annotations

import random

import numpy as np
import pytest
from conftest import make_scheduler
from deepinfer_engine import _engine as E


def shadow_run(seed: int, hash_bits: int, steps: int = 150, num_blocks: int = 40, salts=(None,)):
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
    salt_of: dict[str, str | None] = {}  # request id -> its cache salt
    next_id = 0
    served = 0
    for _ in range(steps):
        for _ in range(rng.choice([0, 1, 1, 2])):
            prompt = list(rng.choice(prefixes))[: rng.randrange(1, 20)] + [
                rng.randrange(3) for _ in range(rng.randrange(0, 6))
            ]
            salt = rng.choice(salts)
            salt_of[f"r{next_id}"] = salt
            s.add_request(
                f"r{next_id}",
                prompt or [0],
                E.SamplingParams(max_tokens=rng.randrange(1, 10), n=rng.choice([1, 1, 2])),
                cache_salt=salt,
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
            salt = salt_of[q.request_id]
            for p in range(computed):
                assert kv.get((table[p // bs], p % bs)) == (salt, tuple(tokens[: p + 1])), (
                    f"sequence {sid} (salt {salt!r}) position {p}: block {table[p // bs]} holds another "
                    "prefix's or another salt's KV"
                )
                served += 1
            for p in range(computed, computed + n):
                kv[(table[p // bs], p % bs)] = (salt, tuple(tokens[: p + 1]))
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


@pytest.mark.parametrize("hash_bits", [2, 64])
@pytest.mark.parametrize("seed", range(6))
def test_salted_requests_read_only_their_salts_kv(seed, hash_bits):
    # Three tenants (no salt, "a", "b") send prompts from the same few prefixes; under forced
    # collisions too, a sequence's computed positions only ever hold KV its own salt wrote.
    s, served = shadow_run(seed, hash_bits=hash_bits, salts=(None, "tenant-a", "tenant-b"))
    assert s.get_stats()["prefix_cache_hits"] > 0  # (hits within each salt still happen)
    assert served > 0


def _admit(s, rid, prompt, **kw):
    """Add one request and schedule it alone; its prompt tokens served from the cache."""
    s.add_request(rid, prompt, E.SamplingParams(max_tokens=1), **kw)
    out = s.schedule()
    computed = dict(zip(out.seq_ids.tolist(), out.num_computed_tokens.tolist()))
    (sid,) = [i for i in computed if s.get_sequence(i).request_id == rid]
    s.update(np.full(out.num_sample_rows, 7, np.int32))
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update(np.full(out.num_sample_rows, 7, np.int32))
    return computed[sid]


def test_cache_salt_hits():
    # Hand-worked: a 13-token prompt has 3 full blocks of 4; a hit serves all 3 (12 tokens).
    s = make_scheduler()
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    assert _admit(s, "plain-1", prompt) == 0
    assert _admit(s, "a-1", prompt, cache_salt="a") == 0  # another salt: no reuse of the unsalted KV
    assert _admit(s, "a-2", prompt, cache_salt="a") == 12  # the same salt: reused
    assert _admit(s, "b-1", prompt, cache_salt="b") == 0
    assert _admit(s, "plain-2", prompt) == 12  # the unsalted cache is intact
    assert _admit(s, "none", prompt, cache_salt=None) == 12  # None is no salt
    assert _admit(s, "b-2", prompt[:9] + [50, 51], cache_salt="b") == 8  # a shared prefix within a salt
    assert s.check_invariants() == ""


def test_cache_salt_refuses_colliding_hashes():
    # A 1-bit hash: about half of these salts give block 0 the unsalted block's hash; the stored
    # tokens and chain then match, and only the stored salt keeps the unsalted KV from them.
    s = make_scheduler(hash_bits=1)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert _admit(s, "plain-1", prompt) == 0
    for k in range(12):
        assert _admit(s, f"salted-{k}", prompt, cache_salt=f"salt-{k}") == 0, f"salt-{k} read unsalted KV"
    assert _admit(s, "plain-2", prompt) == 8
    assert s.check_invariants() == ""


def test_cache_salt_is_checked():
    s = make_scheduler()
    with pytest.raises(ValueError, match="cache_salt: must be a non-empty string"):
        s.add_request("x", [5, 6], cache_salt="")
    with pytest.raises(TypeError, match="cache_salt: expected str, got bytes"):
        s.add_request("x", [5, 6], cache_salt=b"a")
    with pytest.raises(ValueError, match="cache_salt: is not valid Unicode text"):
        s.add_request("x", [5, 6], cache_salt="\ud800")
    assert not s.has_unfinished_requests()  # nothing was queued
    s.add_request("x", [5, 6], cache_salt="ok")
