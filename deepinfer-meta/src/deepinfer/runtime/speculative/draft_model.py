"""The draft-model method: a smaller model with the target's tokenizer drafts k tokens per step.

The draft runs in the same engine as a second ``ModelRunner`` whose paged KV cache has the
target's block count and block size and is indexed by the target's block tables: a draft
position p of a sequence lives in the slot the target uses for p. No second allocator, no second
prefix cache, no second preemption policy: the target's scheduler owns the blocks of both.

Drafting happens when a step is launched, after the scheduler has placed the step's drafts
(``process_MTPInfo`` stored placeholder drafts, as many as each sequence may take): the blocks of
the last token and of every scheduled draft position are then allocated, which are exactly the
positions the draft writes. Per sequence with d scheduled drafts the draft model runs d forwards:

1. catch-up: the sequence's tokens the draft has not seen (the whole sequence after a prompt or a
   recompute; else the tokens appended since its last drafting, less the kept drafts the draft
   model itself fed at their positions: the bonus token, and the last kept draft when all were
   kept), the last one's logits give draft 1;
2. forwards 2..d: one token each (the previous draft), batched over the sequences still drafting.

Draft KV beyond the true tokens (drafts the target rejects) is never trusted: the next catch-up
starts at the first position whose fed draft differs from the sequence's token, so rejected
positions are re-written.
Greedy requests draft the draft model's argmax; sampled requests draw from the draft's
distribution under the request's temperature / top-k / top-p / min-p, and that distribution q is
kept for rejection sampling (``rejection.verify_drafts``), which then keeps the target's
distribution exactly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deepinfer.runtime.sampling.sampler import SamplingBatch, sampling_probs
from deepinfer.runtime.sampling_params import GREEDY_TEMPERATURE_THRESHOLD


def batch_rows(batch: SamplingBatch, idx: torch.Tensor) -> SamplingBatch:
    """The sampling parameters of rows ``idx`` of ``batch`` (temperature and filters)."""
    from dataclasses import replace

    return replace(batch, temperature=batch.temperature[idx], top_k=batch.top_k[idx], top_p=batch.top_p[idx],
                   min_p=batch.min_p[idx], seeds=batch.seeds[idx], sample_index=batch.sample_index[idx],
                   step=batch.step[idx])


@dataclass
class Drafted:
    """The drafts of one step, in ``SpeculativeSamplingInputs`` order: ``ids`` int64 [D] and, when
    some drafting row samples, ``probs`` float32 [D, V] (the draft distribution q of each draft;
    rows of greedy requests are unused)."""

    ids: torch.Tensor
    probs: torch.Tensor | None


class DraftModel:
    """The draft runner and the per-sequence state of its KV cache."""

    def __init__(self, runner: Any, k: int) -> None:
        self.runner = runner
        self.k = k
        # seq id -> how many leading positions of the draft's KV hold the sequence's true tokens
        self.seen: dict[int, int] = {}
        # seq id -> the drafts fed to the draft model at positions seen, seen + 1, ... (their KV
        # is the true tokens' where the target kept them: the next catch-up starts after those)
        self.fed: dict[int, np.ndarray] = {}
        self.num_forwards = 0  # draft forward passes run (for benchmarks)
        self.num_steps = 0  # steps that drafted
        self.seconds = 0.0  # wall time spent drafting (the drafts reach the host: no device work left behind)
        # benchmarks only (``Speculator.record_oracle``): (history, num_prompt_tokens, count) -> the
        # drafts that replace the draft model's for a greedy request, or None; the draft model
        # still runs, so its cost is measured at the oracle's acceptance
        self.override: Callable[[np.ndarray, int, int], np.ndarray | None] | None = None
        if hasattr(runner, "native_verify_tokens"):  # CPU: catch-up rows of a few tokens run natively
            runner.native_verify_tokens = k + 1

    def forget(self) -> None:
        """Every sequence catches up from its first token (after a failed step)."""
        self.seen.clear()

    def _track(self, scheduled: Any) -> None:
        # Only sequences decoding this step keep their draft state: a prompt row (a new sequence,
        # a recompute after preemption or a failed step) may have new blocks, so it starts over.
        ids = np.asarray(scheduled.seq_ids, dtype=np.int64)
        nd = int(scheduled.num_decodes)
        decoding = {int(s) for s in ids[:nd]}
        self.seen = {s: n for s, n in self.seen.items() if s in decoding}
        self.fed = {s: f for s, f in self.fed.items() if s in self.seen}

    @torch.inference_mode()
    def propose(self, scheduler: Any, scheduled: Any, si: Any, arrays: dict[str, np.ndarray], num_seqs: int,
                batch: SamplingBatch, generator: torch.Generator) -> Drafted | None:
        """Draft the tokens the step verifies, write them into the step's ``input_ids`` (in
        ``arrays``, the buffers the target's forward reads) and return them."""
        self._track(scheduled)
        S = si.speculative
        if int(S.num_seqs) == 0:
            return None
        t0 = time.perf_counter()
        try:
            return self._propose(scheduler, si, arrays, num_seqs, batch, generator)
        finally:
            self.num_steps += 1
            self.seconds += time.perf_counter() - t0

    def _propose(self, scheduler: Any, si: Any, arrays: dict[str, np.ndarray], num_seqs: int,
                 batch: SamplingBatch, generator: torch.Generator) -> Drafted:
        S = si.speculative
        ns, nd = int(S.num_seqs), int(S.num_drafts_total)
        sr = np.array(S.sample_rows[:ns], dtype=np.int64)
        cu = np.array(S.cu_num_drafts[:ns + 1], dtype=np.int64)
        trows = np.array(S.target_logits_rows[:nd], dtype=np.int64)
        seq_ids = np.array(si.driver.seq_ids, dtype=np.int64)
        logits_indices = arrays["logits_indices"]
        qsl = arrays["query_start_loc"][:num_seqs + 1]
        first_tok = logits_indices[trows[cu[:-1]]].astype(np.int64)  # the last known token of each sequence
        batch_idx = np.searchsorted(qsl, first_tok, side="right") - 1
        length = arrays["positions"][first_tok].astype(np.int64) + 1  # tokens known (true) per sequence
        tables = arrays["block_tables"][batch_idx]
        counts = np.diff(cu)
        dev = self.runner.device
        # ---- the sampling of each drafting sequence: greedy (argmax) or from q
        per_seq = torch.from_numpy(sr).to(batch.temperature.device)
        sub = batch_rows(batch, per_seq)
        greedy = (sub.temperature < GREEDY_TEMPERATURE_THRESHOLD).cpu().numpy()
        # ---- forward 1: catch up and draft the first token
        ids, pos, q_lens, oracle, active = [], [], [], {}, []
        for s in range(ns):
            sid, n = int(seq_ids[sr[s]]), int(length[s])
            try:
                seq = scheduler.get_sequence(sid) if sid >= 0 else None
            except (KeyError, ValueError):
                seq = None  # released since schedule()
            if seq is None or seq.is_finished:  # a placeholder row: its drafts stay 0, never verified
                continue
            toks = np.asarray(seq.token_ids, dtype=np.int64)
            if len(toks) != n:
                raise RuntimeError(f"draft model: sequence {sid} has {len(toks)} tokens, the step says {n}")
            if self.override is not None and greedy[s]:
                rec = self.override(toks, int(seq.num_prompt_tokens), int(counts[s]))
                if rec is not None and len(rec) == counts[s]:
                    oracle[s] = rec
            start = self.seen.get(sid, 0)
            fed = self.fed.get(sid)
            if fed is not None and len(fed):  # kept drafts' KV is already right: skip them
                got = toks[start:start + len(fed)]
                start += int(np.argmin(np.append(got == fed[:len(got)], False)))
            start = min(start, n - 1)
            ids.append(toks[start:n])
            pos.append(np.arange(start, n, dtype=np.int64))
            q_lens.append(n - start)
            active.append(s)
            self.seen[sid] = n
        width = int(counts.max())
        drafts = np.zeros((ns, width), np.int64)
        probs: list[tuple[np.ndarray, torch.Tensor]] = []  # (sequences, their q) of each draft position
        sampled = not bool(greedy.all())
        live = np.asarray(active, dtype=np.int64)
        if len(live):
            ends = np.cumsum(q_lens)
            logits = self._forward(np.concatenate(ids), np.concatenate(pos), tables[live],
                                   np.repeat(np.arange(len(live)), q_lens), np.concatenate([[0], ends]),
                                   length[live], ends - 1)
        for j in range(width if len(live) else 0):
            tok, q = self._pick(logits, live, greedy, sub, generator, sampled)
            drafts[live, j] = tok
            if q is not None:
                probs.append((live, q))
            live = live[counts[live] > j + 1]  # the sequences with more drafts scheduled
            if not len(live):
                break
            at = length[live] + j  # draft j (0-based) goes in at the position after the known tokens + j
            n = len(live)
            logits = self._forward(drafts[live, j], at, tables[live], np.arange(n), np.arange(n + 1), at + 1,
                                   np.arange(n))
        for s in active:  # what the draft model consumed past the known tokens (the last draft is not fed)
            self.fed[int(seq_ids[sr[s]])] = drafts[s, :counts[s] - 1].copy()
        for s, rec in oracle.items():
            drafts[s, :counts[s]] = rec
        # ---- into the step's inputs (the target verifies them) and SpeculativeSamplingInputs order
        flat = np.concatenate([drafts[s, :counts[s]] for s in range(ns)])
        where = np.concatenate([first_tok[s] + 1 + np.arange(counts[s]) for s in range(ns)])
        arrays["input_ids"][where] = flat
        q_all = None
        if sampled and probs:  # (rows of placeholder sequences stay 0: never verified)
            q_all = torch.zeros(nd, int(probs[0][1].shape[-1]), dtype=torch.float32, device=dev)
            for j, (rows_j, qj) in enumerate(probs):
                q_all[torch.from_numpy(cu[:-1][rows_j] + j).to(dev)] = qj
        return Drafted(torch.from_numpy(flat).to(dev), q_all)

    def _forward(self, ids: np.ndarray, positions: np.ndarray, tables: np.ndarray, row_of: np.ndarray,
                 query_start_loc: np.ndarray, seq_lens: np.ndarray, logits_indices: np.ndarray) -> torch.Tensor:
        bs = int(self.runner.block_size)
        blocks = tables[row_of, positions // bs].astype(np.int64)
        slots = blocks * bs + positions % bs
        self.num_forwards += 1
        graphs = getattr(self.runner, "verify_graphs", None)  # (CUDA) worker.verify_graph_runner
        if graphs is not None:
            arrays = {"input_ids": np.asarray(ids), "positions": np.asarray(positions), "slot_mapping": slots,
                      "query_start_loc": np.asarray(query_start_loc), "seq_lens": np.asarray(seq_lens),
                      "block_tables": tables}
            logits = graphs.replay_arrays(len(query_start_loc) - 1, len(ids), arrays, logits_indices)
            if logits is not None:
                return logits  # type: ignore[no-any-return]
        return self.runner.execute(  # type: ignore[no-any-return]
            input_ids=np.ascontiguousarray(ids, dtype=np.int32), positions=np.ascontiguousarray(positions, np.int32),
            slot_mapping=np.ascontiguousarray(slots, dtype=np.int64),
            query_start_loc=np.ascontiguousarray(query_start_loc, dtype=np.int32),
            seq_lens=np.ascontiguousarray(seq_lens, dtype=np.int32), block_tables=np.ascontiguousarray(tables),
            logits_indices=np.ascontiguousarray(logits_indices, dtype=np.int32))

    def _pick(self, logits: torch.Tensor, live: np.ndarray, greedy: np.ndarray, sub: SamplingBatch,
              generator: torch.Generator, sampled: bool) -> tuple[np.ndarray, torch.Tensor | None]:
        """The drafts of the ``live`` sequences from their logits rows, and q [len(live), V] when
        any sequence samples (greedy rows' q is unused)."""
        x = logits.float()
        tok = x.argmax(dim=-1)
        q = None
        if sampled:
            idx = torch.from_numpy(live).to(sub.temperature.device)
            q = sampling_probs(x, batch_rows(sub, idx))
            rand = torch.from_numpy(np.flatnonzero(~greedy[live])).to(x.device)
            if len(rand):
                drawn = torch.multinomial(q[rand], 1, generator=generator).squeeze(1)
                tok[rand] = drawn
        return tok.cpu().numpy().astype(np.int64), q
