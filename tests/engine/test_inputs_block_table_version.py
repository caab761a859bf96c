"""Incremental block-table rows (Sequence::block_table_version): the builders skip a row whose
version did not change and copy only the appended tail, so a mutation of a block table that does
not change its version would leave a stale row (wrong KV). These tests drive the real Scheduler
through everything that rewrites tables (preemption under memory pressure, copy-on-write of shared
blocks, prefix hits, n > 1 forks, explicit forks, speculative rollbacks, aborts) with ONE
persistent PrepareArgs, and after every prepare compare each block_tables row with what Python
sees of the sequence (its block_table, zero-padded); placeholder and padding rows must be zero."""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
from deepinfer_engine import _engine as E
from inputs_helpers import make_args, make_buffers

VOCAB = 64
EOS = 1
FINISHED = {int(E.SequenceStatus.FINISHED_STOPPED), int(E.SequenceStatus.FINISHED_LENGTH),
            int(E.SequenceStatus.FINISHED_ABORTED), int(E.SequenceStatus.FINISHED_IGNORED)}


def check_rows(sched, args, bufs, seq_ids):
    """Every row of the last prepared step equals its sequence's table (zero-padded)."""
    bt = bufs["block_tables"]
    for i in range(args.num_rows):
        want = np.zeros(bt.shape[1], np.int32)
        if i < len(seq_ids):
            seq = sched.get_sequence(seq_ids[i])
            if int(seq.status) not in FINISHED:
                table = seq.block_table
                want[: len(table)] = table
        assert bt[i].tolist() == want.tolist(), (i, seq_ids[i] if i < len(seq_ids) else None)


class Driver:
    """Random steps on a real Scheduler; counts the table mutations it reached."""

    def __init__(self, seed, num_blocks, max_num_seqs=8, block_size=4, lookahead=2):
        self.rng = random.Random(seed)
        self.bs = block_size
        self.max_num_seqs = max_num_seqs
        self.sched = E.Scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=48, max_model_len=48, vocab_size=VOCAB, eos_token_id=EOS,
                                 num_lookahead_slots=lookahead, watermark=0.0, enable_prefix_caching=True)
        self.bufs = make_buffers(max_tokens=256, max_seqs=max_num_seqs * 2, width=48 // block_size + 4)
        self.args = make_args(self.bufs, block_size=block_size, max_model_len=48, graph_batch_sizes=[g for g in (1, 2, 4, 8, 16) if g <= 2 * max_num_seqs])
        self.pool = E.SequenceMetadataPool()
        self.prefixes = [[self.rng.randrange(2, VOCAB) for _ in range(24)] for _ in range(3)]
        self.next_rid = 0
        self.requests: dict[str, int] = {}      # request id -> n
        self.events = {"preempted": 0, "replaced": 0, "shrunk": 0, "prefix hits": 0, "fork": 0, "n>1": 0,
                       "drafts": 0, "abort in flight": 0, "decode steps": 0, "skipped rows": 0,
                       "same row after preemption": 0}
        self.last_tables: dict[int, list[int]] = {}
        self.row_owner: dict[int, int] = {}     # block_tables row -> seq id last written there
        self.preempted_since_write: set[int] = set()

    def add(self):
        rng = self.rng
        prompt = list(rng.choice(self.prefixes))[: rng.randrange(4, 25)] if rng.random() < 0.7 else []
        prompt += [rng.randrange(2, VOCAB) for _ in range(rng.randrange(0 if prompt else 1, 12))]
        n = min(rng.choice([1, 1, 1, 2, 3]), self.max_num_seqs)
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        self.sched.add_request(rid, prompt, E.SamplingParams(max_tokens=rng.randrange(1, 20), n=n, temperature=1.0, ignore_eos=rng.random() < 0.5))
        self.requests[rid] = n

    def _live_requests(self):
        live = set()
        for rid in self.requests:
            try:
                self.sched.get_sequences(rid)
                live.add(rid)
            except ValueError:
                pass
        return live

    def note_tables(self):
        """Count table rewrites (not appends) seen from Python, for the coverage check."""
        for rid in self._live_requests():
            for s in self.sched.get_sequences(rid):
                t = s.block_table.tolist()
                old = self.last_tables.get(s.seq_id)
                if old and t:
                    k = min(len(old), len(t))
                    if old[:k] != t[:k]:
                        self.events["replaced"] += 1
                    elif len(t) < len(old):
                        self.events["shrunk"] += 1
                self.last_tables[s.seq_id] = t

    def step(self, allow_drafts=True):
        rng, sched = self.rng, self.sched
        if rng.random() < 0.35:
            self.add()
        if rng.random() < 0.1 and sched.num_running:
            sid = int(rng.choice(sched.running_seq_ids.tolist()))
            try:
                E.clone_and_zero_states_and_blocks(sched, sid, 1)
                self.events["fork"] += 1
            except ValueError:
                pass            # no room for a child: refused, nothing changed
        if rng.random() < 0.05 and self.requests:
            rid = rng.choice(sorted(self._live_requests()) or [None])
            if rid is not None:
                sched.abort_request(rid)
        self.note_tables()
        out = sched.schedule()
        self.events["preempted"] += len(out.preempted_seq_ids)
        self.preempted_since_write.update(out.preempted_seq_ids.tolist())
        if out.is_empty:
            sched.update(np.zeros(0, np.int32))
            return
        seq_ids = out.seq_ids.tolist()
        samples = out.num_samples.tolist()
        self.events["n>1"] += sum(k > 1 for k in samples)
        self.events["prefix hits"] += sum(c > 0 and p for c, p in zip(out.num_computed_tokens.tolist(),
                                                                        out.is_prefill.tolist()))
        has_drafts = out.num_decode_tokens != out.num_decodes
        self.events["drafts"] += has_drafts
        if rng.random() < 0.1:                       # abort after schedule: a placeholder row
            rid = sched.get_sequence(int(rng.choice(seq_ids))).request_id
            sched.abort_request(rid)
            self.events["abort in flight"] += 1
        self.note_tables()
        self.pool.build(sched)
        decode_only = not any(out.is_prefill.tolist())
        before = self.args.num_block_rows_written
        (E.prepare_decode_v4 if decode_only else E.prepare_prompt_v4)(self.args, self.pool)
        check_rows(sched, self.args, self.bufs, seq_ids)
        # A preempted sequence back in the row it last wrote, with a new table: the case where
        # only its version tells the builder that the row is stale.
        for i in range(self.args.num_rows):
            sid = seq_ids[i] if i < len(seq_ids) else -1
            if sid >= 0 and int(sched.get_sequence(sid).status) in FINISHED:
                sid = -1                                    # placeholder row
            if sid >= 0 and self.row_owner.get(i) == sid and sid in self.preempted_since_write:
                self.events["same row after preemption"] += 1
            self.preempted_since_write.discard(sid)
            self.row_owner[i] = sid
        # The same step again: nothing changed, so no row is written.
        written = self.args.num_block_rows_written
        (E.prepare_decode_v4 if decode_only else E.prepare_prompt_v4)(self.args, self.pool)
        assert self.args.num_block_rows_written == written
        check_rows(sched, self.args, self.bufs, seq_ids)
        if decode_only:
            self.events["decode steps"] += 1
            self.events["skipped rows"] += self.args.num_rows - (written - before)
        R = out.num_sample_rows
        toks = [EOS if rng.random() < 0.03 else rng.randrange(2, VOCAB) for _ in range(R)]
        if not has_drafts and (rng.random() < 0.6 or not allow_drafts):
            sched.update(np.asarray(toks, np.int32))
        else:
            ndraft = [0 if p else n - 1 for n, p, k in zip(out.num_scheduled_tokens.tolist(),
                                                          out.is_prefill.tolist(), samples) for _ in range(k)]
            acc = np.array([rng.randint(0, d) for d in ndraft], np.int32)
            C = max(ndraft + [0]) + 1
            otoks = np.array([[rng.randrange(2, VOCAB) for _ in range(C)] for _ in range(R)], np.int32).reshape(R, C)
            k_next = rng.randint(0, 3) if allow_drafts else 0
            nd = np.array([[rng.randrange(2, VOCAB) for _ in range(k_next)] for _ in range(R)],
                          np.int32).reshape(R, k_next) if k_next else None
            E.process_MTPInfo(sched, acc, otoks, nd)
        assert sched.check_invariants() == ""


CONFIGS = [(seed, num_blocks, max_num_seqs) for seed in range(3)
           for num_blocks in (14, 20, 200)        # small: preemption, copy-on-write of shared blocks
           for max_num_seqs in (3, 8)]


@functools.cache
def run_driver(seed, num_blocks, max_num_seqs):
    """One randomized run (checks after every prepare); its event counts. Cached: the coverage
    test reuses the runs of the parametrized test when both run in one process."""
    d = Driver(seed, num_blocks, max_num_seqs)
    for _ in range(150):
        d.step()
    return dict(d.events)


@pytest.mark.parametrize("seed,num_blocks,max_num_seqs", CONFIGS)
def test_rows_equal_tables_after_every_prepare(seed, num_blocks, max_num_seqs):
    assert run_driver(seed, num_blocks, max_num_seqs)["decode steps"] > 0


def test_random_runs_reach_every_table_mutation():
    """The randomized runs do exercise what rewrites a table (else they prove little)."""
    totals: dict[str, int] = {}
    for cfg in CONFIGS:
        for k, v in run_driver(*cfg).items():
            totals[k] = totals.get(k, 0) + v
    missing = [k for k, v in totals.items() if v == 0]
    assert not missing, (missing, totals)


def test_unchanged_rows_are_skipped_and_appends_copy_only_the_new_blocks():
    """Steady decoding, one token per step: a row is written exactly when its table grew."""
    bs, B = 4, 6
    sched = E.Scheduler(num_blocks=400, block_size=bs, max_num_seqs=B, max_num_batched_tokens=256,
                        max_model_len=256, vocab_size=VOCAB, enable_prefix_caching=False)
    rng = random.Random(5)
    for i in range(B):
        sched.add_request(f"r{i}", [rng.randrange(2, VOCAB) for _ in range(rng.randrange(3, 30))], E.SamplingParams(max_tokens=100, ignore_eos=True))
    bufs = make_buffers(max_tokens=512, max_seqs=B, width=64)
    args = make_args(bufs, block_size=bs, max_model_len=256)
    pool = E.SequenceMetadataPool()
    prev_len: dict[int, int] = {}
    grown_total = 0
    for step in range(40):
        out = sched.schedule()
        pool.build(sched)
        ids = out.seq_ids.tolist()
        lens = {sid: len(sched.get_sequence(sid).block_table) for sid in ids}
        before = args.num_block_rows_written
        E.prepare_prompt_v4(args, pool)
        check_rows(sched, args, bufs, ids)
        if step > 0 and not any(out.is_prefill.tolist()):
            assert sorted(ids) == sorted(prev_len)       # same sequences, same rows (stable order)
            grown = sum(lens[s] > prev_len[s] for s in ids)
            assert args.num_block_rows_written - before == grown, (step, lens, prev_len)
            grown_total += grown
        prev_len = lens
        sched.update(np.full(out.num_sample_rows, 7, np.int32))
    assert grown_total > 0                                  # some steps appended a block ...
    assert grown_total < 39 * B                             # ... and most rows were skipped


def test_a_new_table_for_a_reused_seq_id_is_rewritten():
    """add_sequence rows: the same seq_id with another table (and the same length) is a new version."""
    bufs = make_buffers(max_tokens=64, max_seqs=4, width=8)
    args = make_args(bufs, block_size=4, max_model_len=32)
    pool = E.SequenceMetadataPool()
    for table in ([3, 4, 5], [3, 9, 5], [3, 9, 5, 6], [8]):
        pool.clear()
        pool.add_sequence(seq_id=11, request_id="x", token_ids=list(range(2, 2 + 4 * len(table))),
                          num_prompt_tokens=2, num_computed_tokens=4 * len(table) - 1, num_new_tokens=1,
                          block_table=table)
        E.prepare_decode_v4(args, pool)
        assert bufs["block_tables"][0].tolist() == table + [0] * (8 - len(table))
