"""Incremental penalty counts (SamplerInputs(penalty_counts="incremental")): slots, per-step
updates, reuse, resets. A pure-Python consumer (penalty_consumer.PenaltyTables) applies the
updates; its tables must give, every step, the counts of "full" mode and the counts computed
straight from each sequence's tokens."""

from __future__ import annotations

import random

import numpy as np
import pytest
from deepinfer_engine import _engine as E
from inputs_helpers import make_args, make_buffers, pool_of
from inputs_reference.layout import RefRow
from penalty_consumer import PenaltyTables, direct_counts, full_counts

PEN = dict(presence_penalty=0.5, repetition_penalty=1.2)


def decode_row(seq_id, tokens, num_prompt, **sampling):
    return RefRow(seq_id, f"r{seq_id}", list(tokens), num_prompt, len(tokens) - 1, 1, [0, 1, 2, 3],
                  sampling=sampling)


def step(args, si, rows):
    pool = pool_of(rows)
    E.prepare_decode_v4(args, pool)
    E.prepare_sampler_inputs(args, pool, si)
    T = si.transform
    upd = [(int(T.penalty_update_slots[u]), int(T.penalty_update_reset[u]),
            T.penalty_update_token_ids[T.penalty_update_offsets[u]: T.penalty_update_offsets[u + 1]].tolist(),
            T.penalty_update_is_output[T.penalty_update_offsets[u]: T.penalty_update_offsets[u + 1]].tolist())
           for u in range(T.num_penalty_updates)]
    return T.penalty_slots.tolist(), upd, T.num_penalty_slots


def test_mode_is_validated_and_exposed():
    assert E.SamplerInputs().penalty_counts == "incremental"
    assert E.SamplerInputs(3, penalty_counts="full").penalty_counts == "full"
    for bad in ("Full", "", "sparse"):
        with pytest.raises(ValueError, match=r"penalty_counts.*'incremental', 'full'"):
            E.SamplerInputs(penalty_counts=bad)
    with pytest.raises(TypeError):
        E.SamplerInputs(0, "full")  # keyword-only


def test_hand_computed_updates():
    args = make_args(make_buffers(max_tokens=64, max_seqs=8, width=8), graph_batch_sizes=[4])
    si = E.SamplerInputs()
    a = [5, 6, 5, 9]  # prompt 5 6 5, output 9
    # First appearance: reset, whole sequence; the penalty-free row and the padding get -1.
    slots, upd, n = step(args, si, [decode_row(7, a, 3, **PEN), decode_row(8, [1, 2, 3], 2)])
    assert slots == [0, -1, -1, -1] and n == 1
    assert upd == [(0, 1, [5, 6, 5, 9], [0, 0, 0, 1])]
    # Next step: only the appended token.
    slots, upd, n = step(args, si, [decode_row(7, a + [9], 3, **PEN), decode_row(8, [1, 2, 3, 4], 2)])
    assert slots[:2] == [0, -1] and upd == [(0, 0, [9], [1])] and n == 1
    # The same step prepared again: nothing new.
    slots, upd, _ = step(args, si, [decode_row(7, a + [9], 3, **PEN)])
    assert slots[0] == 0 and upd == []
    # Rolled back (shorter than what was sent): reset, whole sequence again, same slot.
    slots, upd, _ = step(args, si, [decode_row(7, a, 3, **PEN)])
    assert slots[0] == 0 and upd == [(0, 1, [5, 6, 5, 9], [0, 0, 0, 1])]
    # Same length but another prompt length (recompute): reset.
    slots, upd, _ = step(args, si, [decode_row(7, a, 2, **PEN)])
    assert upd == [(0, 1, [5, 6, 5, 9], [0, 0, 1, 1])]
    # 7 absent: its slot is freed at the end of this call, so 11 gets a new one...
    slots, upd, n = step(args, si, [decode_row(11, [4, 4, 2], 2, frequency_penalty=0.1)])
    assert slots[0] == 1 and n == 2 and upd == [(1, 1, [4, 4, 2], [0, 0, 1])]
    # ...and 12, next step, reuses slot 0 (reset); 11 sends its new token.
    slots, upd, n = step(args, si, [decode_row(11, [4, 4, 2, 4], 2, frequency_penalty=0.1),
                                    decode_row(12, [3, 1], 1, **PEN)])
    assert slots[:2] == [1, 0] and n == 2
    assert upd == [(1, 0, [4], [1]), (0, 1, [3, 1], [0, 1])]
    # 7 comes back: a new slot (its old one went to 12), sent whole.
    slots, upd, n = step(args, si, [decode_row(12, [3, 1], 1, **PEN), decode_row(7, a, 3, **PEN)])
    assert slots[:2] == [0, 2] and n == 3 and upd == [(2, 1, [5, 6, 5, 9], [0, 0, 0, 1])]
    # reset_penalty_tables: everything is sent again, from slot 0.
    si.reset_penalty_tables()
    slots, upd, n = step(args, si, [decode_row(12, [3, 1], 1, **PEN), decode_row(7, a, 3, **PEN)])
    assert slots[:2] == [0, 1] and n == 2
    assert upd == [(0, 1, [3, 1], [0, 1]), (1, 1, [5, 6, 5, 9], [0, 0, 0, 1])]


def test_full_mode_sends_no_updates_and_reset_is_harmless():
    args = make_args(make_buffers(max_tokens=64, max_seqs=8, width=8))
    si = E.SamplerInputs(penalty_counts="full")
    slots, upd, n = step(args, si, [decode_row(7, [5, 6, 5, 9], 3, **PEN)])
    assert slots == [-1] and upd == [] and n == 0
    assert full_counts(si.transform, 0) == {5: (0, 1), 6: (0, 1), 9: (1, 0)}
    si.reset_penalty_tables()
    step(args, si, [decode_row(7, [5, 6, 5, 9, 5], 3, **PEN)])
    assert full_counts(si.transform, 0) == {5: (1, 1), 6: (0, 1), 9: (1, 0)}


def test_rejected_call_changes_no_slot():
    args = make_args(make_buffers(max_tokens=64, max_seqs=8, width=8))
    si = E.SamplerInputs()
    step(args, si, [decode_row(7, [5, 6, 9], 2, **PEN)])
    rows = [decode_row(7, [5, 6, 9, 4], 2, **PEN), decode_row(8, [1, 1], 1, **PEN)]
    pool = pool_of(rows)
    E.prepare_decode_v4(args, pool)
    rows[0].add_to(pool)  # pool changed after prepare: rejected
    assert si.num_calls == 1
    with pytest.raises(ValueError, match="metadata"):
        E.prepare_sampler_inputs(args, pool, si)
    assert si.num_calls == 1  # not counted
    slots, upd, n = step(args, si, rows)  # the same step, now accepted: nothing was lost or sent twice
    assert si.num_calls == 2
    assert slots == [0, 1] and n == 2
    assert upd == [(0, 0, [4], [1]), (1, 1, [1, 1], [0, 1])]


def test_n_gt_1_rows_share_the_slot_then_children_get_their_own():
    sched = E.Scheduler(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=64,
                        max_model_len=128, vocab_size=100)
    sched.add_request("n3", [3, 4, 3], E.SamplingParams(n=3, max_tokens=4, temperature=1.0, frequency_penalty=0.5))
    args = make_args(make_buffers(max_tokens=64, max_seqs=8, width=8), max_model_len=128)
    pool, si, tables = E.SequenceMetadataPool(), E.SamplerInputs(), PenaltyTables()
    sched.schedule()
    pool.build(sched)
    E.prepare_prompt_v4(args, pool)
    E.prepare_sampler_inputs(args, pool, si)
    T = si.transform
    tables.apply(T)
    assert T.penalty_slots.tolist() == [0, 0, 0] and T.num_penalty_updates == 1
    assert tables.counts(0) == {3: (0, 1), 4: (0, 1)}
    sched.update(np.array([4, 7, 7], np.int32))
    sched.schedule()
    pool.build(sched)
    E.prepare_decode_v4(args, pool)
    E.prepare_sampler_inputs(args, pool, si)
    tables.apply(si.transform)
    slots = si.transform.penalty_slots.tolist()[: si.driver.num_real_rows]
    assert len(set(slots)) == 3
    for r, sid in enumerate(si.driver.seq_ids.tolist()[:3]):
        seq = sched.get_sequence(sid)
        assert tables.row_counts(si.transform, r) == direct_counts(seq.token_ids.tolist(), 3)


def check_step(sched, si_inc, si_full, tables, penalized):
    """Incremental tables == full mode == the sequences' own tokens, row by row."""
    T, F = si_inc.transform, si_full.transform
    tables.apply(T)
    assert T.num_rows == F.num_rows and T.no_penalties == F.no_penalties
    assert T.penalty_pending_source.tolist() == F.penalty_pending_source.tolist()
    slot_of = {}
    for r, sid in enumerate(si_inc.driver.seq_ids.tolist()):
        slot = int(T.penalty_slots[r])
        if sid < 0:
            assert slot == -1
            continue
        seq = sched.get_sequence(sid)
        if not penalized[seq.request_id]:
            assert slot == -1 and full_counts(F, r) == {}
            continue
        assert slot >= 0 and slot_of.setdefault(sid, slot) == slot
        expect = direct_counts(seq.token_ids.tolist(), seq.num_prompt_tokens)
        assert tables.counts(slot) == expect
        assert full_counts(F, r) == expect
    assert len(set(slot_of.values())) == len(slot_of)  # live sequences never share a slot


def run_loop(seed, *, num_blocks, spec_k=0, max_n=1, num_requests=14):
    rng = random.Random(seed)
    vocab = 40  # small: tokens repeat
    sched = E.Scheduler(num_blocks=num_blocks, block_size=8, max_num_seqs=6, max_num_batched_tokens=48,
                        max_model_len=128, vocab_size=vocab, num_lookahead_slots=spec_k)
    penalized = {}
    for i in range(num_requests):
        rid = f"q{i}"
        penalized[rid] = rng.random() < 0.6
        kw = dict(frequency_penalty=0.3, repetition_penalty=1.1) if penalized[rid] else {}
        sched.add_request(rid, [rng.randrange(vocab) for _ in range(rng.randint(3, 60))],
                          E.SamplingParams(n=rng.randint(1, max_n), max_tokens=rng.randint(1, 30), temperature=1.0, **kw))
    args = make_args(make_buffers(max_tokens=128, max_seqs=8, width=48), block_size=8, max_model_len=128,
                     graph_batch_sizes=[2, 4, 8])
    pool = E.SequenceMetadataPool()
    si_inc, si_full, tables = E.SamplerInputs(), E.SamplerInputs(penalty_counts="full"), PenaltyTables()
    stats = dict(preempted=0, aborted=0, reused=0, rejected_drafts=0, steps=0)
    used_slots = set()
    while sched.has_unfinished_requests() and stats["steps"] < 600:
        out = sched.schedule()
        stats["steps"] += 1
        stats["preempted"] += len(out.preempted_seq_ids)
        if out.is_empty:
            continue
        pool.build(sched)
        if out.num_decodes == len(out):
            E.prepare_decode_v4(args, pool)
        else:
            E.prepare_prompt_v4(args, pool)
        E.prepare_sampler_inputs(args, pool, si_full)
        E.prepare_sampler_inputs(args, pool, si_inc)
        T = si_inc.transform
        for u in range(T.num_penalty_updates):
            s = int(T.penalty_update_slots[u])
            stats["reused"] += s in used_slots and T.penalty_update_reset[u] == 1
            used_slots.add(s)
        check_step(sched, si_inc, si_full, tables, penalized)
        assert T.num_penalty_slots <= 2 * 6 * max_n
        if rng.random() < 0.03:  # the consumer lost its tables
            si_inc.reset_penalty_tables()
            tables.reset()
        R = out.num_sample_rows
        if spec_k:
            S = si_inc.speculative
            acc = np.zeros(R, np.int32)
            toks = np.array([[rng.randrange(vocab) for _ in range(spec_k + 1)] for _ in range(R)],
                            np.int32).reshape(R, spec_k + 1)
            drafts = S.draft_token_ids.tolist()
            for q in range(S.num_seqs):
                r, k = int(S.sample_rows[q]), int(S.num_drafts[q])
                acc[r] = rng.randint(0, k)
                stats["rejected_drafts"] += k - acc[r]
                toks[r, : acc[r]] = drafts[S.cu_num_drafts[q]: S.cu_num_drafts[q] + acc[r]]
            nxt = np.array([[rng.randrange(vocab) for _ in range(spec_k)] for _ in range(R)], np.int32).reshape(R, spec_k)
            E.process_MTPInfo(sched, acc, toks, nxt)
        else:
            sched.update(np.array([rng.randrange(vocab) for _ in range(R)], np.int32))
        if rng.random() < 0.08:
            try:  # a finished request is unknown: ValueError
                stats["aborted"] += sched.abort_request(rng.choice(list(penalized))) > 0
            except ValueError:
                pass
    assert not sched.has_unfinished_requests()
    return stats


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_blocks", [400, 18])  # 18: preemption, recompute, rejoin
def test_step_loop_forks_aborts_preemption(seed, num_blocks):
    stats = run_loop(seed, num_blocks=num_blocks, max_n=3)
    assert stats["reused"] > 0 and stats["aborted"] > 0
    if num_blocks == 18:
        assert stats["preempted"] > 0


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_blocks", [400, 18])
def test_step_loop_speculative_rollbacks(seed, num_blocks):
    stats = run_loop(100 + seed, num_blocks=num_blocks, spec_k=2)
    assert stats["rejected_drafts"] > 0 and stats["reused"] > 0
    if num_blocks == 18:
        assert stats["preempted"] > 0
