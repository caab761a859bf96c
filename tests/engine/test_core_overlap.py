"""Overlap scheduling (ZOS): Scheduler.schedule(overlap=True) runs step N+1 ahead of step N.

A simulated device runs a deterministic "model" (the next token is a function of the input
token and its position only), so every request has one right token stream whatever the
batching. The synchronous loop and the overlap loop (step N+1 scheduled and built with
prepare_decode_zos_inputs before step N's tokens reach the host, its input ids resolved from
step N's sampled tokens) must give the same final outputs under random workloads with EOS, stop
tokens, max_tokens, max_model_len, stop strings (stop_sequence), aborts, arrivals and preemption,
and keep every block accounted for.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import add_request
from deepinfer_engine import _engine as E
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inputs_helpers import make_args, make_buffers

VOCAB = 23
EOS = 1
STOP_PAIR = (3, 4)  # the "stop string": output tokens 3 then 4 (kept in the output)


def model_token(token: int, position: int) -> int:
    return (token * 7 + position * 5 + 2) % VOCAB


class Device:
    """Runs prepared steps: one sampled token per logits row, from the (resolved) input ids."""

    def __init__(self) -> None:
        self.bufs = [make_buffers(max_tokens=128, max_seqs=8, width=32, zos=True) for _ in range(2)]
        self.args = [make_args(b, block_size=4, max_model_len=48, graph_batch_sizes=[1, 2, 4, 8]) for b in self.bufs]
        self.pool = E.SequenceMetadataPool()
        self.sampler_inputs = E.SamplerInputs(0)
        self.side = 0

    def run(self, sched, out, prev=None):
        """Build and run the step just scheduled; prev = (args, tokens by logits row) of the step
        it runs ahead of (ZOS). Returns (args, tokens by logits row, tokens of the sample rows)."""
        self.side ^= 1
        args, b = self.args[self.side], self.bufs[self.side]
        self.pool.build(sched)
        if prev is not None:
            E.prepare_decode_zos_inputs(args, self.pool, prev[0])
        elif out.num_decodes == len(self.pool):
            E.prepare_decode_v4(args, self.pool)
        else:
            E.prepare_prompt_v4(args, self.pool)
        T = args.num_tokens
        ids = b["input_ids"][:T].copy()
        if prev is not None:
            src = b["zos_source_index"][:T]
            ids = np.where(src >= 0, prev[1][np.maximum(src, 0)], ids)
        rows = b["logits_indices"][:args.num_logits]
        sampled = np.array([model_token(int(ids[r]), int(b["positions"][r])) for r in rows], np.int32)
        si = E.prepare_sampler_inputs(args, self.pool, self.sampler_inputs)
        real = si.driver.num_real_rows
        assert real == out.num_sample_rows
        lrows = np.array(si.kernel.logits_rows[:real], np.int64)
        # The n samples of a completed n > 1 prompt share a logits row: the sample index tells them apart.
        tokens = ((sampled[lrows] + 3 * np.array(si.kernel.subsequences[:real])) % VOCAB).astype(np.int32)
        by_row = sampled.copy()
        by_row[lrows] = tokens  # (a step run ahead of follows plain decodes: one sample per row)
        return args, by_row, tokens


class Workload:
    """Requests arriving after given update counts, aborted at given output lengths."""

    def __init__(self, reqs):
        self.reqs = reqs  # list of dicts: id, prompt, params, arrive, abort_at

    def run(self, overlap: bool, num_blocks: int):
        sched = E.Scheduler(num_blocks=num_blocks, block_size=4, max_num_seqs=4, max_num_batched_tokens=12,
                            max_model_len=48, vocab_size=VOCAB, eos_token_id=EOS, watermark=0.0)
        dev = Device()
        pool = E.RequestOutputPool(64)
        pending = sorted(self.reqs, key=lambda r: r["arrive"])
        final: dict[str, tuple] = {}
        out_len: dict[str, int] = {}
        aborted: set[str] = set()
        updates = 0
        ahead_steps = 0
        inflight = None  # (args, sampled, sample logits rows) of the step awaiting update

        def arrivals():
            while pending and pending[0]["arrive"] <= updates:
                r = pending.pop(0)
                add_request(sched, r["id"], r["prompt"], **r["params"])

        def apply(step):
            nonlocal updates
            sched.update(step[2])
            updates += 1
            assert sched.check_invariants() == ""
            for ro in E.build_request_outputs(sched, pool):
                for c in list(ro.outputs):
                    toks = list(c.token_ids)
                    if c.index == 0:
                        out_len[ro.request_id] = len(toks)
                    if c.finish_reason is None:
                        for i in range(len(toks) - 1):
                            if (toks[i], toks[i + 1]) == STOP_PAIR:
                                seq = next(q for q in sched.get_sequences(ro.request_id) if q.sample_index == c.index)
                                sched.stop_sequence(seq.seq_id, "<34>", i + 2, output=ro)
                                break
                if ro.finished:
                    final[ro.request_id] = sorted((c.index, list(c.token_ids), c.finish_reason, c.stop_reason)
                                                  for c in ro.outputs)
            for r in self.reqs:
                rid = r["id"]
                if r["abort_at"] is not None and rid not in final and rid not in aborted \
                        and out_len.get(rid, -1) >= r["abort_at"]:
                    aborted.add(rid)
                    sched.abort_request(rid)
            arrivals()
            assert sched.check_invariants() == ""

        arrivals()
        for _ in range(2000):
            if inflight is None:
                if not sched.has_unfinished_requests() and not pending:
                    break
                out = sched.schedule()
                inflight = dev.run(sched, out)
            if overlap:
                ahead = sched.schedule(overlap=True)
                if ahead is not None:
                    assert sched.step_ahead and sched.check_invariants() == ""
                    nxt = dev.run(sched, ahead, prev=inflight)
                    ahead_steps += 1
                    apply(inflight)
                    inflight = nxt
                    continue
            apply(inflight)
            inflight = None
        else:
            raise AssertionError("the loop did not finish")
        # Outputs of aborts after the last update come with one more (empty) step.
        for _ in range(3):
            if not sched.has_unfinished_requests() and len(final) == len(self.reqs):
                break
            out = sched.schedule()
            apply(dev.run(sched, out))
        assert len(final) == len(self.reqs), f"requests without a final output: {set(out_len) - set(final)}"
        assert sched.block_manager.num_free_blocks == num_blocks
        return final, ahead_steps


def request_strategy(i):
    return st.fixed_dictionaries(dict(
        id=st.just(f"r{i}"),
        prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=14),
        params=st.fixed_dictionaries(dict(
            max_tokens=st.integers(1, 30), ignore_eos=st.booleans(), n=st.sampled_from([1, 1, 2]),
            stop_token_ids=st.lists(st.integers(2, VOCAB - 1), max_size=2), min_tokens=st.integers(0, 2),
        )).map(lambda p: {**p, "min_tokens": min(p["min_tokens"], p["max_tokens"])}),
        arrive=st.integers(0, 25),
        abort_at=st.one_of(st.none(), st.none(), st.integers(0, 12)),
    ))


workloads = st.integers(1, 7).flatmap(lambda n: st.tuples(*[request_strategy(i) for i in range(n)]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=workloads, num_blocks=st.sampled_from([14, 24, 64]))
def test_overlap_outputs_equal_synchronous(reqs, num_blocks):
    w = Workload(list(reqs))
    sync, _ = w.run(overlap=False, num_blocks=num_blocks)
    zos, _ = w.run(overlap=True, num_blocks=num_blocks)
    assert zos == sync


def test_overlap_runs_ahead_in_steady_decode():
    # (r1 is an n = 2 group: its fork's block copy keeps one step synchronous, then its samples run ahead.)
    reqs = [dict(id=f"r{i}", prompt=[5 + i, 6], params=dict(max_tokens=20, ignore_eos=True, n=1 + (i == 1)),
                 arrive=0, abort_at=None) for i in range(3)]
    w = Workload(reqs)
    sync, _ = w.run(overlap=False, num_blocks=64)
    zos, ahead = w.run(overlap=True, num_blocks=64)
    assert zos == sync and ahead >= 15  # (nearly) every decode step ran ahead
    assert len(zos["r1"]) == 2 and zos["r1"][0][1] != zos["r1"][1][1]


# ---- the contract, call by call ------------------------------------------------------------

def decode_scheduler(n=2, max_tokens=10, **kw):
    s = E.Scheduler(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=48,
                    vocab_size=VOCAB, eos_token_id=EOS, **kw)
    for i in range(n):
        s.add_request(f"r{i}", [5, 6, 7], E.SamplingParams(max_tokens=max_tokens))
    s.schedule()
    s.update(np.full(n, 9, np.int32))  # prefill: one token each
    s.schedule()  # step 2: plain decodes
    return s


def test_bad_calls_are_value_errors_naming_the_call():
    s = E.Scheduler(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=48,
                    vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"no step in flight.*call schedule\(\) first"):
        s.schedule(overlap=True)
    s = decode_scheduler()
    ahead = s.schedule(overlap=True)
    assert ahead is not None and ahead.step == 3 and s.step_ahead
    with pytest.raises(ValueError, match=r"step 3 already runs ahead of step 2.*update\(\) for step 2"):
        s.schedule(overlap=True)
    with pytest.raises(ValueError, match=r"schedule: step 2 is still waiting for update"):
        s.schedule()
    with pytest.raises(ValueError, match=r"update applies step 2.*2 sample rows; got 3 tokens"):
        s.update(np.full(3, 9, np.int32))
    with pytest.raises(ValueError, match=r"build_request_outputs: step 2 is waiting for update"):
        E.build_request_outputs(s, E.RequestOutputPool())
    with pytest.raises(ValueError, match=r"process_MTPInfo: step 3 runs ahead of step 2"):
        E.process_MTPInfo(s, np.zeros(2, np.int32), np.zeros((2, 1), np.int32))
    assert s.check_invariants() == "" and s.step_ahead  # nothing changed
    s.update(np.array([9, 1], np.int32))  # r1 ends with EOS at step 2
    assert not s.step_ahead and s.step_in_flight
    outs = {ro.request_id: ro for ro in E.build_request_outputs(s, E.RequestOutputPool())}
    assert outs["r1"].finished and outs["r1"].outputs[0].finish_reason == "stop"
    s.update(np.array([11, 12], np.int32))  # r1's step 3 row is ignored
    outs = {ro.request_id: list(ro.outputs[0].token_ids) for ro in E.build_request_outputs(s, E.RequestOutputPool())}
    assert outs == {"r0": [9, 9, 11]}
    assert s.check_invariants() == "" and not s.step_in_flight


def test_steps_that_cannot_run_ahead_return_none_and_change_nothing():
    s = E.Scheduler(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=48,
                    vocab_size=VOCAB)
    s.add_request("a", [5, 6, 7], E.SamplingParams(max_tokens=10))
    s.schedule()  # a prefill
    assert s.schedule(overlap=True) is None and not s.step_ahead
    s.update(np.array([9], np.int32))
    s.schedule()
    s.add_request("b", [5, 6], E.SamplingParams(max_tokens=10))  # waiting, with room to admit it
    assert s.schedule(overlap=True) is None and s.check_invariants() == ""
    s.update(np.array([9], np.int32))
    s.schedule()  # a decodes, b prefills
    assert s.schedule(overlap=True) is None


def test_sequences_that_surely_finish_are_left_out():
    s = decode_scheduler(n=2)
    s.abort_request("r0")
    s2 = decode_scheduler(n=1, max_tokens=2)  # its step 2 token is its last
    assert s2.schedule(overlap=True) is None  # nothing would run ahead
    ahead = s.schedule(overlap=True)
    assert ahead.seq_ids.tolist() == [1] and ahead.num_computed_tokens.tolist() == [4]


def test_out_of_blocks_goes_synchronous():
    # 3-token prompts + 1 token fill a 4-token block: step 3 needs a new block for each sequence.
    s = E.Scheduler(num_blocks=3, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=12,
                    vocab_size=VOCAB, watermark=0.0)
    for i in range(2):
        s.add_request(f"r{i}", [5, 6, 7], E.SamplingParams(max_tokens=10))
    s.schedule()
    s.update(np.full(2, 9, np.int32))
    s.schedule()  # step 2 writes position 3: the last slot of each first block
    assert s.block_manager.num_free_blocks == 1
    assert s.schedule(overlap=True) is None and s.check_invariants() == ""


def test_finished_request_is_released_only_after_the_step_that_names_it():
    # r1 finishes at step 2 while step 3 (which names it) runs ahead; step 4 is scheduled ahead
    # of step 3: r1's sequence must not be released (its slot reused) before step 3's update.
    s = decode_scheduler(n=2)
    s.schedule(overlap=True)
    s.update(np.array([9, 1], np.int32))  # r1: EOS
    E.build_request_outputs(s, E.RequestOutputPool())
    assert s.schedule(overlap=True) is not None  # step 4 ahead of step 3
    s.add_request("r1", [8], E.SamplingParams(max_tokens=3))  # the id is free again (its final output was built)
    s.update(np.array([11, 12], np.int32))  # step 3: r1's row is ignored
    new = s.get_sequences("r1")[0]
    assert new.token_ids.tolist() == [8] and s.check_invariants() == ""
    s.update(np.array([13], np.int32))  # step 4: r0 only
    assert s.get_sequences("r0")[0].token_ids.tolist() == [5, 6, 7, 9, 9, 11, 13]


@pytest.mark.parametrize("action", ["recompute", "fail"])
def test_abandon_step_with_a_step_ahead_abandons_both(action):
    s = decode_scheduler(n=2)
    s.schedule(overlap=True)
    s.update(np.array([9, 9], np.int32))
    E.build_request_outputs(s, E.RequestOutputPool())
    s.schedule(overlap=True)  # step 4 ahead of step 3
    ids = s.abandon_step(action)
    assert ids == ["r0", "r1"] and not s.step_in_flight and not s.step_ahead
    assert s.check_invariants() == ""
    if action == "fail":
        outs = E.build_request_outputs(s, E.RequestOutputPool())
        assert sorted((ro.request_id, ro.outputs[0].finish_reason) for ro in outs if ro.finished) == [
            ("r0", "error"), ("r1", "error")]
        assert s.block_manager.num_free_blocks == 32
    else:
        for seq in (s.get_sequences("r0")[0], s.get_sequences("r1")[0]):
            assert seq.token_ids.tolist() == [5, 6, 7, 9, 9] and seq.num_computed_tokens == 0
        out = s.schedule()  # recompute: both prompts + outputs again
        assert out.is_prefill.tolist() == [True, True]
