"""The builders on the real sequence store: SequenceMetadataPool.build(scheduler), a full step loop,
process_MTPInfo and update_prompt_logprobs."""

from __future__ import annotations

import random

import numpy as np
import pytest
from deepinfer_engine import _engine as E
from inputs_helpers import make_args, make_buffers
from inputs_reference.layout import RefRow, reference_layout
from inputs_reference.sampler import reference_sampler
from test_inputs_prepare import check_against_reference

VOCAB = 1000


def rows_from_scheduler(sched, out):
    rows = []
    for sid, start, num, is_prefill in zip(out.seq_ids.tolist(), out.num_computed_tokens.tolist(),
                                           out.num_scheduled_tokens.tolist(), out.is_prefill.tolist()):
        s = sched.get_sequence(sid)
        rows.append(RefRow(sid, s.request_id, s.token_ids.tolist(), s.num_prompt_tokens, start, num,
                           s.block_table.tolist(), drafts=s.draft_token_ids.tolist(), is_prompt=is_prefill))
    return rows


@pytest.mark.parametrize("num_blocks", [512, 40])  # 40: memory pressure, preemption + recompute
def test_step_loop_matches_reference_and_update_consumes_sampler_rows(num_blocks):
    rng = random.Random(3)
    sched = E.Scheduler(num_blocks=num_blocks, block_size=16, max_num_seqs=8, max_num_batched_tokens=96,
                        max_model_len=512, vocab_size=VOCAB)
    plp_k = {}
    for i in range(12):
        plp_k[f"r{i}"] = rng.choice([-1, -1, 2])
        sched.add_request(f"r{i}", [rng.randrange(VOCAB) for _ in range(rng.randint(5, 150))], E.SamplingParams(max_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 1.0]), seed=rng.choice([None, 11]), presence_penalty=rng.choice([0.0, 0.5]), prompt_logprobs=None if plp_k[f"r{i}"] < 0 else plp_k[f"r{i}"]))
    bufs = make_buffers(max_tokens=256, max_seqs=8, width=32)
    args = make_args(bufs, max_model_len=512)
    pool = E.SequenceMetadataPool()
    si = E.SamplerInputs()
    steps = 0
    preempted = 0
    plp_done = {}  # request -> prompt positions attached so far
    while sched.has_unfinished_requests() and steps < 2000:
        out = sched.schedule()
        steps += 1
        preempted += len(out.preempted_seq_ids)
        if out.is_empty:
            continue
        assert pool.build(sched) == len(out)
        rows = rows_from_scheduler(sched, out)
        for r in rows:
            r.prompt_logprobs = plp_k[r.request_id]
            r.plp_done = plp_done.get(r.request_id, 0)
        n = E.prepare_prompt_v4(args, pool)
        ref = reference_layout(rows, block_size=16, width=32)
        check_against_reference(args, bufs, rows, ref, n)
        E.prepare_sampler_inputs(args, pool, si)
        assert si.driver.num_real_rows == out.num_sample_rows
        expect, plp, _ = reference_sampler(rows, ref)
        assert si.kernel.logits_rows.tolist() == [e["logits_row"] for e in expect]
        assert si.prompt_logprobs.num_rows == len(plp)
        if plp:
            k = si.prompt_logprobs.max_num_logprobs
            N = si.prompt_logprobs.num_rows
            E.update_prompt_logprobs(sched, si, -np.arange(N, dtype=np.float32),
                                     np.zeros((N, k), np.int32), np.zeros((N, k), np.float32))
            for sid, pos in zip(si.prompt_logprobs.seq_ids.tolist(), si.prompt_logprobs.positions.tolist()):
                req = sched.get_sequence(sid).request_id
                plp_done[req] = max(plp_done.get(req, 0), pos)
        sched.update(np.array([rng.randrange(1, VOCAB) for _ in range(out.num_sample_rows)], np.int32))
    assert not sched.has_unfinished_requests()
    assert (preempted > 0) == (num_blocks == 40)


def test_n_gt_1_prompt_gives_n_sample_rows_with_distinct_subsequences():
    sched = E.Scheduler(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=64,
                        max_model_len=128, vocab_size=VOCAB)
    sched.add_request("n3", list(range(20)), E.SamplingParams(n=3, max_tokens=3, seed=77, temperature=1.0))
    bufs = make_buffers(max_tokens=64, max_seqs=8, width=8)
    args = make_args(bufs, max_model_len=128)
    pool, si = E.SequenceMetadataPool(), E.SamplerInputs()
    out = sched.schedule()
    pool.build(sched)
    E.prepare_prompt_v4(args, pool)
    E.prepare_sampler_inputs(args, pool, si)
    assert out.num_sample_rows == si.driver.num_real_rows == 3
    assert si.kernel.logits_rows.tolist() == [0, 0, 0]  # one logits row (token row 19), sampled 3 times
    assert bufs["logits_indices"][0] == 19
    assert si.kernel.subsequences.tolist() == [0, 1, 2]
    assert si.kernel.seeds.tolist() == [77, 77, 77] and si.kernel.offsets.tolist() == [0, 0, 0]
    sched.update(np.array([5, 6, 7], np.int32))
    out = sched.schedule()
    pool.build(sched)
    E.prepare_decode_v4(args, pool)
    E.prepare_sampler_inputs(args, pool, si)
    # The children continue their own streams: subsequence = sample index, offset = 1.
    assert sorted(si.kernel.subsequences.tolist()) == [0, 1, 2]
    assert si.kernel.offsets.tolist() == [1, 1, 1]
    rows = rows_from_scheduler(sched, out)
    check_against_reference(args, bufs, rows, reference_layout(rows, block_size=16, width=8), args.num_tokens)


def test_prompt_logprobs_attached_chunk_by_chunk():
    rng = random.Random(4)
    sched = E.Scheduler(num_blocks=256, block_size=16, max_num_seqs=4, max_num_batched_tokens=32,
                        max_model_len=256, vocab_size=VOCAB, enable_prefix_caching=False)
    prompt = [rng.randrange(VOCAB) for _ in range(70)]
    sched.add_request("p", prompt, E.SamplingParams(max_tokens=1, prompt_logprobs=1))
    bufs = make_buffers(max_tokens=64, max_seqs=4, width=32)
    args = make_args(bufs, max_model_len=256)
    pool, si = E.SequenceMetadataPool(), E.SamplerInputs()
    seen_targets, seen_pos = [], []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        pool.build(sched)
        E.prepare_prompt_v4(args, pool)
        E.prepare_sampler_inputs(args, pool, si)
        P = si.prompt_logprobs
        seen_targets += P.target_token_ids.tolist()
        seen_pos += P.positions.tolist()
        # logprob of position p := -p, top-1 id := p (so the stored order can be checked).
        lp = -P.positions.astype(np.float32)
        E.update_prompt_logprobs(sched, si, lp, P.positions.reshape(-1, 1).astype(np.int32),
                                 np.zeros((P.num_rows, 1), np.float32))
        sched.update(np.full(out.num_sample_rows, 5, np.int32))
    assert seen_pos == list(range(1, 70))
    assert seen_targets == prompt[1:]
    pool_out = E.RequestOutputPool()
    outs = E.build_request_outputs(sched, pool_out)
    (o,) = [o for o in outs if o.request_id == "p"]
    assert len(o.prompt_logprobs) == 70 and o.prompt_logprobs[0] is None
    for p in range(1, 70):
        expected = {prompt[p]: float(-p)}
        expected[p] = 0.0  # the top-1 entry (id p, logprob 0) given above
        assert o.prompt_logprobs[p] == expected


def test_prompt_logprobs_out_of_order_rejected_without_writing():
    sched = E.Scheduler(num_blocks=64, block_size=16, max_num_seqs=2, max_num_batched_tokens=16,
                        max_model_len=128, vocab_size=VOCAB, enable_prefix_caching=False)
    sched.add_request("p", list(range(40)), E.SamplingParams(max_tokens=1, prompt_logprobs=0))
    bufs = make_buffers(max_tokens=64, max_seqs=2, width=8)
    args = make_args(bufs, max_model_len=128)
    pool, si = E.SequenceMetadataPool(), E.SamplerInputs()
    sched.schedule()
    pool.build(sched)
    E.prepare_prompt_v4(args, pool)
    E.prepare_sampler_inputs(args, pool, si)
    N = si.prompt_logprobs.num_rows
    E.update_prompt_logprobs(sched, si, np.zeros(N, np.float32))
    with pytest.raises(ValueError, match="position"):  # the same chunk twice
        E.update_prompt_logprobs(sched, si, np.zeros(N, np.float32))
    with pytest.raises(ValueError, match="logprobs"):
        E.update_prompt_logprobs(sched, si, np.zeros(N + 1, np.float32))


def spec_setup(k=2, max_tokens=50, eos=None, min_tokens=0):
    sched = E.Scheduler(num_blocks=256, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                        max_model_len=256, vocab_size=VOCAB, num_lookahead_slots=k,
                        eos_token_id=eos)
    sched.add_request("a", [1, 2, 3, 4, 5], E.SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens))
    sched.add_request("b", [7, 8, 9], E.SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens))
    sched.schedule()  # prefill both
    drafts = np.array([[100, 101], [200, 201]], np.int32)[:, :k]
    appended = E.process_MTPInfo(sched, np.zeros(2, np.int32), np.array([[10], [20]], np.int32), drafts)
    assert appended.tolist() == [1, 1]
    return sched


def test_process_mtp_accepts_rolls_back_and_stores_drafts():
    sched = spec_setup()
    a, b = sched.get_sequences("a")[0], sched.get_sequences("b")[0]
    assert a.draft_token_ids.tolist() == [100, 101]
    out = sched.schedule()
    assert out.num_scheduled_tokens.tolist() == [3, 3]
    # Inputs of the speculative step against the reference.
    bufs = make_buffers(max_tokens=64, max_seqs=4, width=64)
    args = make_args(bufs, block_size=4, max_model_len=256, graph_batch_sizes=[4])
    pool = E.SequenceMetadataPool()
    pool.build(sched)
    rows = rows_from_scheduler(sched, out)
    n = E.prepare_decode_v4(args, pool)
    check_against_reference(args, bufs, rows, reference_layout(rows, block_size=4, width=64, graph_sizes=[4],
                                                               pad=True), n)
    si = E.prepare_sampler_inputs(args, pool, E.SamplerInputs())
    assert si.speculative.num_seqs == 2 and si.speculative.draft_token_ids.tolist() == [100, 101, 200, 201]
    # a: both drafts accepted + bonus 102; b: none accepted, recovered token 250.
    toks = np.array([[100, 101, 102], [250, 0, 0]], np.int32)
    got = E.process_MTPInfo(sched, np.array([2, 0], np.int32), toks, np.array([[103, 104], [251, 252]], np.int32))
    assert got.tolist() == [3, 1]
    a, b = sched.get_sequence(a.seq_id), sched.get_sequence(b.seq_id)
    assert a.token_ids.tolist() == [1, 2, 3, 4, 5, 10, 100, 101, 102]
    assert a.num_computed_tokens == 8
    assert b.token_ids.tolist() == [7, 8, 9, 20, 250]
    assert b.num_computed_tokens == 4
    assert b.draft_token_ids.tolist() == [251, 252]
    # b's block table covers its tokens + lookahead, no more (rejected slots rolled back).
    assert len(b.block_table.tolist()) == -(-(5 + 2) // 4)
    assert sched.check_invariants() == ""


def test_process_mtp_stops_inside_the_run():
    sched = spec_setup(eos=500)
    sched.schedule()
    toks = np.array([[100, 500, 7], [200, 201, 202]], np.int32)  # a: EOS accepted mid-run
    got = E.process_MTPInfo(sched, np.array([2, 2], np.int32), toks)
    assert got.tolist() == [2, 3]
    (a,) = sched.get_sequences("a")
    assert a.token_ids.tolist()[-2:] == [100, 500] and a.is_finished and a.finish_reason == "stop"
    assert sched.check_invariants() == ""


@pytest.mark.parametrize("bad, match", [
    (dict(num_accepted=np.array([3, 0], np.int32)), "num_accepted"),
    (dict(num_accepted=np.array([0, 0], np.int64)), "num_accepted"),
    (dict(output_tokens=np.array([[VOCAB, 0, 0], [1, 1, 1]], np.int32)), "output_tokens"),
    (dict(output_tokens=np.zeros((3, 3), np.int32)), "output_tokens"),
    (dict(next_drafts=np.array([[-1, 1], [1, 1]], np.int32)), "next_drafts"),
])
def test_process_mtp_bad_input_changes_nothing(bad, match):
    sched = spec_setup()
    sched.schedule()
    before = [(s.token_ids.tolist(), s.num_computed_tokens, s.draft_token_ids.tolist())
              for r in ("a", "b") for s in sched.get_sequences(r)]
    kw = dict(num_accepted=np.array([1, 1], np.int32), output_tokens=np.ones((2, 3), np.int32),
              next_drafts=np.ones((2, 2), np.int32))
    kw.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        E.process_MTPInfo(sched, **kw)
    after = [(s.token_ids.tolist(), s.num_computed_tokens, s.draft_token_ids.tolist())
             for r in ("a", "b") for s in sched.get_sequences(r)]
    assert before == after and sched.step_in_flight
