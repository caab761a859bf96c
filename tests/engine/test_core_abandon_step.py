"""Scheduler.abandon_step: recovery from a failed step.

A fake device drives the scheduler: a KV cache and recurrent-state slots kept here, to which each
step applies the scheduler's blocks_to_copy / states_to_clone / states_to_zero and then writes
the KV and state of the tokens it computes. Before every forward it asserts that the KV (and the
state) every scheduled sequence reads is exactly its own tokens, so a block served from the
prefix cache that the failed step was to write, or a stale copy / clone / zero, is caught where
it happens. The "model" samples token = f(sequence tokens, sample index), so a run that abandons
a step (at every stage: prefill chunk, decode, mixed, after an n > 1 fork, with prefix hits, with
MTP drafts, with ZOS inputs prepared) must give the same tokens as a fresh scheduler, and every
block must be free at the end. A failed step writes garbage into the slots it was to write.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import add_request
from deepinfer_engine import _engine as E

VOCAB = 100
EOS = 1
ST = E.SequenceStatus


def model_token(tokens: list[int], sample_index: int) -> int:
    h = 0
    for t in tokens:
        h = (h * 131 + t + 1) % 1_000_003
    return 2 + (h + 17 * sample_index) % (VOCAB - 2)  # never EOS: lengths are fixed


class FakeDevice:
    """KV blocks and state slots holding the token ids written at each position (-1: never)."""

    def __init__(self, sched: E.Scheduler, num_blocks: int, block_size: int, num_state_slots: int):
        self.sched, self.bs = sched, block_size
        self.kv = np.full((num_blocks, block_size), -1, np.int64)
        self.state: dict[int, list[int]] = {s: [] for s in range(num_state_slots)}

    def apply_device_work(self, out) -> None:
        copies = out.blocks_to_copy.tolist()
        dsts = [d for _, d in copies]
        assert len(dsts) == len(set(dsts)), f"a block is a copy destination twice: {copies}"
        src = self.kv[[s for s, _ in copies]].copy() if copies else None  # all copies read first
        for i, (_, d) in enumerate(copies):
            self.kv[d] = src[i]
        clones = out.states_to_clone.tolist()
        zeros = out.states_to_zero.tolist()
        targets = [d for _, d in clones] + zeros
        assert len(targets) == len(set(targets)), f"a slot written twice: {clones} {zeros}"
        snap = {s: list(self.state[s]) for s, _ in clones}
        for s, d in clones:
            self.state[d] = snap[s]
        for z in zeros:
            self.state[z] = []

    def check_reads(self, out) -> None:
        """Every scheduled sequence's KV [0, start) and state are its own tokens."""
        for sid, c in zip(out.seq_ids.tolist(), out.num_computed_tokens.tolist()):
            seq = self.sched.get_sequence(sid)
            toks, table = seq.token_ids.tolist(), seq.block_table.tolist()
            got = [int(self.kv[table[p // self.bs], p % self.bs]) for p in range(c)]
            assert got == toks[:c], f"sequence {sid} reads wrong KV: {got} != {toks[:c]}"
            if seq.state_slot >= 0:
                assert self.state[seq.state_slot] == toks[:c], f"sequence {sid} reads a wrong state"

    def write(self, out, garbage: bool = False) -> None:
        for sid, n, c in zip(out.seq_ids.tolist(), out.num_scheduled_tokens.tolist(),
                             out.num_computed_tokens.tolist()):
            seq = self.sched.get_sequence(sid)
            if seq.is_finished:
                continue
            toks = seq.token_ids.tolist() + seq.draft_token_ids.tolist()
            table = seq.block_table.tolist()
            for p in range(c, c + n):
                self.kv[table[p // self.bs], p % self.bs] = toks[p] + (1000 if garbage else 0)
            if seq.state_slot >= 0:
                self.state[seq.state_slot] = toks[:c + n] if not garbage else [-5]


CFG = dict(num_blocks=40, block_size=4, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=48,
           vocab_size=VOCAB, eos_token_id=EOS, watermark=0.0)


class Driver:
    def __init__(self, requests, mtp=False, state_slots=0, **overrides):
        self.cfg = {**CFG, **overrides}
        if state_slots:  # a recurrent state cannot start at a prefix hit: hybrid models run uncached
            self.cfg.update(num_state_slots=state_slots, enable_prefix_caching=False)
        self.sched = E.Scheduler(**self.cfg)
        self.dev = FakeDevice(self.sched, self.cfg["num_blocks"], self.cfg["block_size"], state_slots)
        self.mtp = mtp
        self.pool = E.RequestOutputPool()
        self.results: dict[str, dict[int, tuple[list[int], str]]] = {}
        self.pending = list(requests)  # (step to add at, request id, prompt, params)
        self.step_no = 0

    def add_due(self):
        for r in [r for r in self.pending if r[0] <= self.step_no]:
            add_request(self.sched, r[1], r[2], **r[3])
            self.pending.remove(r)

    def schedule(self):
        self.add_due()
        self.step_no += 1
        out = self.sched.schedule()
        self.dev.apply_device_work(out)
        self.dev.check_reads(out)
        return out

    def finish_step(self, out):
        self.dev.write(out)
        rows = []   # (seq tokens before the step's samples, sample index) per sample row
        for sid, k in zip(out.seq_ids.tolist(), out.num_samples.tolist()):
            toks = self.sched.get_sequence(sid).token_ids.tolist()
            base = self.sched.get_sequence(sid).sample_index
            rows += [(toks, base if k == 1 else j) for j in range(k)]
        if not self.mtp:
            self.sched.update(np.array([model_token(t, j) for t, j in rows], np.int32))
        else:
            self._mtp_update(out, rows)
        assert self.sched.check_invariants() == ""
        self.collect()

    def _mtp_update(self, out, rows):
        """Verify each row's drafts against the model (greedy acceptance) and draft 2 tokens."""
        drafts_of = []
        for sid, k, pre in zip(out.seq_ids.tolist(), out.num_samples.tolist(), out.is_prefill.tolist()):
            d = [] if pre else self.sched.get_sequence(sid).draft_token_ids.tolist()
            drafts_of += [d] * k
        acc, outs, nxt = [], [], []
        for (toks, j), d in zip(rows, drafts_of):
            seq, produced = list(toks), []
            for i in range(len(d) + 1):
                t = model_token(seq, j)
                produced.append(t)
                if i == len(d) or d[i] != t:
                    break
                seq.append(t)
            acc.append(len(produced) - 1)
            outs.append(produced + [0] * (3 - len(produced)))
            t1 = model_token(seq + [produced[-1]], j)
            nxt.append([t1, (t1 + 3) % VOCAB if len(nxt) % 2 else model_token(seq + [produced[-1], t1], j)])
        R = len(rows)
        E.process_MTPInfo(self.sched, np.array(acc, np.int32), np.array(outs, np.int32).reshape(R, 3),
                          np.array(nxt, np.int32).reshape(R, 2))

    def collect(self):
        for ro in E.build_request_outputs(self.sched, self.pool):
            if ro.finished:
                self.results[ro.request_id] = {c.index: (list(c.token_ids), c.finish_reason) for c in ro.outputs}

    def run(self, abandon_at=None, action="recompute", prepare=None):
        abandoned = None
        while self.pending or self.sched.has_unfinished_requests():
            out = self.schedule()
            if self.step_no == abandon_at:
                if prepare:
                    prepare(self.sched)
                self.dev.write(out, garbage=True)   # the failed forward wrote part of its KV
                decode_lens = out.num_scheduled_tokens[: out.num_decodes]
                abandoned = dict(seq_ids=out.seq_ids.tolist(), decodes=out.num_decodes, n=len(out),
                                 draft_rows=int((decode_lens > 1).sum()),
                                 copies=out.blocks_to_copy.tolist(), zeros=out.states_to_zero.tolist(),
                                 clones=out.states_to_clone.tolist(),
                                 request_ids=sorted(set(out.request_ids)))
                ids = self.sched.abandon_step(action)
                assert not self.sched.step_in_flight
                assert self.sched.check_invariants() == ""
                abandoned["returned"] = ids
                self.collect()
                continue
            self.finish_step(out)
            assert self.step_no < 500
        bm = self.sched.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        assert self.sched.check_invariants() == ""
        return self.results, abandoned


def reference_run(requests, **kw):
    results, _ = Driver(requests, **kw).run()
    return results


PROMPT_A = [5 + i for i in range(13)]
PROMPT_B = PROMPT_A[:9] + [70, 71, 72, 73, 74]


def workload(n=1):
    p = dict(max_tokens=6, ignore_eos=True)
    return [(0, "a", PROMPT_A, {**p, "n": n}), (0, "b", PROMPT_B, p), (3, "c", PROMPT_A[:11] + [90], p),
            (5, "d", [40, 41, 42], {**p, "n": n})]


STAGES = {
    # step -> what it holds in this workload (checked in the test)
    "prefill chunk": 1,
    "prefill completion": 2,
    "decode": 3,
    "mixed": 4,
    "late decode": 8,
}


@pytest.mark.parametrize("stage", sorted(STAGES))
@pytest.mark.parametrize("mtp", [False, True], ids=["update", "mtp"])
def test_recompute_gives_the_fresh_tokens(stage, mtp):
    reqs = workload()
    want = reference_run(reqs, mtp=mtp)
    got, ab = Driver(reqs, mtp=mtp).run(abandon_at=STAGES[stage])
    assert got == want
    assert ab["returned"] and ab["returned"] == sorted(ab["returned"])
    assert set(ab["returned"]) >= set(ab["request_ids"])
    if stage == "mixed":
        assert 0 < ab["decodes"] < ab["n"]
    if stage == "prefill chunk":
        assert ab["decodes"] == 0


@pytest.mark.parametrize("action", ["recompute", "fail"])
def test_abandon_a_step_with_mtp_drafts(action):
    """Decodes verifying drafts: the abandoned drafts are dropped, the tokens stay the model's."""
    reqs = workload()
    want = reference_run(reqs, mtp=True)
    with_drafts = 0
    for at in range(3, 9):
        got, ab = Driver(reqs, mtp=True).run(abandon_at=at, action=action)
        with_drafts += ab["draft_rows"] > 0
        for rid in want:
            if action == "recompute" or rid not in ab["returned"]:
                assert got[rid] == want[rid], (at, rid)
    assert with_drafts, "no abandoned step verified drafts"


@pytest.mark.parametrize("state_slots", [0, 8])
def test_recompute_after_an_n_gt_1_fork(state_slots):
    """The step after an n > 1 prompt's fork applies the copies of the children's partial blocks
    (and state clones): once abandoned they must not reach a later step, the children recompute."""
    reqs = workload(n=3)
    want = reference_run(reqs, state_slots=state_slots)
    with_copies = with_clones = 0
    for at in range(1, 8):
        got, ab = Driver(reqs, state_slots=state_slots).run(abandon_at=at)
        assert got == want, at
        with_copies += bool(ab["copies"])
        with_clones += bool(ab["clones"])
    assert all(len(v) == 3 for k, v in want.items() if k in ("a", "d"))
    assert with_copies, "no abandoned step carried a fork's block copies"
    assert with_clones or not state_slots


def test_recompute_with_prefix_hits_never_serves_the_failed_blocks():
    """b shares a's first two blocks. a's first step fails after writing garbage: none of the
    blocks it was to write may be served to b (check_reads asserts the KV b reads)."""
    p = dict(max_tokens=4, ignore_eos=True)
    reqs = [(0, "a", PROMPT_A, p), (2, "b", PROMPT_B, p), (2, "c", PROMPT_A, p)]
    want = reference_run(reqs, max_num_batched_tokens=64)
    for at in (1, 2, 3):
        drv = Driver(reqs, max_num_batched_tokens=64)
        got, _ = drv.run(abandon_at=at)
        assert got == want
        assert drv.sched.get_stats()["prefix_cache_hits"] > 0


@pytest.mark.parametrize("state_slots", [0, 8])
def test_fail_finishes_the_step_requests_with_error(state_slots):
    reqs = workload(n=2)
    want = reference_run(reqs, state_slots=state_slots)
    drv = Driver(reqs, state_slots=state_slots)
    got, ab = drv.run(abandon_at=4, action="fail")
    failed = ab["returned"]
    assert failed == ab["request_ids"] and failed
    for rid in want:
        if rid in failed:
            assert {c[1] for c in got[rid].values()} == {"error"}
        else:
            assert got[rid] == want[rid]


def test_fail_reports_error_through_every_output_path():
    s = E.Scheduler(**CFG)
    s.add_request("x", PROMPT_A, E.SamplingParams(n=2, max_tokens=5, ignore_eos=True))
    s.add_request("y", [3, 4, 5], E.SamplingParams(max_tokens=5, ignore_eos=True))
    pool = E.RequestOutputPool()
    for _ in range(2):
        out = s.schedule()
        s.update(np.full(out.num_sample_rows, 9, np.int32))
        E.build_request_outputs(s, pool)
    s.schedule()
    assert s.abandon_step(action="fail") == ["x", "y"]
    info = E.get_finished_seqs_info(s)
    assert sorted(info["request_ids"]) == ["x", "x", "y"]
    assert set(info["statuses"].tolist()) == {int(ST.FINISHED_ERROR)}
    outs = {ro.request_id: ro for ro in E.build_request_outputs(s, pool)}
    assert set(outs) == {"x", "y"} and all(ro.finished for ro in outs.values())
    assert [c.finish_reason for c in outs["x"].outputs] == ["error", "error"]
    assert outs["y"].outputs[0].token_ids == [9, 9]   # two steps ran; the third failed
    assert s.get_sequence(int(info["seq_ids"][0])).finish_reason == "error"
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks
    assert not s.has_unfinished_requests()
    assert s.schedule().is_empty


def test_no_step_in_flight_changes_nothing():
    s = E.Scheduler(**CFG)
    assert s.abandon_step() == []
    s.add_request("x", PROMPT_A, E.SamplingParams(max_tokens=3))
    assert s.abandon_step("fail") == []
    out = s.schedule()
    s.update(np.full(out.num_sample_rows, 9, np.int32))
    before = (s.num_running, s.num_waiting, s.block_manager.num_free_blocks)
    assert s.abandon_step() == [] and s.abandon_step("fail") == []
    assert (s.num_running, s.num_waiting, s.block_manager.num_free_blocks) == before
    with pytest.raises(ValueError, match="update: no scheduled step"):
        s.update(np.zeros(0, np.int32))


@pytest.mark.parametrize("bad", ["", "abort", "RECOMPUTE"])
def test_bad_action_is_refused_naming_it(bad):
    s = E.Scheduler(**CFG)
    s.add_request("x", PROMPT_A, E.SamplingParams(max_tokens=3))
    s.schedule()
    with pytest.raises(ValueError, match="action"):
        s.abandon_step(bad)
    assert s.step_in_flight   # nothing happened
    with pytest.raises(TypeError):
        s.abandon_step(1)


def test_abort_during_the_step_then_abandon():
    """A request aborted while the step ran has finished: it is not listed, the others recompute."""
    s = E.Scheduler(**CFG)
    s.add_request("x", PROMPT_A, E.SamplingParams(max_tokens=3))
    s.add_request("y", PROMPT_B, E.SamplingParams(max_tokens=3))
    s.schedule()
    s.abort_request("x")
    assert s.abandon_step() == ["y"]
    assert s.get_sequences("y")[0].status == ST.PREEMPTED
    assert s.check_invariants() == ""


def test_abandon_after_inputs_and_zos_were_prepared():
    """Inputs, sampler inputs and the ZOS inputs of the next step built before the failure hold no
    scheduler state: after abandon_step the next steps are built from scratch and match a fresh run."""
    from inputs_helpers import make_args, make_buffers
    from inputs_reference.layout import RefRow

    def prepare(sched):
        pool = E.SequenceMetadataPool()
        pool.build(sched)
        bs, mml = CFG["block_size"], CFG["max_model_len"]
        args = make_args(make_buffers(zos=True), block_size=bs, max_model_len=mml)
        E.prepare_prompt_v4(args, pool)
        E.prepare_sampler_inputs(args, pool, E.SamplerInputs())
        zargs = make_args(make_buffers(zos=True), block_size=bs, max_model_len=mml)
        zpool = E.SequenceMetadataPool()
        out_ids = args.row_seq_ids.tolist()[: args.num_seqs]
        for sid in out_ids:
            seq = sched.get_sequence(sid)
            if seq.num_computed_tokens < seq.num_tokens - 1:
                continue
            toks = seq.token_ids.tolist()
            RefRow(seq_id=sid, request_id=seq.request_id, tokens=toks, num_prompt=seq.num_prompt_tokens,
                   start=len(toks) - 1, num_new=1, is_prompt=False,
                   block_table=seq.block_table.tolist() + [39]).add_to(zpool)
        E.prepare_zos_inputs(zargs, zpool, args)
        prepared.append(len(zpool))

    prepared = []
    reqs = workload()
    want = reference_run(reqs)
    got, _ = Driver(reqs).run(abandon_at=4, prepare=prepare)
    assert got == want
    assert prepared and prepared[0] > 0
