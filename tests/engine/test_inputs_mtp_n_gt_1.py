"""process_MTPInfo on a step that completes an n > 1 prompt (bug B3): one entry per sample row,
the n rows of that prompt fork it exactly as Scheduler.update does. The expectation is
Scheduler.update itself, applied to the same step on a twin scheduler (where the step has no
draft row), plus hand-computed facts about the fork."""

from __future__ import annotations

import random

import numpy as np
import pytest
from deepinfer_engine import _engine as E

CFG = dict(num_blocks=60, block_size=4, max_num_seqs=6, max_num_batched_tokens=64, max_model_len=31, vocab_size=40,
           eos_token_id=1, num_lookahead_slots=3, watermark=0.0, num_state_slots=6)


def state(s, rids):
    """Everything the fork decides: per sequence (tokens, table, computed, status, state slot, drafts)."""
    seqs = {}
    for rid in rids:
        for q in s.get_sequences(rid):
            seqs[(rid, q.sample_index)] = (q.token_ids.tolist(), q.block_table.tolist(), q.num_computed_tokens,
                                           int(q.status), q.state_slot, q.draft_token_ids.tolist())
    refs = [s.block_manager.ref_count(b) for b in range(s.block_manager.num_blocks)]
    return seqs, refs


def device_work(out):
    return out.blocks_to_copy.tolist(), out.states_to_clone.tolist(), out.states_to_zero.tolist()


def test_drafts_and_an_n_gt_1_prompt_in_one_step_fork_like_update():
    mtp, twin = E.Scheduler(**CFG), E.Scheduler(**CFG)
    for s in (mtp, twin):
        s.add_request("a", [5, 6, 7, 8, 9], E.SamplingParams(max_tokens=10))
        s.schedule()
    # "a" gets two drafts on mtp only (its table needs 3 blocks either way: 5 + 3 + 3 and 5 + 1 + 3 slots).
    E.process_MTPInfo(mtp, np.zeros(1, np.int32), np.array([[11]], np.int32), np.array([[12, 13]], np.int32))
    twin.update(np.array([11], np.int32))
    for s in (mtp, twin):
        s.add_request("b", [20, 21, 22], E.SamplingParams(max_tokens=10, n=2))
    om, ot = mtp.schedule(), twin.schedule()
    assert om.num_samples.tolist() == ot.num_samples.tolist() == [1, 2]
    assert om.num_scheduled_tokens.tolist() == [3, 3] and ot.num_scheduled_tokens.tolist() == [1, 3]
    # Sample rows: a (1 accepted draft: 12, then the bonus 15), b's parent 30, b's child 31.
    appended = E.process_MTPInfo(mtp, np.array([1, 0, 0], np.int32), np.array([[12, 15], [30, 0], [31, 0]], np.int32))
    assert appended.tolist() == [2, 1, 1]
    twin.update(np.array([15, 30, 31], np.int32))
    assert mtp.check_invariants() == "" and twin.check_invariants() == ""
    assert mtp.get_sequence(0).output_token_ids.tolist() == [11, 12, 15]
    sm, st_ = state(mtp, ["b"]), state(twin, ["b"])
    assert sm == st_                                      # same fork, same tables, same ref counts
    seqs, refs = sm
    parent, child = seqs[("b", 0)], seqs[("b", 1)]
    assert parent[0] == [20, 21, 22, 30] and child[0] == [20, 21, 22, 31]
    assert parent[2] == child[2] == 3                     # the prompt is computed for both
    # Device work of the next step: the child's copy of the partial prompt block and its state clone.
    wm, wt = device_work(mtp.schedule()), device_work(twin.schedule())
    assert wm == wt
    assert [parent[1][0], child[1][0]] in wm[0] and parent[1][0] != child[1][0]
    assert [parent[4], child[4]] in wm[1]
    assert refs[parent[1][0]] == 1 and refs[child[1][0]] == 1


def test_each_sample_row_gets_its_own_token_stop_checks_and_next_drafts():
    s = E.Scheduler(**CFG)
    s.add_request("a", [5, 6, 7, 8, 9], E.SamplingParams(max_tokens=10))
    s.schedule()
    E.process_MTPInfo(s, np.zeros(1, np.int32), np.array([[11]], np.int32), np.array([[12, 13]], np.int32))
    s.add_request("b", [20, 21, 22, 23, 24], E.SamplingParams(max_tokens=10, n=3))
    out = s.schedule()
    assert out.num_samples.tolist() == [1, 3]
    # b's sample 1 draws EOS (finishes), samples 0 and 2 go on with their own next drafts.
    toks = np.array([[12, 15], [30, 0], [1, 0], [32, 0]], np.int32)
    nd = np.array([[2, 3], [4, 5], [6, 7], [8, 9]], np.int32)
    appended = E.process_MTPInfo(s, np.array([1, 0, 0, 0], np.int32), toks, nd)
    assert appended.tolist() == [2, 1, 1, 1]
    b = {q.sample_index: q for q in s.get_sequences("b")}
    assert sorted(b) == [0, 1, 2]
    assert [b[i].output_token_ids.tolist() for i in range(3)] == [[30], [1], [32]]
    assert b[1].finish_reason == "stop" and b[1].block_table.tolist() == []
    assert b[0].draft_token_ids.tolist() == [4, 5] and b[2].draft_token_ids.tolist() == [8, 9]
    assert s.get_sequence(0).draft_token_ids.tolist() == [2, 3]
    assert s.check_invariants() == ""
    # The next step verifies the drafts of all three live sequences.
    out = s.schedule()
    assert sorted(out.num_scheduled_tokens.tolist()) == [3, 3, 3]
    assert s.check_invariants() == ""


def test_bad_rows_of_an_n_gt_1_prompt_are_refused_and_change_nothing():
    s = E.Scheduler(**CFG)
    s.add_request("b", [20, 21, 22], E.SamplingParams(max_tokens=10, n=2))
    s.schedule()
    with pytest.raises(ValueError, match=r"num_accepted.*row 1.*\[0, 0\]"):   # a prefill row has no drafts
        E.process_MTPInfo(s, np.array([0, 1], np.int32), np.array([[30, 0], [31, 0]], np.int32))
    with pytest.raises(ValueError, match="output_tokens.*row 1"):
        E.process_MTPInfo(s, np.array([0, 0], np.int32), np.array([[30], [40]], np.int32))
    with pytest.raises(ValueError, match="num_accepted"):                     # one entry per SAMPLE row
        E.process_MTPInfo(s, np.array([0], np.int32), np.array([[30]], np.int32))
    assert len(s.get_sequences("b")) == 1 and s.step_in_flight
    assert E.process_MTPInfo(s, np.array([0, 0], np.int32), np.array([[30], [31]], np.int32)).tolist() == [1, 1]
    assert len(s.get_sequences("b")) == 2


def test_an_n_gt_1_prompt_aborted_while_its_step_runs_is_skipped():
    s = E.Scheduler(**CFG)
    s.add_request("b", [20, 21, 22], E.SamplingParams(max_tokens=10, n=2))
    s.schedule()
    s.abort_request("b")
    assert E.process_MTPInfo(s, np.zeros(2, np.int32), np.array([[30], [31]], np.int32)).tolist() == [0, 0]
    assert len(s.get_sequences("b")) == 1 and s.check_invariants() == ""


@pytest.mark.parametrize("seed", range(6))
def test_process_mtp_without_drafts_equals_update_step_by_step(seed):
    """Random requests (n up to 3, shared prompts), small caches (preemption): process_MTPInfo with
    no drafts applies every step exactly as update does on a twin — the same forks, tables, ref
    counts and device work."""
    rng = random.Random(seed)
    cfg = dict(CFG, num_blocks=[10, 14, 60][seed % 3], num_lookahead_slots=0)
    mtp, twin = E.Scheduler(**cfg), E.Scheduler(**cfg)
    prefix = [rng.randrange(2, 40) for _ in range(8)]
    rids, forks, preempted = [], 0, 0
    for step in range(80):
        if rng.random() < 0.4:
            rid = f"r{step}"
            prompt = prefix[: rng.randrange(0, 9)] + [rng.randrange(2, 40) for _ in range(rng.randrange(1, 6))]
            kw = dict(max_tokens=rng.randrange(1, 16), n=rng.choice([1, 2, 3]), ignore_eos=rng.random() < 0.5)
            for s in (mtp, twin):
                s.add_request(rid, prompt, E.SamplingParams(**kw))
            rids.append(rid)
        om, ot = mtp.schedule(), twin.schedule()
        assert device_work(om) == device_work(ot)
        assert om.seq_ids.tolist() == ot.seq_ids.tolist() and om.num_samples.tolist() == ot.num_samples.tolist()
        forks += sum(k > 1 for k in om.num_samples.tolist())
        preempted += len(om.preempted_seq_ids)
        R = om.num_sample_rows
        toks = np.array([rng.choice([1] + list(range(2, 40))) for _ in range(R)], np.int32)
        appended = E.process_MTPInfo(mtp, np.zeros(R, np.int32), toks.reshape(R, 1))
        twin.update(toks)
        live = _live(mtp, rids)
        assert live == _live(twin, rids)
        assert state(mtp, sorted(live)) == state(twin, sorted(live))
        assert mtp.check_invariants() == ""
        assert int(appended.sum()) <= R
    assert forks > 0
    assert preempted > 0 or cfg["num_blocks"] == 60


def _live(s, rids):
    out = set()
    for r in rids:
        try:
            s.get_sequences(r)
            out.add(r)
        except ValueError:
            pass
    return out
