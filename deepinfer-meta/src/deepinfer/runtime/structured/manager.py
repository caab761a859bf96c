"""The grammar state of every structured request, and each step's token bitmask.

``StructuredOutputs`` keeps one xgrammar matcher per (request, sample index). Before a step
samples, ``step_rows`` finds the step's sample rows that belong to structured requests (from the
engine's ``SamplerInputs``), and ``bitmask`` brings each row's matcher up to date with the tokens
the scheduler holds for its sequence, then fills the row's allowed-token bitmask on the host
(int32, 32 tokens a word, bit set = allowed) and copies it to the device. The sampler applies it
to the logits before sampling (``sampling.sampler.apply_logits_processing``), after the forward.

Matchers read the scheduler's tokens rather than being fed by the loop, so the same code serves
the synchronous loop (the previous step is applied when a step launches) and the overlap loop
(a step launched ahead of step N samples only after step N's tokens are applied: the executor
defers its sampling, see ``engine.executor``), preemption and recompute (a matcher that is ahead
of its sequence starts over).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from collections.abc import Container

    from deepinfer.runtime.structured.backend import GrammarCompiler
    from deepinfer.runtime.structured.params import StructuredOutputsParams


@dataclass
class _Request:
    params: StructuredOutputsParams
    prompt_len: int
    matchers: dict[int, Any] = field(default_factory=dict)  # by sample index
    accepted: dict[int, list[int]] = field(default_factory=dict)  # tokens each matcher took


class StructuredOutputs:
    """Structured requests of one engine loop; ``compiler_factory()`` builds the GrammarCompiler
    the first time one is added (xgrammar and the tokenizer's vocabulary are read only then)."""

    def __init__(self, compiler_factory: Any, device: torch.device) -> None:
        self._factory = compiler_factory
        self._compiler: GrammarCompiler | None = None
        self.device = torch.device(device)
        self.requests: dict[str, _Request] = {}
        self._host: list[torch.Tensor] = []  # two host bitmask buffers, used in turn
        self._turn = 0
        self.num_masked_rows = 0  # rows masked so far (tests, metrics)
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher (several rows' masks in one call)

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = self._factory()
        return self._compiler

    # ---- requests ------------------------------------------------------------------------------
    def check(self, params: StructuredOutputsParams) -> None:
        """Compile (or find cached) the grammar of ``params``; ValueError naming it if invalid."""
        self.compiler.compile(params)

    def add(self, request_id: str, params: StructuredOutputsParams, prompt_len: int) -> None:
        self.check(params)
        self.requests[request_id] = _Request(params, int(prompt_len))

    def prune(self, live: Container[str]) -> None:
        """Forget requests the loop no longer runs."""
        for rid in [r for r in self.requests if r not in live]:
            del self.requests[rid]

    # ---- one step ------------------------------------------------------------------------------
    def step_rows(self, si: Any, metadata: Any) -> list[tuple[int, str, int]] | None:
        """(sample row, request id, sample index) of each structured row of the step whose sampler
        inputs are ``si``, or None when it has none. Copies what it reads (the engine reuses it)."""
        if not self.requests:
            return None
        by_seq: dict[int, str] = {}
        for i in range(len(metadata)):
            m = metadata[i]
            rid = m.request_id
            if rid in self.requests:
                by_seq[int(m.seq_id)] = rid
        if not by_seq:
            return None
        drv = si.driver
        n = int(drv.num_real_rows)
        seq_ids = np.asarray(drv.seq_ids)[:n]
        subs = np.asarray(si.kernel.subsequences)[:n]
        rows = [(r, by_seq[int(s)], int(subs[r])) for r in range(n) if int(s := seq_ids[r]) in by_seq]
        return rows or None

    def bitmask(self, rows: list[tuple[int, str, int]], scheduler: Any, vocab_size: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sample rows int64 [G], their allowed-token bitmask int32 [G, ceil(V/32)]) on the device,
        each row's matcher first brought up to date with its sequence's tokens in ``scheduler``."""
        words = (vocab_size + 31) // 32
        host = self._buffer(len(rows), words)
        seqs: dict[str, list[Any]] = {}
        live, where = [], []
        for i, (_, rid, index) in enumerate(rows):
            req = self.requests.get(rid)
            matcher = None if req is None else self._synced(req, rid, index, scheduler, seqs)
            if matcher is None or matcher.is_terminated():
                host[i].fill_(-1)  # no constraint (the row is not used: its sequence has finished)
            else:
                live.append(matcher)
                where.append(i)
        if len(live) == 1:
            live[0].fill_next_token_bitmask(host, where[0])
        elif live:  # one call for the step: xgrammar fills the rows on its own threads
            if self._batch is None:
                self._batch = self.compiler.xgr.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask(live, host, where)
        self.num_masked_rows += len(rows)
        row_ids = torch.tensor([r for r, _, _ in rows], dtype=torch.int64).to(self.device, non_blocking=True)
        return row_ids, host[:len(rows)].to(self.device, non_blocking=True)

    def _buffer(self, n: int, words: int) -> torch.Tensor:
        self._turn ^= 1
        while len(self._host) < 2:
            self._host.append(torch.empty((0, words), dtype=torch.int32))
        buf = self._host[self._turn]
        if buf.shape[0] < n or buf.shape[1] != words:
            rows = max(n, 2 * buf.shape[0], 8)
            buf = torch.empty((rows, words), dtype=torch.int32, pin_memory=self.device.type == "cuda")
            self._host[self._turn] = buf
        return buf

    def _synced(self, req: _Request, rid: str, index: int, scheduler: Any, seqs: dict[str, list[Any]]) -> Any:
        matcher = req.matchers.get(index)
        if matcher is None:
            matcher = req.matchers[index] = self.compiler.matcher(req.params)
            req.accepted[index] = []
        if rid not in seqs:
            try:
                seqs[rid] = list(scheduler.get_sequences(rid))
            except (KeyError, ValueError):
                seqs[rid] = []
        seq = next((s for s in seqs[rid] if int(s.sample_index) == index), None)
        if seq is None:
            return matcher if not req.accepted[index] else None  # not forked yet: nothing generated
        done = req.accepted[index]
        have = int(seq.num_tokens) - req.prompt_len
        if have == len(done):
            return matcher
        if have < len(done):  # the sequence lost tokens (it was recomputed): start over
            matcher.reset()
            done.clear()
        # only the new tokens (a sequence's tokens never change once generated)
        for tok in np.asarray(seq.token_ids)[req.prompt_len + len(done):].tolist():
            if not matcher.accept_token(int(tok)):  # (also after the end): never sampled under its mask
                return None
            done.append(int(tok))
        return matcher
