"""Hand-computed scheduler cases: chunking, per-step prefill cap, preemption order and resume,
priorities, prefix-cache hits, forks, copy-on-write, state slots, lookahead, watermark, stops,
aborts at every stage."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import add_request, make_scheduler, run_step
from deepinfer_engine import _engine as E

S = E.SequenceStatus


def test_chunked_prefill_splits_long_prompt_and_mixes_decodes():
    s = make_scheduler(max_num_batched_tokens=8)
    a = s.add_request("a", list(range(2, 22)), E.SamplingParams(max_tokens=5))  # 20 tokens
    st = run_step(s)
    assert (st["seq_ids"], st["num_tokens"], st["computed"], st["samples"]) == ([a], [8], [0], [0])
    b = s.add_request("b", [3, 4, 5], E.SamplingParams(max_tokens=5))
    st = run_step(s)  # a continues (8), budget exhausted: b waits
    assert (st["seq_ids"], st["num_tokens"], st["computed"]) == ([a], [8], [8])
    st = run_step(s)  # a's last 4 tokens complete its prompt and sample; b takes 3 of the other 4
    assert (st["seq_ids"], st["num_tokens"], st["computed"], st["samples"]) == (
        [a, b],
        [4, 3],
        [16, 0],
        [1, 1],
    )
    st = run_step(s)  # both decode: 1 token each, decodes listed first
    assert (st["seq_ids"], st["num_tokens"], st["is_prefill"]) == ([a, b], [1, 1], [False, False])
    assert s.get_sequence(a).num_computed_tokens == 21
    assert s.get_sequence(a).output_token_ids.tolist() == [7, 7]


def test_long_prefill_threshold_caps_each_prompt_per_step():
    s = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=6)
    a = s.add_request("a", list(range(2, 16)), E.SamplingParams(max_tokens=2))  # 14 tokens
    b = s.add_request("b", [2, 3, 4], E.SamplingParams(max_tokens=2))
    st = run_step(s)
    assert (st["seq_ids"], st["num_tokens"]) == ([a, b], [6, 3])
    st = run_step(s)  # b decodes (listed first), a takes another 6
    assert (st["seq_ids"], st["num_tokens"], st["computed"]) == ([b, a], [1, 6], [3, 6])
    st = run_step(s)
    assert (st["seq_ids"], st["num_tokens"], st["samples"]) == (
        [a],
        [2],
        [1],
    )  # b finished (max_tokens 2)


def test_no_chunking_admits_whole_prompts_only():
    s = make_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=64)
    s.add_request("a", list(range(2, 42)), E.SamplingParams(max_tokens=3))  # 40
    s.add_request("b", list(range(50, 80)), E.SamplingParams(max_tokens=3))  # 30: does not fit the remaining 24
    st = run_step(s)
    assert st["num_tokens"] == [40]
    st = run_step(s)
    assert st["num_tokens"] == [1, 30]


def test_preemption_victim_lowest_priority_then_latest_arrival_and_resume_first():
    # 12 blocks of 4 tokens. Three prompts of 12 tokens take 3 blocks each (9); decoding needs one
    # more block per sequence at token 13 -> only 3 free blocks, then growth forces preemption.
    s = make_scheduler(
        num_blocks=12,
        max_model_len=40,
        max_num_batched_tokens=64,
        policy="priority",
        enable_prefix_caching=False,
    )
    hi = s.add_request("hi", list(range(2, 14)), E.SamplingParams(max_tokens=30, ignore_eos=True), priority=0)
    lo_old = s.add_request("lo_old", list(range(20, 32)), E.SamplingParams(max_tokens=30, ignore_eos=True), priority=5)
    lo_new = s.add_request("lo_new", list(range(40, 52)), E.SamplingParams(max_tokens=30, ignore_eos=True), priority=5)
    st = run_step(s)
    assert st["seq_ids"] == [hi, lo_old, lo_new]
    # Decode 4 steps: positions 12..15 go to each sequence's 4th block (3 left -> all fit).
    for _ in range(4):
        st = run_step(s)
        assert st["preempted"] == []
    assert s.block_manager.num_free_blocks == 0
    # Next decode needs a 5th block for each: hi first -> the victim is lo_new (priority 5, later
    # arrival than lo_old); its 4 freed blocks then serve hi and lo_old.
    st = run_step(s)
    assert st["preempted"] == [lo_new]
    assert st["seq_ids"] == [hi, lo_old]
    assert s.get_sequence(lo_new).status == S.PREEMPTED
    # A new request of better priority, small enough to fit the 2 free blocks, goes before the
    # preempted lo_new (which needs 5 blocks for its 17 tokens): preempted requests re-enter the
    # priority order, they win only ties.
    new = s.add_request("new", [2, 3], E.SamplingParams(max_tokens=1), priority=0)
    assert s.waiting_seq_ids.tolist() == [new, lo_new]
    st = run_step(s)
    assert st["seq_ids"] == [hi, lo_old, new] and st["preempted"] == []
    tie = s.add_request("tie", [2, 4], E.SamplingParams(max_tokens=1), priority=5)
    assert s.waiting_seq_ids.tolist() == [lo_new, tie]      # same priority: the preempted one first


def test_fcfs_victim_is_latest_arrival():
    s = make_scheduler(
        num_blocks=6, max_model_len=20, max_num_batched_tokens=64, enable_prefix_caching=False
    )
    a = s.add_request("a", list(range(2, 10)), E.SamplingParams(max_tokens=20, ignore_eos=True))  # 2 blocks
    b = s.add_request("b", list(range(10, 18)), E.SamplingParams(max_tokens=20, ignore_eos=True), priority=-9)  # ignored by fcfs
    run_step(s)  # 4 blocks used, 2 free
    run_step(s)  # token 9 of each needs a 3rd block: 0 free
    st = run_step(s)
    assert st["preempted"] == []
    for _ in range(2):  # positions 10, 11: still in the 3rd blocks
        assert run_step(s)["preempted"] == []
    # position 12 needs a 4th block for each, none is free: under fcfs the victim is b, the latest
    # arrival, although its priority value would rank it first under the priority policy.
    st = run_step(s)
    assert st["preempted"] == [b] and st["seq_ids"] == [a]
    assert s.get_sequence(b).status == S.PREEMPTED and s.get_sequence(a).status == S.RUNNING


def test_preempted_sequence_recomputes_prompt_and_outputs():
    s = make_scheduler(
        num_blocks=6, max_model_len=20, max_num_batched_tokens=64, enable_prefix_caching=False
    )
    s.add_request("a", list(range(2, 10)), E.SamplingParams(max_tokens=20, ignore_eos=True))
    b = s.add_request("b", list(range(10, 18)), E.SamplingParams(max_tokens=20, ignore_eos=True))
    seen_resume = False
    for _ in range(30):
        out = s.schedule()
        ids, nt, comp = (
            out.seq_ids.tolist(),
            out.num_scheduled_tokens.tolist(),
            out.num_computed_tokens.tolist(),
        )
        if b in ids and s.get_sequence(b).num_tokens > 8 and comp[ids.index(b)] == 0:
            # resumed: recomputes its prompt + the outputs it had, then samples again
            assert nt[ids.index(b)] == s.get_sequence(b).num_tokens
            assert out.num_samples.tolist()[ids.index(b)] == 1
            seen_resume = True
        s.update(np.full(out.num_sample_rows, 9, np.int32))
        assert s.check_invariants() == ""
        if not s.has_unfinished_requests():
            break
    assert seen_resume
    assert s.get_stats()["num_preemptions_total"] >= 1


def test_prefix_cache_hit_whole_blocks_and_never_the_last_token():
    s = make_scheduler()
    prompt = list(range(10, 20))  # 10 tokens: 2 full blocks of 4
    s.add_request("a", prompt, E.SamplingParams(max_tokens=1))
    run_step(s)
    b = s.add_request("b", prompt[:8] + [30, 31, 32], E.SamplingParams(max_tokens=1))
    st = run_step(s)
    assert (st["seq_ids"], st["computed"], st["num_tokens"]) == ([b], [8], [3])
    assert s.get_sequence(b).num_cached_tokens == 8
    # Same 8-token prompt: both blocks cached, but the last token must run -> hit capped at 1 block.
    c = s.add_request("c", prompt[:8], E.SamplingParams(max_tokens=1))
    st = run_step(s)
    assert (st["seq_ids"], st["computed"], st["num_tokens"]) == ([c], [4], [4])
    # A different first block: no hit at all (chained hashes), even with an equal second block.
    d = s.add_request("d", [50, 51, 52, 53] + prompt[4:8] + [1], E.SamplingParams(max_tokens=1))
    st = run_step(s)
    assert (st["seq_ids"], st["computed"]) == ([d], [0])
    bm = s.block_manager
    # queried 10 + 11 + 8 + 9 tokens, hits 0 + 8 + 4 + 0
    assert s.get_stats()["prefix_cache_queries"] == 38 and s.get_stats()["prefix_cache_hits"] == 12
    assert bm.prefix_cache_hit_rate == pytest.approx(12 / 38)


def test_prefix_cache_lru_evicts_least_recently_freed_first():
    # 8 blocks of 4, no watermark. Each prompt of 9 tokens uses 3 blocks (2 cached full ones).
    s = make_scheduler(num_blocks=8, max_model_len=16, max_num_batched_tokens=32)
    p1, p2, p3 = ([k] * 8 + [1] for k in (10, 20, 30))
    s.add_request("a", p1, E.SamplingParams(max_tokens=1))
    run_step(s)
    s.add_request("b", p2, E.SamplingParams(max_tokens=1))
    run_step(s)
    # 4 cached free blocks (p1 older than p2) + 4 uncached free blocks. p3 needs 3 blocks: uncached first.
    assert s.block_manager.num_cached_blocks == 4
    s.add_request("c", p3, E.SamplingParams(max_tokens=1))
    run_step(s)
    assert s.block_manager.num_cached_blocks == 6 and s.block_manager.num_evictions == 0
    # LRU: a1, a0, b1, b0, c1, c0 (tables are freed last block first). d needs 3 blocks: the 2
    # uncached free ones, then the LRU head a1.
    s.add_request("d", [40] * 8 + [1], E.SamplingParams(max_tokens=1))
    run_step(s)
    assert s.block_manager.num_evictions == 1
    # LRU now (oldest first): a0, b1, b0, c1, c0, d1, d0; 1 uncached free block.
    s.add_request("e", p1, E.SamplingParams(max_tokens=1))
    st = run_step(s)
    assert st["computed"] == [4]  # p1's block 0 survived, its block 1 was evicted
    # e needed 2 new blocks: the uncached one, then the LRU head b1 (a0 was taken as a hit).
    assert s.block_manager.num_evictions == 2
    s.add_request("f", p3, E.SamplingParams(max_tokens=1))
    st = run_step(s)
    assert st["computed"] == [8]  # p3 (more recent) fully cached, capped below the last token
    s.add_request("g", p2, E.SamplingParams(max_tokens=1))
    st = run_step(s)
    assert st["computed"] == [4]  # p2 lost its block 1


def test_reset_prefix_cache():
    s = make_scheduler()
    s.add_request("a", list(range(10, 19)), E.SamplingParams(max_tokens=1))
    run_step(s)
    assert s.block_manager.num_cached_blocks == 2
    assert s.reset_prefix_cache() is True
    assert s.block_manager.num_cached_blocks == 0
    s.add_request("b", list(range(10, 19)), E.SamplingParams(max_tokens=1))
    st = run_step(s)
    assert st["computed"] == [0]


def test_fork_after_prefill_shares_full_blocks_and_copies_partial():
    s = make_scheduler(num_state_slots=8)
    a = s.add_request("a", list(range(10, 16)), E.SamplingParams(n=3, max_tokens=4, ignore_eos=True))  # 6 tokens: 1 full + 2
    st = run_step(s, tokens=[21, 22, 23])
    assert st["samples"] == [3] and st["rows"] == 3 and st["states_to_zero"] == [0]
    seqs = s.get_sequences("a")
    assert seqs[0].seq_id == a and len(seqs) == 3
    assert [q.output_token_ids.tolist() for q in seqs] == [[21], [22], [23]]
    assert [q.sample_index for q in seqs] == [0, 1, 2]
    parent_table = seqs[0].block_table.tolist()
    for child in seqs[1:]:
        t = child.block_table.tolist()
        assert t[0] == parent_table[0]  # shared full block
        assert t[1] != parent_table[1]  # own copy of the partial block
    assert s.block_manager.ref_count(parent_table[0]) == 3
    st = run_step(s)  # the device work of the fork comes with the next step
    assert sorted(st["blocks_to_copy"]) == sorted(
        [parent_table[1], q.block_table.tolist()[1]] for q in seqs[1:]
    )
    assert sorted(st["states_to_clone"]) == sorted(
        [seqs[0].state_slot, q.state_slot] for q in seqs[1:]
    )
    assert st["seq_ids"] == [q.seq_id for q in seqs]


def test_fork_without_free_block_shares_partial_then_copy_on_write():
    # 4 blocks. A (6 tokens: 1 full + 1 partial block, n=3) and X (4 tokens, 1 block) fill 3.
    s = make_scheduler(
        num_blocks=4,
        max_model_len=12,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
        max_num_seqs=4,
    )
    s.add_request("a", list(range(10, 16)), E.SamplingParams(n=3, max_tokens=3, ignore_eos=True))
    s.add_request("x", [2, 3, 4, 5], E.SamplingParams(max_tokens=1))
    run_step(s, tokens=[21, 22, 23, 24])
    # Fork (before X finished): child 1 copied the partial block into the one free block, child 2
    # shares it; then X finished and freed its block.
    p, c1, c2 = s.get_sequences("a")
    tp, t1, t2 = (q.block_table.tolist() for q in (p, c1, c2))
    assert t1[0] == t2[0] == tp[0] and s.block_manager.ref_count(tp[0]) == 3
    assert t1[1] != tp[1] and t2[1] == tp[1] and s.block_manager.ref_count(tp[1]) == 2
    assert s.block_manager.num_free_blocks == 1
    st = run_step(s)
    # The parent's write into the shared partial block copies it first (copy-on-write).
    new_tp = s.get_sequence(p.seq_id).block_table.tolist()
    assert new_tp[1] not in (tp[1], t1[1])
    assert sorted(st["blocks_to_copy"]) == sorted([[tp[1], t1[1]], [tp[1], new_tp[1]]])
    assert s.get_sequence(c2.seq_id).block_table.tolist()[1] == tp[1]
    assert s.block_manager.ref_count(tp[1]) == 1
    assert s.block_manager.num_cow_copies == 2


def test_clone_and_zero_states_and_blocks_direct():
    s = make_scheduler(num_state_slots=8)
    a = s.add_request("a", list(range(10, 17)), E.SamplingParams(max_tokens=5, ignore_eos=True))  # 7 tokens
    run_step(s)
    parent = s.get_sequence(a)
    ids, copies, clones, zeros = E.clone_and_zero_states_and_blocks(s, a, 2)
    assert ids.dtype == np.int64 and copies.dtype == np.int32 and copies.shape == (2, 2)
    pt = parent.block_table.tolist()
    for cid, (src, dst) in zip(ids.tolist(), copies.tolist()):
        c = s.get_sequence(cid)
        assert c.block_table.tolist() == [pt[0], dst] and src == pt[1]
        assert c.token_ids.tolist() == parent.token_ids.tolist()
        assert c.num_computed_tokens == parent.num_computed_tokens
    assert clones.tolist() == [
        [parent.state_slot, s.get_sequence(i).state_slot] for i in ids.tolist()
    ]
    assert zeros.shape == (0,)
    assert s.block_manager.ref_count(pt[0]) == 3
    assert s.check_invariants() == ""
    st = run_step(s)
    assert len(st["seq_ids"]) == 3


def test_lookahead_slots_reserved_for_decodes():
    s = make_scheduler(num_lookahead_slots=5)
    a = s.add_request("a", [2, 3, 4], E.SamplingParams(max_tokens=10, ignore_eos=True))
    run_step(s)  # prefill: 3 slots -> 1 block
    assert len(s.get_sequence(a).block_table) == 1
    run_step(s)  # decode of token 4 (position 3) + 5 lookahead -> 9 slots -> 3 blocks
    assert len(s.get_sequence(a).block_table) == 3


@pytest.mark.parametrize("watermark, admitted", [(0.25, 2), (0.0, 3)])
def test_watermark_blocks_admission(watermark, admitted):
    # 12 blocks; 15-token prompts need 4 each. With 3 blocks kept free, the third prompt would
    # leave 0 < 3 and waits; without a watermark it is admitted.
    s = make_scheduler(
        num_blocks=12,
        watermark=watermark,
        max_model_len=16,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
    )
    for k in range(3):
        s.add_request(f"r{k}", list(range(20 * k + 2, 20 * k + 17)), E.SamplingParams(max_tokens=2))
    st = run_step(s)
    assert st["num_tokens"] == [15] * admitted
    assert s.block_manager.watermark_blocks == int(12 * watermark)


def test_max_num_seqs_counts_n_of_unforked_groups():
    s = make_scheduler(max_num_seqs=4)
    s.add_request("a", [2, 3], E.SamplingParams(n=3, max_tokens=3))
    s.add_request("b", [4, 5], E.SamplingParams(n=2, max_tokens=3))
    st = run_step(s, tokens=[9, 9, 9])
    assert len(st["seq_ids"]) == 1  # 3 + 2 > 4
    assert s.num_running == 3


def test_ignored_prompt_too_long():
    s = make_scheduler(max_model_len=16)
    a = s.add_request("a", list(range(2, 19)), E.SamplingParams(max_tokens=1))  # 17 > 16
    b = s.add_request("b", [2, 3], E.SamplingParams(max_tokens=1))
    st = run_step(s)
    assert st["ignored"] == [a] and st["seq_ids"] == [b]
    q = s.get_sequence(a)
    assert q.status == S.FINISHED_IGNORED and q.finish_reason == "ignored"
    assert "17" in q.stop_reason and "16" in q.stop_reason
    info = E.get_finished_seqs_info(s)
    assert sorted(info["seq_ids"].tolist()) == [a, b]


@pytest.mark.parametrize(
    "params, tokens, status, stop_reason, n_out",
    [
        (dict(max_tokens=5), [9, 1], S.FINISHED_STOPPED, None, 2),  # EOS
        (dict(max_tokens=5, ignore_eos=True), [9, 1, 9, 9, 9], S.FINISHED_LENGTH, None, 5),
        (
            dict(max_tokens=5, min_tokens=3),
            [1, 1, 1],
            S.FINISHED_STOPPED,
            None,
            3,
        ),  # EOS not before min_tokens
        (dict(max_tokens=5, stop_token_ids=[8]), [9, 8], S.FINISHED_STOPPED, 8, 2),
        (dict(max_tokens=5, min_tokens=2, stop_token_ids=[8]), [8, 8], S.FINISHED_STOPPED, 8, 2),
        (dict(max_tokens=3), [9, 9, 9], S.FINISHED_LENGTH, None, 3),
        (
            dict(max_tokens=50, ignore_eos=True),
            [9] * 6,
            S.FINISHED_LENGTH,
            None,
            6,
        ),  # max_model_len 16 - 10
    ],
)
def test_stop_conditions(params, tokens, status, stop_reason, n_out):
    s = make_scheduler(max_model_len=16)
    a = add_request(s, "a", list(range(10, 20)), **params)
    for t in tokens:
        assert s.has_unfinished_requests()
        run_step(s, tokens=[t])
    q = s.get_sequence(a)
    assert q.status == status and q.stop_reason == stop_reason and len(q.output_token_ids) == n_out
    assert not s.has_unfinished_requests()
    assert E.get_finished_seqs_info(s)["seq_ids"].tolist() == [a]


def test_stop_sequence_for_stop_string_truncates():
    s = make_scheduler()
    a = s.add_request("a", [2, 3], E.SamplingParams(max_tokens=10))
    for t in (11, 12, 13):
        run_step(s, tokens=[t])
    s.stop_sequence(a, "</s>", 2)
    q = s.get_sequence(a)
    assert (
        q.status == S.FINISHED_STOPPED
        and q.stop_reason == "</s>"
        and q.output_token_ids.tolist() == [11, 12]
    )
    outs = E.build_request_outputs(s, E.RequestOutputPool())
    assert outs[0].finished and outs[0].outputs[0].stop_reason == "</s>"
    assert outs[0].outputs[0].token_ids == [11, 12]
    assert E.get_finished_seqs_info(s)["seq_ids"].tolist() == [a]
    assert s.check_invariants() == ""


@pytest.mark.parametrize("stage", ["waiting", "mid_prefill", "running", "preempted", "in_flight"])
def test_abort_at_every_stage(stage):
    s = make_scheduler(
        num_blocks=6, max_model_len=20, max_num_batched_tokens=4, enable_prefix_caching=False
    )
    a = s.add_request("a", list(range(2, 10)), E.SamplingParams(max_tokens=20, ignore_eos=True))
    b = s.add_request("b", list(range(10, 18)), E.SamplingParams(max_tokens=20, ignore_eos=True))
    target = b
    if stage == "mid_prefill":
        run_step(s)
        assert s.get_sequence(a).num_computed_tokens == 4
        target = a
    elif stage == "running":
        for _ in range(4):
            run_step(s)
        assert s.get_sequence(b).status == S.RUNNING
    elif stage == "preempted":
        for _ in range(40):
            run_step(s)
            if s.get_sequence(b).status == S.PREEMPTED:
                break
        assert s.get_sequence(b).status == S.PREEMPTED
    rid = "a" if target == a else "b"
    if stage == "in_flight":
        for _ in range(4):
            run_step(s)
        out = s.schedule()
        assert target in out.seq_ids.tolist()
        assert s.abort_request(rid) == 1
        s.update(np.full(out.num_sample_rows, 9, np.int32))
    else:
        assert s.abort_request(rid) == 1
        run_step(s)
    q = s.get_sequence(target)
    assert q.status == S.FINISHED_ABORTED and q.finish_reason == "abort"
    assert target in E.get_finished_seqs_info(s)["seq_ids"].tolist()
    assert s.check_invariants() == ""
    assert len(q.block_table) == 0
    assert s.abort_request(rid) == 0  # already finished: nothing to do


def test_stop_string_on_a_sequence_that_just_hit_max_tokens():
    s = make_scheduler()
    a = s.add_request("a", [2, 3], E.SamplingParams(max_tokens=2), output_kind="delta")
    pool = E.RequestOutputPool()
    run_step(s, tokens=[11])
    E.build_request_outputs(s, pool)
    run_step(s, tokens=[12])
    (o,) = E.build_request_outputs(s, pool)
    assert o.finished and o.outputs[0].finish_reason == "length"
    # The detokenizer finds a stop string ending in the last token: the stop string wins.
    s.stop_sequence(a, "STOP", 2)
    (o,) = E.build_request_outputs(s, pool)
    assert (
        o.finished and o.outputs[0].finish_reason == "stop" and o.outputs[0].stop_reason == "STOP"
    )
    assert o.outputs[0].token_ids == []  # delta: nothing new
    info = E.get_finished_seqs_info(s)
    assert info["statuses"].tolist() == [int(S.FINISHED_STOPPED)]


def test_stop_sequence_on_a_preempted_sequence_leaves_the_queue():
    s = make_scheduler(
        num_blocks=6, max_model_len=20, max_num_batched_tokens=64, enable_prefix_caching=False
    )
    s.add_request("a", list(range(2, 10)), E.SamplingParams(max_tokens=20, ignore_eos=True))
    b = s.add_request("b", list(range(10, 18)), E.SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(10):
        run_step(s)
        if s.get_sequence(b).status == S.PREEMPTED:
            break
    assert s.get_sequence(b).status == S.PREEMPTED
    s.stop_sequence(b, "END", 1)
    assert b not in s.waiting_seq_ids.tolist() and s.num_preempted == 0
    assert s.check_invariants() == ""
    st = run_step(s)
    assert b not in st["seq_ids"]


def test_fork_from_python_of_an_unforked_n_group_keeps_unit_accounting():
    s = make_scheduler(max_num_seqs=4, max_num_batched_tokens=4)
    a = s.add_request("a", list(range(2, 12)), E.SamplingParams(n=3, max_tokens=4))  # 10 tokens: 3 chunked steps
    run_step(s)  # mid-prefill, holding 3 units
    ids, *_ = E.clone_and_zero_states_and_blocks(s, a, 1)
    assert s.check_invariants() == ""  # parent now holds 1 unit, the child 1
    while s.has_unfinished_requests():
        out = s.schedule()
        assert out.num_samples.max(initial=0) <= 1  # the group counts as forked: no n-way sampling
        s.update(np.full(out.num_sample_rows, 9, np.int32))
        assert s.check_invariants() == ""
    assert len(ids) == 1
