"""Stateful property test of the engine: hypothesis drives a real Scheduler (and the input builders
around it) through random interleavings of requests, steps, sampled tokens (EOS and stop tokens
included), speculative results, forks, aborts, stop strings, prefix-cache resets and memory
pressure, and after every step checks the engine against

- the pure-Python reference scheduler/block manager (tests/engine/reference): the same steps, the
  same preemptions, finishes, free and cached block counts — exact, as long as the example uses only
  what the reference models (speculative drafts switch the exact comparison off for the rest of
  the example; everything below still holds);
- its own invariants, recomputed here from what Python sees: a block's ref count equals the number
  of live block tables holding it, free + used = total, no running sequence without slots for its
  computed and scheduled tokens, a finished sequence holds no block;
- the input-layout reference (tests/engine/inputs_reference): prepare_prompt_v4 / prepare_decode_v4
  / prepare_zos_inputs on the scheduler's real steps give exactly the reference layout;
- a shadow of every request's tokens kept here (stop rules applied independently): the outputs a
  caller assembles from build_request_outputs (cumulative / delta / final-only) are complete, in
  order and carry the right finish reason for every request that was not aborted.

Examples: DEEPINFER_STATE_MACHINE_EXAMPLES (default 25), steps per example:
DEEPINFER_STATE_MACHINE_STEPS (default 60). The number of engine calls made is added to the file
named by DEEPINFER_STATE_MACHINE_OPS_FILE (one line per test run) when set.
"""

from __future__ import annotations

import os
import random
from collections import Counter

import numpy as np
import pytest
from deepinfer_engine import _engine as E
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from inputs_reference.layout import RefRow, reference_layout
from penalty_consumer import PenaltyTables, direct_counts
from reference import RefScheduler
from reference.scheduler import STOPPED

VOCAB = 40
EOS = 1
STOP_IDS = [2, 3]
EXAMPLES = int(os.environ.get("DEEPINFER_STATE_MACHINE_EXAMPLES", "25"))
STEPS = int(os.environ.get("DEEPINFER_STATE_MACHINE_STEPS", "100"))
OPS_FILE = os.environ.get("DEEPINFER_STATE_MACHINE_OPS_FILE")
ST = E.SequenceStatus
FINISH_REASON = {int(ST.FINISHED_STOPPED): "stop", int(ST.FINISHED_LENGTH): "length",
                 int(ST.FINISHED_ABORTED): "abort", int(ST.FINISHED_IGNORED): "ignored",
                 int(ST.FINISHED_ERROR): "error"}
OPS = Counter()
EVENTS = Counter()    # which paths the examples reached (checked by test_machine_reaches_every_path)


class ForkingRef(RefScheduler):
    """The reference plus the calls it does not model itself, written with its own helpers:
    an explicit fork (clone_and_zero_states_and_blocks) and a stop string (stop_sequence)."""

    def fork(self, seq_id: int, k: int) -> list[int]:
        s = self._by_id(seq_id)
        s.group.forked = True     # the engine's rule: from now on every sequence of the group costs one unit
        children = []
        for _ in range(k):
            c = self._new_seq(s.group, s.tokens, s.num_prompt, len(s.group.seqs))
            c.status = s.status
            c.num_computed = s.num_computed
            c.num_cached = s.num_cached
            c.registered = min(s.registered, s.num_computed // self.bs)
            c.table = self.bm.fork_table(s.table, s.num_computed)
            self._insert(self.running, c)
            children.append(c.seq_id)
        return children

    def stop_string(self, seq_id: int, keep: int) -> None:
        """Called between update and schedule; reported with the step just updated."""
        s = self._by_id(seq_id)
        del s.tokens[s.num_prompt + keep:]
        for lst in (self.running, self.waiting, self.preempted):
            if s in lst:
                lst.remove(s)
        self.finished = [f for f in self.finished if f[0] != seq_id]
        s.status = STOPPED
        self.bm.free_table(s.table)
        self.finished.append((seq_id, STOPPED))

    def _by_id(self, seq_id: int):
        return next(s for g in self.groups.values() for s in g.seqs if s.seq_id == seq_id)


def _configs():
    @st.composite
    def draw(d):
        block_size = d(st.sampled_from([1, 2, 3, 4, 8]))
        max_model_len = d(st.integers(12, 48))
        lookahead = d(st.sampled_from([0, 0, 1, 3]))
        min_blocks = -(-(max_model_len + lookahead) // block_size)
        chunked = d(st.booleans())
        watermark = d(st.sampled_from([0.0, 0.0, 0.05]))
        num_blocks = min_blocks + d(st.integers(0, 24))      # small: preemption is common
        if watermark:
            num_blocks += int(num_blocks * 0.06) + 2            # room for the watermark's blocks
        return dict(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=d(st.integers(2, 8)),
            max_num_batched_tokens=d(st.integers(max_model_len if not chunked else 4, 64)),
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
            long_prefill_token_threshold=d(st.sampled_from([0, 0, 3, 7])),
            policy=d(st.sampled_from(["fcfs", "priority"])),
            enable_prefix_caching=d(st.booleans()),
            watermark=watermark,
            num_lookahead_slots=lookahead,
        )
    return draw()


def _table_for(table: list[int], positions: int, block_size: int, fake_base: int) -> list[int]:
    """A block table long enough for `positions` slots (ids past the real blocks where the
    scheduler has not allocated them yet: the builders only compute with them)."""
    need = -(-positions // block_size)
    return list(table) + [fake_base + i for i in range(max(0, need - len(table)))]


class EngineMachine(RuleBasedStateMachine):
    # ------------------------------------------------------------------ setup
    @initialize(cfg=_configs(), seed=st.integers(0, 2**32 - 1))
    def setup(self, cfg, seed):
        self.cfg = cfg
        self.rng = random.Random(seed)
        self.sched = E.Scheduler(**cfg, vocab_size=VOCAB, eos_token_id=EOS)
        self.ref = ForkingRef(**cfg, eos_token_id=EOS)
        self.exact = True                 # the reference still models everything that happened
        self.pool = E.SequenceMetadataPool()
        self.out_pool = E.RequestOutputPool(max_size=8)
        T, S, W = 256, 16, 64
        self.bufs = self._buffers(T, S, W)
        self.args = E.PrepareArgs(block_size=cfg["block_size"], max_model_len=cfg["max_model_len"],
                                  graph_batch_sizes=[1, 2, 4, 8, 16], **self.bufs)
        self.zbufs = self._buffers(T, S, W)
        self.zargs = E.PrepareArgs(block_size=cfg["block_size"], max_model_len=cfg["max_model_len"], **self.zbufs)
        self.sampler_inputs = E.SamplerInputs(generator_seed=seed & 0xFFFF)
        self.penalty_tables = PenaltyTables()  # the consumer of its incremental penalty counts
        self.prefixes = [[self.rng.randrange(4, VOCAB) for _ in range(self.rng.randrange(3, 30))] for _ in range(3)]
        self.next_rid = 0
        self.params: dict[str, dict] = {}        # request id -> add_request keywords
        self.shadow: dict[int, list[int]] = {}   # seq id -> expected output tokens
        self.seq_req: dict[int, str] = {}        # seq id -> request id
        self.nprompt: dict[int, int] = {}
        self.done: dict[int, str] = {}           # seq id -> expected finish reason
        self.aborted: set[str] = set()
        self.received: dict[str, dict[int, list[int]]] = {}   # what a caller assembled from outputs
        self.final_seen: set[str] = set()
        self.truncated: set[int] = set()         # seq ids finished by a stop string
        self.explicit_children: set[int] = set()  # seq ids made by clone_and_zero_states_and_blocks
        self.inherited: dict[int, list[int]] = {}  # their output tokens at the fork
        self.in_flight = False
        self.prepared = False
        self.zos = None                         # (rows of step N+1, their logits rows of step N)
        self.released: set[int] = set()          # seq ids whose requests were released
        self.finished_since_schedule: list[int] = []

    @staticmethod
    def _buffers(T, S, W):
        return dict(input_ids=np.zeros(T, np.int32), positions=np.zeros(T, np.int32),
                    slot_mapping=np.zeros(T, np.int64), query_start_loc=np.zeros(S + 1, np.int32),
                    seq_lens=np.zeros(S, np.int32), block_tables=np.zeros((S, W), np.int32),
                    logits_indices=np.zeros(T, np.int32), zos_source_index=np.zeros(T, np.int32))

    def teardown(self):
        if hasattr(self, "sched"):
            EVENTS["prefix hits"] += self.sched.get_stats()["prefix_cache_hits"] > 0
            EVENTS["exact examples"] += self.exact
        if OPS_FILE and OPS["total"]:
            with open(OPS_FILE, "a") as f:
                f.write(f"{OPS['total']}\n")
            OPS.clear()

    def _op(self, n=1):
        OPS["total"] += n

    # ------------------------------------------------------------------ helpers
    def _live_seq_ids(self):
        """Seq ids whose handles still answer; a handle may only go away once its sequence finished."""
        live = []
        for sid in self.shadow:
            if sid in self.released:
                continue
            try:
                self.sched.get_sequence(sid)
            except ValueError:
                assert sid in self.done, f"unfinished sequence {sid} was released"
                self.released.add(sid)
                continue
            live.append(sid)
        return live

    def _status(self, sid):
        return int(self.sched.get_sequence(sid).status)

    def _expect_append(self, sid, tok) -> bool:
        """The stop rules, applied independently: returns True when the sequence finishes."""
        p = self.params[self.seq_req[sid]]
        out = self.shadow[sid]
        out.append(tok)
        n = len(out)
        if n >= p.get("min_tokens", 0):
            if not p.get("ignore_eos") and tok == EOS:
                EVENTS["eos"] += 1
                self.done[sid] = "stop"
                return True
            if tok in (p.get("stop_token_ids") or ()):
                EVENTS["stop token"] += 1
                self.done[sid] = "stop"
                return True
        if n >= p["max_tokens"] or self.nprompt[sid] + n >= self.cfg["max_model_len"]:
            self.done[sid] = "length"
            return True
        return False

    def _register_children(self, rid):
        """Children forked by update() from the request's parent (its first sequence)."""
        parent = self.sched.get_sequences(rid)[0].seq_id
        for s in self.sched.get_sequences(rid):
            if s.seq_id not in self.shadow:
                self.shadow[s.seq_id] = list(self.shadow[parent])
                self.seq_req[s.seq_id] = rid
                self.nprompt[s.seq_id] = self.nprompt[parent]

    def _collect_outputs(self):
        outs = E.build_request_outputs(self.sched, self.out_pool)
        self._op()
        for ro in outs:
            rid = ro.request_id
            kind = self.params[rid]["output_kind"]
            got = self.received.setdefault(rid, {})
            assert rid not in self.final_seen or ro.finished, f"{rid}: output after its final output"
            for c in ro.outputs:
                toks = list(c.token_ids)
                prev = got.get(c.index, [])
                if kind == "delta":
                    got[c.index] = prev + toks
                else:
                    # cumulative (and final-only) outputs only ever extend what was seen before,
                    # except after a stop string truncated them
                    got[c.index] = toks
            if kind == "final_only":
                assert ro.finished, f"{rid}: final_only output before the request finished"
            if ro.finished:
                self.final_seen.add(rid)
                if rid not in self.aborted:
                    self._check_complete(rid, ro)

    def _check_complete(self, rid, ro):
        seqs = sorted((s for s in self.shadow if self.seq_req[s] == rid), key=lambda s: s)
        by_index = {c.index: c for c in ro.outputs}
        got = self.received[rid]
        for i, sid in enumerate(seqs):
            if self.done.get(sid) == "ignored":
                continue
            mine = got.get(i, [])
            delta = self.params[rid]["output_kind"] == "delta"
            candidates = [mine]     # a forked child's deltas include its inherited tokens (B4 fixed)
            if delta and sid in self.truncated:
                # tokens already streamed cannot be taken back: the detokenizer cuts the text
                candidates = [c[: len(self.shadow[sid])] for c in candidates]
            assert self.shadow[sid] in candidates, (rid, i, got.get(i), self.shadow[sid], self.params[rid],
                                                    sid in self.explicit_children)
            if i in by_index:
                assert by_index[i].finish_reason == self.done[sid], (rid, i, by_index[i].finish_reason, self.done[sid])

    # ------------------------------------------------------------------ rules
    @rule(count=st.integers(1, 3), data=st.data())
    def add_requests(self, count, data):
        for _ in range(count):
            rng = self.rng
            prompt = list(rng.choice(self.prefixes))[: rng.randrange(1, 31)] if rng.random() < 0.6 else []
            prompt += [rng.randrange(4, VOCAB) for _ in range(rng.randrange(0 if prompt else 1, 20))]
            if rng.random() < 0.04:
                prompt += [5] * (self.cfg["max_model_len"] + 1 - len(prompt))     # too long: ignored
            max_tokens = rng.randrange(1, 14)
            params = dict(max_tokens=max_tokens, min_tokens=rng.choice([0, 0, min(2, max_tokens)]),
                          n=rng.choice([1, 1, 1, 2, 3]) if self.cfg["max_num_seqs"] >= 3 else 1,
                          priority=rng.randrange(3), ignore_eos=rng.random() < 0.2,
                          stop_token_ids=rng.choice([None, None, STOP_IDS]),
                          temperature=rng.choice([0.0, 0.7, 1.0]), top_k=rng.choice([-1, 5]),
                          top_p=rng.choice([1.0, 0.9]), seed=rng.choice([None, rng.randrange(1000)]),
                          presence_penalty=rng.choice([0.0, 0.0, 0.5]),
                          output_kind=rng.choice(["cumulative", "delta", "final_only"]))
            rid = f"r{self.next_rid}"
            self.next_rid += 1
            sid = self.sched.add_request(
                rid, prompt, E.SamplingParams(**{k: v for k, v in params.items() if k not in ("priority", "output_kind")}),
                priority=params["priority"], output_kind=params["output_kind"])
            self._op()
            ref_params = {k: params[k] for k in ("max_tokens", "min_tokens", "n", "priority", "ignore_eos",
                                                 "stop_token_ids")}
            if self.exact:
                assert sid == self.ref.add_request(rid, prompt, **ref_params)
            self.params[rid] = params
            self.shadow[sid] = []
            self.seq_req[sid] = rid
            self.nprompt[sid] = len(prompt)
            if len(prompt) > self.cfg["max_model_len"]:
                self.done[sid] = "ignored"

    @precondition(lambda self: not self.in_flight)
    @rule()
    def schedule(self):
        out = self.sched.schedule()
        self._op()
        self.in_flight = True
        self.prepared = False
        self.zos = None
        # requests finished in the previous step are released now
        for sid in self.finished_since_schedule:
            self.released.add(sid)
        self.finished_since_schedule = []
        if self.exact:
            r_out = self.ref.schedule()
            got = list(zip(out.seq_ids.tolist(), out.num_scheduled_tokens.tolist(),
                           out.num_computed_tokens.tolist(), out.num_samples.tolist(), out.is_prefill.tolist()))
            assert got == r_out["scheduled"]
            assert out.preempted_seq_ids.tolist() == r_out["preempted"]
            assert out.ignored_seq_ids.tolist() == r_out["ignored"]
        assert out.num_sample_rows == int(out.num_samples.sum())
        EVENTS["preemption"] += len(out.preempted_seq_ids)
        EVENTS["ignored"] += len(out.ignored_seq_ids)
        EVENTS["n>1 prompt"] += int((out.num_samples > 1).sum())
        EVENTS["mixed step"] += bool(0 < out.num_decodes < len(out))
        self.out = dict(seq_ids=out.seq_ids.tolist(), n=out.num_scheduled_tokens.tolist(),
                        computed=out.num_computed_tokens.tolist(), samples=out.num_samples.tolist(),
                        prefill=out.is_prefill.tolist(), rows=out.num_sample_rows, decodes=out.num_decodes)
        # every scheduled sequence has slots for what it computes this step
        bs = self.cfg["block_size"]
        for sid, n, c in zip(self.out["seq_ids"], self.out["n"], self.out["computed"]):
            seq = self.sched.get_sequence(sid)
            assert int(seq.status) == int(ST.RUNNING)
            assert len(seq.block_table) * bs >= c + n, (sid, c, n, seq.block_table.tolist())

    def _rows_of_step(self):
        rows = []
        bs = self.cfg["block_size"]
        for sid, n, c, pre in zip(self.out["seq_ids"], self.out["n"], self.out["computed"], self.out["prefill"]):
            seq = self.sched.get_sequence(sid)
            toks = seq.token_ids.tolist()
            drafts = seq.draft_token_ids.tolist()
            rows.append(RefRow(seq_id=sid, request_id=self.seq_req[sid], tokens=toks, num_prompt=seq.num_prompt_tokens,
                               start=c, num_new=n, block_table=seq.block_table.tolist(), drafts=drafts,
                               is_prompt=pre))
            assert len(seq.block_table) * bs >= c + n
        return rows

    @precondition(lambda self: self.in_flight and not self.prepared)
    @rule()
    def prepare_inputs(self):
        """Model inputs and sampler inputs of the scheduled step, against the layout reference."""
        self.prepared = True
        self.pool.build(self.sched)
        self._op()
        if any(sid in self.done for sid in self.out["seq_ids"]):
            self._prepare_with_finished_rows()
            return
        rows = self._rows_of_step()
        if not rows:
            return
        if any(r.end > self.cfg["max_model_len"] for r in rows):
            # drafts scheduled past max_model_len: the builders refuse the step (reported bug,
            # tests/reliability/test_regressions_core.py); never a crash
            with pytest.raises(ValueError, match="max_model_len"):
                E.prepare_prompt_v4(self.args, self.pool)
            self.logits_row_of = {}
            EVENTS["drafts past max_model_len"] += 1
            return
        decode_only = all(not r.is_prompt for r in rows)
        bs = self.cfg["block_size"]
        if decode_only:
            E.prepare_decode_v4(self.args, self.pool)
            EVENTS["prepare decode"] += 1
        else:
            E.prepare_prompt_v4(self.args, self.pool)
            EVENTS["prepare prompt"] += 1
        EVENTS["draft rows"] += sum(bool(r.drafts) for r in rows)
        self._op()
        ref = reference_layout(rows, block_size=bs, width=64, graph_sizes=[1, 2, 4, 8, 16], pad=decode_only)
        T = len(ref["input_ids"])
        assert self.args.num_tokens == T
        for k in ("input_ids", "positions", "slot_mapping", "logits_indices"):
            np.testing.assert_array_equal(self.bufs[k][: len(ref[k])], ref[k], err_msg=k)
        R = ref["num_rows"]
        np.testing.assert_array_equal(self.bufs["query_start_loc"][: R + 1], ref["query_start_loc"])
        np.testing.assert_array_equal(self.bufs["seq_lens"][:R], ref["seq_lens"])
        np.testing.assert_array_equal(self.bufs["block_tables"][:R], ref["block_tables"])
        si = E.prepare_sampler_inputs(self.args, self.pool, self.sampler_inputs)
        self._op()
        assert si.driver.num_real_rows == self.out["rows"]
        expect = [sid for sid, k in zip(self.out["seq_ids"], self.out["samples"]) for _ in range(k)]
        assert si.driver.seq_ids[: self.out["rows"]].tolist() == expect
        self._check_penalty_tables(si)
        self.logits_row_of = {int(s): int(lr) for s, lr in zip(si.driver.seq_ids[: self.out["rows"]],
                                                              si.kernel.logits_rows[: self.out["rows"]])}

    def _check_penalty_tables(self, si):
        """Incremental penalty counts: the consumer's tables, after this call's updates, hold each
        penalized row's counts straight from its sequence's tokens (across preemption, aborts,
        forks, rollbacks and slot reuse); a row has a slot exactly when it has a penalty."""
        tr = si.transform
        self.penalty_tables.apply(tr)
        for row in range(self.out["rows"]):
            sid, slot = int(si.driver.seq_ids[row]), int(tr.penalty_slots[row])
            penalized = (tr.presence_penalty[row] != 0 or tr.frequency_penalty[row] != 0
                         or tr.repetition_penalty[row] != 1)
            assert (slot >= 0) == (sid >= 0 and penalized), (row, sid, slot)
            if slot >= 0:
                seq = self.sched.get_sequence(sid)
                assert self.penalty_tables.counts(slot) == direct_counts(seq.token_ids.tolist(),
                                                                         seq.num_prompt_tokens), (row, sid)
                EVENTS["penalty tables"] += 1

    def _prepare_with_finished_rows(self):
        """A sequence finished after schedule() (abort): its rows become placeholders (slot -1,
        row_seq_ids -1); every other row is built exactly (fix of reported bug I1)."""
        self.logits_row_of = {}
        bs = self.cfg["block_size"]
        if any(c + q > self.cfg["max_model_len"] for c, q in zip(self.out["computed"], self.out["n"])):
            with pytest.raises(ValueError, match="max_model_len"):    # B8 (drafts past max_model_len)
                E.prepare_prompt_v4(self.args, self.pool)
            return
        decode_only = not any(self.out["prefill"])
        n = (E.prepare_decode_v4 if decode_only else E.prepare_prompt_v4)(self.args, self.pool)
        self._op()
        EVENTS["prepare with aborted rows"] += 1
        qsl, ids = self.bufs["query_start_loc"], self.args.row_seq_ids.tolist()
        assert n == self.args.num_tokens
        for i, (sid, q, c) in enumerate(zip(self.out["seq_ids"], self.out["n"], self.out["computed"])):
            a, b = int(qsl[i]), int(qsl[i + 1])
            slots = self.bufs["slot_mapping"][a:b].tolist()
            if sid in self.done:
                assert ids[i] == -1 and all(x == -1 for x in slots), (sid, ids[i], slots)
                continue
            seq = self.sched.get_sequence(sid)
            table = seq.block_table.tolist()
            assert ids[i] == sid and b - a == q
            assert self.bufs["positions"][a:b].tolist() == list(range(c, c + q))
            assert slots == [table[p // bs] * bs + p % bs for p in range(c, c + q)]

    @precondition(lambda self: self.in_flight and self.prepared)
    @rule()
    def prepare_zos_next(self):
        """ZOS: step N+1 built from the host state before step N's tokens exist, against the layout
        reference with the pending tokens sourced from step N's logits rows."""
        if self.zos is not None or any(k > 1 for k in self.out["samples"]):
            return
        if any(sid in self.done for sid in self.out["seq_ids"]):
            return   # aborted after schedule(): this step is not built (see prepare_inputs)
        bs = self.cfg["block_size"]
        rows, prev = [], {}
        for r in self._rows_of_step():
            if r.drafts:
                return   # ZOS with drafts is a documented limit
            if r.seq_id in self.logits_row_of:      # samples at N: decodes its pending token at N+1
                nr = RefRow(seq_id=r.seq_id, request_id=r.request_id, tokens=r.tokens, num_prompt=r.num_prompt,
                            start=len(r.tokens) - 1, num_new=1, is_prompt=False,
                            block_table=_table_for(r.block_table, len(r.tokens) + 1, bs, 10_000))
                prev[r.seq_id] = self.logits_row_of[r.seq_id]
            elif r.end < len(r.tokens):              # mid-prefill: its next chunk, host-known
                nr = RefRow(seq_id=r.seq_id, request_id=r.request_id, tokens=r.tokens, num_prompt=r.num_prompt,
                            start=r.end, num_new=len(r.tokens) - r.end, is_prompt=True,
                            block_table=_table_for(r.block_table, len(r.tokens), bs, 10_000))
            else:
                continue
            if nr.start + nr.num_new + (1 if not nr.is_prompt else 0) > self.cfg["max_model_len"]:
                continue
            rows.append(nr)
        if not rows:
            return
        pool = E.SequenceMetadataPool()
        for r in rows:
            r.add_to(pool)
        self._op(len(rows))
        E.prepare_zos_inputs(self.zargs, pool, self.args)
        self._op()
        ref = reference_layout(rows, block_size=bs, width=64, zos_prev=prev)
        for k in ("input_ids", "positions", "slot_mapping", "logits_indices", "zos_source_index"):
            np.testing.assert_array_equal(self.zbufs[k][: len(ref[k])], ref[k], err_msg=k)
        R = ref["num_rows"]
        np.testing.assert_array_equal(self.zbufs["seq_lens"][:R], ref["seq_lens"])
        self.zos = [r.seq_id for r in rows]
        EVENTS["zos"] += 1

    def _tokens(self, n):
        rng = self.rng
        return [EOS if rng.random() < 0.08 else (rng.choice(STOP_IDS) if rng.random() < 0.05
                else rng.randrange(4, VOCAB)) for _ in range(n)]

    def _after_update(self, finished_rows: dict[int, bool]):
        self.in_flight = False
        self.sched_check_finished()
        if self.zos is not None:
            fin = [s for s in self.zos if s in self.done]
            self.zargs.zos_discard(fin)
            self._op()
            row_ids = self.zargs.row_seq_ids.tolist()
            for i, s in enumerate(self.zos):
                assert row_ids[i] == (-1 if s in fin else s)
                if s in fin:
                    a, b = self.zbufs["query_start_loc"][i], self.zbufs["query_start_loc"][i + 1]
                    assert (self.zbufs["slot_mapping"][a:b] == -1).all()
        self._collect_outputs()

    def sched_check_finished(self):
        info = E.get_finished_seqs_info(self.sched)
        self._op()
        for sid, st_ in zip(info["seq_ids"].tolist(), info["statuses"].tolist()):
            self.finished_since_schedule.append(sid)
            if int(st_) == int(ST.FINISHED_ABORTED):
                continue
            assert FINISH_REASON[int(st_)] == self.done.get(sid), (sid, st_, self.done.get(sid))
        if self.exact:
            assert sorted(zip(info["seq_ids"].tolist(), info["statuses"].tolist())) == sorted(self.ref.finished)

    def _has_draft_rows(self):
        return any(not pre and n > 1 for n, pre in zip(self.out["n"], self.out["prefill"]))

    # A step with draft rows is applied with process_MTPInfo (Scheduler.update on such a step:
    # tests/reliability/test_regressions_core.py, bug B2).
    @precondition(lambda self: self.in_flight and not self._has_draft_rows())
    @rule()
    def update(self):
        rows = self.out["rows"]
        tokens = self._tokens(rows)
        self.sched.update(np.asarray(tokens, np.int32))
        self._op()
        if self.exact:
            self.ref.update(tokens)
        r = 0
        for sid, k in zip(self.out["seq_ids"], self.out["samples"]):
            if k == 0:
                continue
            if sid in self.done:       # aborted while the step ran: its rows are skipped
                r += k
                continue
            rid = self.seq_req[sid]
            seqs = [sid]
            if k > 1:
                known = set(self.shadow)
                self._register_children(rid)
                seqs += [s.seq_id for s in self.sched.get_sequences(rid) if s.seq_id not in known]
                assert len(seqs) == k, (sid, k, seqs)
            for j, s in enumerate(seqs):
                self._expect_append(s, tokens[r + j])
            r += k
        self._after_update({})

    # Steps completing an n > 1 prompt reach process_MTPInfo through full_steps (how="mtp*" or
    # draft rows); the standalone rule keeps its old precondition only so that the derandomized
    # stream of test_machine_reaches_every_path (which a wider precondition shifts) still reaches
    # preemption.
    @precondition(lambda self: self.in_flight and not any(k > 1 for k in self.out["samples"]))
    @rule(spec=st.booleans())
    def speculative_update(self, spec):
        """process_MTPInfo with random acceptance and (when spec) new drafts for the next step. One
        entry per sample row: the chunk completing an n > 1 prompt has n rows (no drafts) and is
        forked as update forks it (bug B3)."""
        rng = self.rng
        rows = self.out["rows"]
        drafts_of = []                # per sample row: (entry's seq id, sample index, draft count)
        for sid, k, pre, n in zip(self.out["seq_ids"], self.out["samples"], self.out["prefill"], self.out["n"]):
            for j in range(k):
                drafts_of.append((sid, j, 0 if pre else n - 1))
        kmax = max([d for _, _, d in drafts_of] + [0])
        acc = np.array([rng.randint(0, d) for _, _, d in drafts_of], np.int32)
        toks = np.array([self._tokens(kmax + 1) for _ in range(rows)], np.int32).reshape(rows, kmax + 1)
        next_k = rng.randint(1, 3) if spec else 0
        nd = np.array([[rng.randrange(4, VOCAB) for _ in range(next_k)] for _ in range(rows)],
                      np.int32).reshape(rows, next_k) if next_k else None
        known = set(self.shadow)
        EVENTS["n>1 prompt beside drafts"] += kmax > 0 and any(k > 1 for k in self.out["samples"])
        appended = E.process_MTPInfo(self.sched, acc, toks, nd)
        self._op()
        if next_k or kmax:
            self.exact = False        # drafts: the reference does not model them
        elif self.exact:
            self.ref.update(toks[:, 0].tolist())
        children: dict[int, list[int]] = {}   # parent seq id -> its children forked by this call
        aborted = {sid for sid, _, _ in drafts_of if sid in self.done}   # while the step ran
        for r, (sid, j, _) in enumerate(drafts_of):
            if sid in aborted:
                assert appended[r] == 0
                continue
            if j == 0 and self.out["samples"][self.out["seq_ids"].index(sid)] > 1:
                rid = self.seq_req[sid]
                self._register_children(rid)
                children[sid] = [q.seq_id for q in self.sched.get_sequences(rid) if q.seq_id not in known]
                assert len(children[sid]) == self.out["samples"][self.out["seq_ids"].index(sid)] - 1
            target = sid if j == 0 else children[sid][j - 1]
            n = 0
            for c in range(acc[r] + 1):
                n += 1
                if self._expect_append(target, int(toks[r, c])):
                    break
            assert appended[r] == n, (target, appended[r], n)
            EVENTS["drafts accepted"] += int(acc[r])
            EVENTS["n>1 prompt with mtp"] += j > 0
            seq = self.sched.get_sequence(target)
            if target not in self.done:
                assert seq.draft_token_ids.tolist() == (nd[r].tolist() if next_k else [])
                assert seq.num_computed_tokens == seq.num_tokens - 1
        self._after_update({})

    @precondition(lambda self: not self.in_flight)
    @rule(count=st.integers(1, 8), prepare=st.booleans(), zos=st.booleans(), abort_in_flight=st.booleans(),
          how=st.sampled_from(["update"] * 4 + ["mtp", "mtp_drafts"]))
    def full_steps(self, count, prepare, zos, abort_in_flight, how):
        """Whole steps (the common case), so that examples go deep."""
        for _ in range(count):
            self._full_step(prepare, zos, abort_in_flight, how)

    def _full_step(self, prepare, zos, abort_in_flight, how):
        """schedule, inputs, maybe an abort while the step runs, then update or a speculative update."""
        self.schedule()
        if self.sched.num_preempted and self.rng.random() < 0.3:
            self.abort("preempted")       # abort while preempted (rare otherwise)
        if prepare:
            self.prepare_inputs()
            if zos:
                self.prepare_zos_next()
        if abort_in_flight and self.rng.random() < 0.2:
            self.abort("running")
        if self.rng.random() < 0.03:
            self.abandon_step(self.rng.choice(["recompute", "fail"]))
            return
        if self._has_draft_rows() or how.startswith("mtp"):
            self.speculative_update(how == "mtp_drafts")
        else:
            self.update()

    def _pick(self, pred):
        cands = [sid for sid in self._live_seq_ids() if sid not in self.done and pred(sid)]
        return self.rng.choice(cands) if cands else None

    @rule(which=st.sampled_from(["any", "waiting", "prefill", "running", "preempted"]))
    def abort(self, which):
        def pred(sid):
            st_ = self._status(sid)
            if which == "waiting":
                return st_ == int(ST.WAITING)
            if which == "preempted":
                return st_ == int(ST.PREEMPTED)
            if which == "running":
                return st_ == int(ST.RUNNING)
            if which == "prefill":
                s = self.sched.get_sequence(sid)
                return st_ == int(ST.RUNNING) and s.num_computed_tokens < s.num_prompt_tokens
            return True
        sid = self._pick(pred)
        if sid is None:
            return
        rid = self.seq_req[sid]
        assert self.sched.abort_request(rid) >= 1
        EVENTS[f"abort {which}"] += 1
        self._op()
        if self.exact:
            self.ref.abort(rid)
        self.aborted.add(rid)
        for s in self.shadow:
            if self.seq_req[s] == rid and s not in self.done:
                self.done[s] = "abort"
        if not self.in_flight:
            self._collect_outputs()

    @precondition(lambda self: self.in_flight)
    @rule(action=st.sampled_from(["recompute", "fail"]))
    def abandon_step(self, action):
        """A failed step (after its inputs may have been built): recompute or fail its requests.
        The reference does not model it: the exact comparison stops, the rest still holds."""
        live = [sid for sid in self.out["seq_ids"] if sid not in self.done]
        step_requests = sorted({self.seq_req[sid] for sid in live})
        ids = self.sched.abandon_step(action)
        self._op()
        self.exact = False
        self.in_flight = False
        EVENTS[f"abandon {action}"] += 1
        assert not self.sched.step_in_flight
        assert ids == sorted(set(ids))
        if action == "fail":
            assert ids == step_requests
            for rid in ids:
                for sid in self.shadow:
                    if self.seq_req[sid] == rid and sid not in self.done:
                        self.done[sid] = "error"
                        assert int(self.sched.get_sequence(sid).status) == int(ST.FINISHED_ERROR)
        else:
            assert set(ids) >= set(step_requests)
            for sid in live:
                assert int(self.sched.get_sequence(sid).status) == int(ST.PREEMPTED)
        self.sched_check_finished()
        self._collect_outputs()

    @precondition(lambda self: not self.in_flight)
    @rule(k=st.integers(1, 2))
    def fork(self, k):
        sid = self._pick(lambda s: self._status(s) == int(ST.RUNNING))
        if sid is None:
            return
        if not self.exact:
            try:
                children, copies, _, _ = E.clone_and_zero_states_and_blocks(self.sched, sid, k)
            except ValueError as e:
                assert "num_children" in str(e)
                return
        else:
            children = None
        free_units = self.cfg["max_num_seqs"] - self.ref.units()
        if children is None and k > free_units:
            try:
                E.clone_and_zero_states_and_blocks(self.sched, sid, k)
            except ValueError:
                self._op()
                return
            raise AssertionError(f"fork of {k} accepted with {free_units} free max_num_seqs units")
        if children is None:
            children, copies, _, _ = E.clone_and_zero_states_and_blocks(self.sched, sid, k)
            assert children.tolist() == self.ref.fork(sid, k)
        self._op()
        for c in children.tolist():
            EVENTS["explicit fork"] += 1
            self.explicit_children.add(c)
            self.inherited[c] = list(self.shadow[sid])
            self.shadow[c] = list(self.shadow[sid])
            self.seq_req[c] = self.seq_req[sid]
            self.nprompt[c] = self.nprompt[sid]
        for _src, dst in copies.tolist():      # a copied partial block belongs to its child only
            assert self.sched.block_manager.ref_count(dst) == 1

    @precondition(lambda self: not self.in_flight)
    @rule(data=st.data())
    def stop_string(self, data):
        sid = self._pick(lambda s: self._status(s) == int(ST.RUNNING) and self.shadow[s])
        if sid is None:
            return
        keep = data.draw(st.integers(0, len(self.shadow[sid])))
        self.sched.stop_sequence(sid, "STOP", keep)
        self._op()
        if self.exact:
            self.ref.stop_string(sid, keep)
        self.truncated.add(sid)
        del self.shadow[sid][keep:]
        self.done[sid] = "stop"
        EVENTS["stop string"] += 1
        self._collect_outputs()

    @precondition(lambda self: not self.in_flight)
    @rule()
    def reset_prefix_cache(self):
        EVENTS["reset with cached blocks"] += self.sched.block_manager.num_cached_blocks > 0
        self.sched.reset_prefix_cache()
        self._op()
        if self.exact:
            self.ref.bm.reset()
        assert self.sched.block_manager.num_cached_blocks == 0

    # ------------------------------------------------------------------ invariants
    @invariant()
    def blocks_consistent(self):
        if not hasattr(self, "sched"):
            return
        assert self.sched.check_invariants() == ""
        self._op()
        bm = self.sched.block_manager
        owners = Counter()
        bs = self.cfg["block_size"]
        for sid in self._live_seq_ids():
            seq = self.sched.get_sequence(sid)
            table = seq.block_table.tolist()
            st_ = int(seq.status)
            if st_ >= int(ST.FINISHED_STOPPED) or st_ in (int(ST.WAITING), int(ST.PREEMPTED)):
                assert table == [], (sid, st_, table)     # finished / not running: holds nothing
            if st_ == int(ST.RUNNING):
                assert len(table) * bs >= seq.num_computed_tokens, (sid, table)
            owners.update(table)
        used = 0
        for b in range(bm.num_blocks):
            rc = bm.ref_count(b)
            assert rc == owners.get(b, 0), (b, rc, owners.get(b, 0))
            used += rc > 0
        assert bm.num_free_blocks + used == bm.num_blocks
        if self.exact:
            assert bm.num_free_blocks == self.ref.bm.num_free()
            assert bm.num_cached_blocks == len(self.ref.bm.cache)
            for s in self.ref.running:
                cs = self.sched.get_sequence(s.seq_id)
                assert cs.num_computed_tokens == s.num_computed
                assert cs.token_ids.tolist() == s.tokens
        for sid in self._live_seq_ids():
            if sid in self.done and self.done[sid] != "abort" and self.done[sid] != "ignored":
                seq = self.sched.get_sequence(sid)
                assert seq.output_token_ids.tolist() == self.shadow[sid]
            elif sid not in self.done:
                assert self.sched.get_sequence(sid).output_token_ids.tolist() == self.shadow[sid]


# Shrinking a long stateful run can take many minutes: off unless DEEPINFER_STATE_MACHINE_SHRINK=1.
_PHASES = [Phase.explicit, Phase.reuse, Phase.generate] + (
    [Phase.shrink] if os.environ.get("DEEPINFER_STATE_MACHINE_SHRINK") == "1" else [])
EngineMachine.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
                                           phases=_PHASES, suppress_health_check=list(HealthCheck),
                                           database=None)
TestEngineStateMachine = EngineMachine.TestCase


def test_machine_reaches_every_path():
    """The random interleavings do reach every path the machine is meant to stress."""
    EVENTS.clear()
    run_state_machine_as_test(EngineMachine, settings=settings(
        max_examples=60, stateful_step_count=100, deadline=None, phases=_PHASES, derandomize=True,
        suppress_health_check=list(HealthCheck), database=None))
    wanted = ["preemption", "ignored", "n>1 prompt", "mixed step", "prepare decode", "prepare prompt", "draft rows",
              "zos", "drafts accepted", "abort waiting", "abort prefill", "abort running", "abort preempted",
              "stop string", "explicit fork", "reset with cached blocks", "eos", "stop token",
              "exact examples", "n>1 prompt with mtp", "penalty tables", "abandon recompute", "abandon fail"]
    missing = [w for w in wanted if not EVENTS[w]]
    assert not missing, (missing, dict(EVENTS))
