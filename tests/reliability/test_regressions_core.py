"""Minimal reproductions of the scheduler / block / output bugs the state machine found
(reported in build/notes/requests-for-core-I.md). Each is xfail(strict) until fixed; the
expectation is independent of the engine: the pure-Python reference or a hand-computed case."""

from __future__ import annotations

import numpy as np
import pytest
from deepinfer_engine import _engine as E
from reference import RefScheduler

CFG = dict(num_blocks=40, block_size=1, max_num_seqs=4, max_num_batched_tokens=43, max_model_len=31,
           watermark=0.0)


def _step(sched, tokens):
    out = sched.schedule()
    sched.update(np.asarray(tokens[: out.num_sample_rows], np.int32))
    return out


def test_reset_prefix_cache_never_serves_blocks_computed_before_it():
    c = E.Scheduler(**CFG, vocab_size=40, eos_token_id=1)
    r = RefScheduler(**CFG, eos_token_id=1)
    c.add_request("a", [5, 6, 7, 8], E.SamplingParams(max_tokens=10))
    r.add_request("a", [5, 6, 7, 8], max_tokens=10)
    for _ in range(2):
        _step(c, [9])
        r.schedule()
        r.update([9])
    assert c.reset_prefix_cache()
    r.bm.reset()
    _step(c, [9])          # "a" keeps decoding after the reset
    r.schedule()
    r.update([9])
    # A new request with the same prefix must not hit KV computed before the reset.
    for s in (c, r):
        s.add_request("b", [5, 6, 7, 8, 9, 9, 3], E.SamplingParams(max_tokens=4))
    c_out, r_out = c.schedule(), r.schedule()
    hit = {sid: comp for sid, _, comp, _, _ in r_out["scheduled"]}
    assert hit[1] == 0
    assert dict(zip(c_out.seq_ids.tolist(), c_out.num_computed_tokens.tolist()))[1] == hit[1]
    assert c.block_manager.num_cached_blocks == len(r.bm.cache)


def test_update_on_a_speculative_step_is_refused_or_rolls_back():
    s = E.Scheduler(num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=31,
                    vocab_size=40, eos_token_id=1, num_lookahead_slots=3, watermark=0.0)
    s.add_request("a", [5, 6, 7, 8, 9], E.SamplingParams(max_tokens=10))
    s.schedule()
    E.process_MTPInfo(s, np.zeros(1, np.int32), np.array([[11]], np.int32), np.array([[12, 13]], np.int32))
    out = s.schedule()
    assert out.num_scheduled_tokens.tolist() == [3]        # last token + 2 drafts
    before = s.get_sequence(0)
    computed, tokens = before.num_computed_tokens, before.token_ids.tolist()
    with pytest.raises(ValueError, match="process_MTPInfo"):  # the caller forgot process_MTPInfo
        s.update(np.array([14], np.int32))
    assert s.check_invariants() == ""
    seq = s.get_sequence(0)                                 # refused: nothing changed
    assert seq.num_computed_tokens == computed and seq.token_ids.tolist() == tokens


def test_step_with_drafts_and_an_n_gt_1_prompt_can_be_applied():
    s = E.Scheduler(num_blocks=60, block_size=4, max_num_seqs=6, max_num_batched_tokens=64, max_model_len=31,
                    vocab_size=40, eos_token_id=1, num_lookahead_slots=3, watermark=0.0)
    s.add_request("a", [5, 6, 7, 8, 9], E.SamplingParams(max_tokens=10))
    s.schedule()
    E.process_MTPInfo(s, np.zeros(1, np.int32), np.array([[11]], np.int32), np.array([[12, 13]], np.int32))
    s.add_request("b", [20, 21, 22], E.SamplingParams(max_tokens=10, n=2))
    out = s.schedule()
    assert out.num_samples.tolist() == [1, 2]               # a: decode + 2 drafts; b: completes, n = 2
    # a accepts one draft (tokens 12 and the bonus 15); b's two samples 30, 31.
    E.process_MTPInfo(s, np.array([1, 0, 0], np.int32), np.array([[12, 15], [30, 0], [31, 0]], np.int32))
    assert s.get_sequence(0).output_token_ids.tolist() == [11, 12, 15]
    assert sorted(q.output_token_ids.tolist() for q in s.get_sequences("b")) == [[30], [31]]
    assert s.check_invariants() == ""


def test_delta_stream_of_a_forked_child_is_complete():
    s = E.Scheduler(**CFG, vocab_size=40, eos_token_id=1)
    pool = E.RequestOutputPool()
    s.add_request("a", [5, 6, 7, 8, 9], E.SamplingParams(max_tokens=3), output_kind="delta")
    streamed: dict[int, list[int]] = {}

    def collect():
        for ro in E.build_request_outputs(s, pool):
            for c in ro.outputs:
                streamed.setdefault(c.index, []).extend(c.token_ids)

    _step(s, [24])
    collect()
    (child,), _, _, _ = E.clone_and_zero_states_and_blocks(s, 0, 1)
    _step(s, [25, 26])
    collect()
    _step(s, [27, 28])
    collect()
    # what the sequences hold, and what a delta consumer must be able to rebuild
    assert s.get_sequence(int(child)).output_token_ids.tolist() == [24, 26, 28]
    assert streamed == {0: [24, 25, 27], 1: [24, 26, 28]}


_HUGE_SCHEDULER = """
import resource
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))   # never let it take the machine
from deepinfer_engine import _engine as E
try:
    E.Scheduler(num_blocks=2**31 - 1, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                max_model_len=48, vocab_size=50)
except ValueError as e:
    print("ValueError", e)
except MemoryError as e:
    print("MemoryError", e)
"""


def test_huge_num_blocks_is_refused_with_a_value_error():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", _HUGE_SCHEDULER], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("ValueError") and "num_blocks" in r.stdout, r.stdout


def test_drafts_never_scheduled_past_max_model_len():
    s = E.Scheduler(num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=10,
                    vocab_size=40, eos_token_id=1, num_lookahead_slots=3, watermark=0.0)
    s.add_request("a", [5, 6, 7, 8, 9, 10, 11], E.SamplingParams(max_tokens=3))      # 7 prompt tokens
    s.schedule()
    E.process_MTPInfo(s, np.zeros(1, np.int32), np.array([[12]], np.int32), np.array([[13, 14, 15]], np.int32))
    out = s.schedule()                                               # 8 tokens, 7 computed
    end = out.num_computed_tokens[0] + out.num_scheduled_tokens[0]
    assert end <= 10, f"positions up to {end} scheduled with max_model_len 10"


def test_n_gt_1_with_a_one_token_last_prompt_chunk_forks_every_sample():
    """A final prompt chunk of exactly one token completes the prompt: n sample rows and a fork,
    not a one-row decode (the reference scheduler had the same rule and is checked too)."""
    cfg = dict(num_blocks=64, block_size=4, max_num_batched_tokens=4, max_model_len=64, watermark=0.0,
               max_num_seqs=8)
    c = E.Scheduler(**cfg, vocab_size=100)
    r = RefScheduler(**cfg)
    c.add_request("r", [10, 11, 12, 13, 14], E.SamplingParams(n=2, max_tokens=2, ignore_eos=True))
    r.add_request("r", [10, 11, 12, 13, 14], n=2, max_tokens=2, ignore_eos=True)
    samples = []
    while c.has_unfinished_requests():
        out, ref = c.schedule(), r.schedule()
        assert [e[3] for e in ref["scheduled"]] == out.num_samples.tolist()
        samples.append(out.num_samples.tolist())
        c.update(np.full(out.num_sample_rows, 7, np.int32))
        r.update([7] * out.num_sample_rows)
    assert samples[:2] == [[0], [2]]       # chunk of 4, then the last prompt token samples n = 2
    outs = E.build_request_outputs(c, E.RequestOutputPool())
    assert [len(c_.token_ids) for c_ in outs[0].outputs] == [2, 2]


def _bufs(T=256, S=8, W=16):
    return dict(input_ids=np.zeros(T, np.int32), positions=np.zeros(T, np.int32),
                slot_mapping=np.zeros(T, np.int64), query_start_loc=np.zeros(S + 1, np.int32),
                seq_lens=np.zeros(S, np.int32), block_tables=np.zeros((S, W), np.int32),
                logits_indices=np.zeros(T, np.int32))


def test_prompt_logprobs_after_a_prefix_hit_cover_the_whole_prompt():
    """A request asking for prompt logprobs is not served cached blocks for the positions whose
    logprobs it needs (it computes them); the blocks stay cached for the others."""
    s = E.Scheduler(num_blocks=16, block_size=16, max_num_batched_tokens=128, max_model_len=128, vocab_size=100)
    prompt = list(range(40))
    s.add_request("a", prompt, E.SamplingParams(max_tokens=1))
    _step(s, [7])
    s.add_request("b", prompt, E.SamplingParams(prompt_logprobs=0, max_tokens=1))
    out = s.schedule()
    assert out.num_computed_tokens.tolist() == [0]          # no hit: b needs positions 1..39
    pool, si = E.SequenceMetadataPool(), E.SamplerInputs()
    pool.build(s)
    args = E.PrepareArgs(block_size=16, max_model_len=128, **_bufs())
    E.prepare_prompt_v4(args, pool)
    E.prepare_sampler_inputs(args, pool, si)
    pl = si.prompt_logprobs
    assert pl.num_rows == 39
    E.update_prompt_logprobs(s, si, np.full(pl.num_rows, -0.5, np.float32))
    s.update(np.array([7], np.int32))
    (ro,) = E.build_request_outputs(s, E.RequestOutputPool())
    assert ro.prompt_logprobs[0] is None
    assert [list(d) for d in ro.prompt_logprobs[1:]] == [[t] for t in prompt[1:]]
    # The blocks are still cached for a request that does not ask for prompt logprobs.
    s.add_request("c", prompt, E.SamplingParams(max_tokens=1))
    assert s.schedule().num_computed_tokens.tolist() == [32]


def test_fork_copies_of_a_finished_sample_are_cancelled():
    """A forked sample that ends (stop string, abort) before the next step: its queued partial-block
    copy must not reach that step (its block may already belong to another sequence)."""
    cfg = dict(num_blocks=5, block_size=4, max_num_batched_tokens=64, max_model_len=20, vocab_size=100,
               watermark=0.0)
    for end in ("stop", "abort"):
        s = E.Scheduler(**cfg)
        s.add_request("A", [10, 11, 12, 13, 14, 15], E.SamplingParams(n=2, max_tokens=5, ignore_eos=True))
        s.add_request("B", [20, 21, 22, 23, 24, 25], E.SamplingParams(n=2, max_tokens=5, ignore_eos=True))
        _step(s, [4, 4, 4, 4])
        child = s.get_sequences("A")[1].seq_id
        if end == "stop":
            s.stop_sequence(child, "\n", 1)
        else:
            s.abort_request("A")
        out = s.schedule()
        dsts = [d for _, d in out.blocks_to_copy.tolist()]
        assert len(dsts) == len(set(dsts)), (end, out.blocks_to_copy.tolist())
        owned = {b for sid in s.running_seq_ids.tolist() for b in s.get_sequence(sid).block_table.tolist()}
        assert set(dsts) <= owned, (end, out.blocks_to_copy.tolist())
        assert s.check_invariants() == ""


def test_state_clone_of_an_aborted_fork_never_meets_a_zero_of_the_same_slot():
    s = E.Scheduler(num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=20,
                    vocab_size=100, watermark=0.0, num_state_slots=4)
    s.add_request("A", [10, 11, 12, 13, 14, 15], E.SamplingParams(n=2, max_tokens=5, ignore_eos=True))
    _step(s, [4, 4])
    s.abort_request("A")
    s.add_request("C", [30, 31, 32], E.SamplingParams(max_tokens=2))
    out = s.schedule()
    targets = [d for _, d in out.states_to_clone.tolist()] + out.states_to_zero.tolist()
    assert len(targets) == len(set(targets)), (out.states_to_clone.tolist(), out.states_to_zero.tolist())
    slots = {s.get_sequence(sid).state_slot for sid in s.running_seq_ids.tolist()}
    assert set(targets) <= slots


def test_a_preempted_request_does_not_block_a_higher_priority_one_that_fits():
    """Preempted requests re-enter the priority order: a preempted priority-5 request that does not
    fit must not keep out a new priority -1 request that does."""
    s = E.Scheduler(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32,
                    vocab_size=100, watermark=0.0, policy="priority")
    s.add_request("hi", list(range(10, 22)), E.SamplingParams(max_tokens=20, ignore_eos=True), priority=0)   # 3 blocks
    s.add_request("lo", list(range(30, 42)), E.SamplingParams(max_tokens=20, ignore_eos=True), priority=5)   # 3 blocks
    preempted = False
    for _ in range(12):
        out = _step(s, [7, 7])
        preempted |= s.num_preempted > 0
        if preempted:
            break
    assert preempted and s.get_sequences("lo")[0].status == E.SequenceStatus.PREEMPTED
    s.add_request("urgent", [50, 51, 52], E.SamplingParams(max_tokens=1), priority=-1)   # one block: fits
    out = s.schedule()
    assert "urgent" in out.request_ids, (out.request_ids, s.block_manager.num_free_blocks)


def test_arrival_time_orders_requests():
    s = E.Scheduler(num_blocks=40, block_size=4, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=32,
                    vocab_size=100)
    s.add_request("late", [5, 6, 7], E.SamplingParams(max_tokens=1), arrival_time=200.0)
    s.add_request("early", [5, 6, 8], E.SamplingParams(max_tokens=1), arrival_time=100.0)
    assert s.schedule().request_ids == ["early"]


def test_a_finished_request_id_is_free_once_its_final_output_was_built():
    s = E.Scheduler(num_blocks=40, block_size=4, max_num_batched_tokens=64, max_model_len=32, vocab_size=100)
    s.add_request("a", [5, 6, 7], E.SamplingParams(max_tokens=1))
    _step(s, [9])
    (ro,) = E.build_request_outputs(s, E.RequestOutputPool())
    assert ro.finished
    s.add_request("a", [5, 6, 7, 8], E.SamplingParams(max_tokens=2))          # reused before the next schedule()
    out = s.schedule()
    assert out.request_ids == ["a"] and s.get_sequences("a")[0].num_prompt_tokens == 4
    s.update(np.array([9], np.int32))
    assert s.check_invariants() == ""


def test_update_takes_any_integer_array_and_validates_it():
    torch = pytest.importorskip("torch")
    for tokens in (np.array([9, 8], np.int64), np.array([9, 8], np.uint16), [9, 8],
                   torch.tensor([9, 8], dtype=torch.int64), torch.tensor([9, 8], dtype=torch.int32),
                   np.array([0, 9, 0, 8], np.int32)[1::2]):
        s = E.Scheduler(num_blocks=40, block_size=4, max_num_batched_tokens=64, max_model_len=32, vocab_size=100)
        s.add_request("a", [5, 6, 7], E.SamplingParams(max_tokens=3))
        s.add_request("b", [5, 6, 8], E.SamplingParams(max_tokens=3))
        s.schedule()
        s.update(tokens)
        assert [q.output_token_ids.tolist() for q in (s.get_sequences("a")[0], s.get_sequences("b")[0])] == [[9], [8]]
    s = E.Scheduler(num_blocks=40, block_size=4, max_num_batched_tokens=64, max_model_len=32, vocab_size=100)
    s.add_request("a", [5, 6, 7], E.SamplingParams(max_tokens=3))
    s.schedule()
    for bad, err, match in ((np.array([1.0], np.float32), TypeError, "sampled_token_ids"),
                            (torch.tensor([1.0]), TypeError, "sampled_token_ids"),
                            (np.array([True]), TypeError, "sampled_token_ids"),
                            ([1.5], TypeError, "sampled_token_ids"),
                            (np.array([2**40], np.int64), ValueError, "vocabulary"),
                            (np.array([-1], np.int64), ValueError, "vocabulary"),
                            (np.array([100], np.uint8), ValueError, "vocabulary"),
                            (np.array([1, 2], np.int64), ValueError, "sampled_token_ids"),
                            (np.array([[1]], np.int64), ValueError, "sampled_token_ids"),
                            ("x", TypeError, "sampled_token_ids")):
        with pytest.raises(err, match=match):
            s.update(bad)
        assert s.step_in_flight and s.get_sequences("a")[0].output_token_ids.tolist() == []
    s.update(torch.tensor([3]))
    assert s.get_sequences("a")[0].output_token_ids.tolist() == [3]
