"""The grammar state of every structured request, and each step's token bitmask.

``StructuredOutputs`` keeps one xgrammar matcher per (request, sample index). Before a step
samples, ``step_rows`` finds the step's sample rows that belong to structured requests (from the
engine's ``SamplerInputs``); ``bitmask`` fills each row's allowed-token bitmask on the host
(int32, 32 tokens a word, bit set = allowed; all rows in one xgrammar call) and copies it to the
device. The sampler applies it to the logits before sampling, after the forward. When the step's
tokens are applied (``LaunchedStep.apply``), ``accept`` gives each structured row's token to its
matcher: the same tokens the scheduler appends (a sequence's tokens never change afterwards; a
recomputed sequence keeps them), with no per-row call into the scheduler.

The synchronous loop applies a step before the next launches; the overlap loop launches step N+1
ahead of step N's tokens, so a structured step launched ahead samples only once step N is
applied (the executor defers its sampling, see ``engine.executor``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from deepinfer.runtime.sampling.logits_processors import sample_row_keys

if TYPE_CHECKING:
    from collections.abc import Container

    from deepinfer.runtime.structured.backend import GrammarCompiler
    from deepinfer.runtime.structured.params import StructuredOutputsParams


@dataclass
class _Request:
    params: StructuredOutputsParams
    prompt_len: int
    matchers: dict[int, Any] = field(default_factory=dict)  # by sample index
    ended: set[int] = field(default_factory=set)  # sample indices whose matcher took a stop token


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
        return sample_row_keys(si, metadata, self.requests) or None

    def _matcher(self, req: _Request, index: int) -> Any:
        matcher = req.matchers.get(index)
        if matcher is None:
            matcher = req.matchers[index] = self.compiler.matcher(req.params)
        return matcher

    def bitmask(self, rows: list[tuple[int, str, int]], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sample rows int64 [G], their allowed-token bitmask int32 [G, ceil(V/32)]) on the device."""
        words = (vocab_size + 31) // 32
        host = self._buffer(len(rows), words)
        live, where = [], []
        for i, (_, rid, index) in enumerate(rows):
            req = self.requests.get(rid)
            if req is None or index in req.ended:
                host[i].fill_(-1)  # no constraint (the row is not used: its sequence has finished)
            else:
                live.append(self._matcher(req, index))
                where.append(i)
        if len(live) == 1:
            live[0].fill_next_token_bitmask(host, where[0])
        elif live:  # one call for the step: xgrammar fills the rows on its own threads
            if self._batch is None:
                self._batch = self.compiler.xgr.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask(live, host, where)
        self.num_masked_rows += len(rows)
        row_ids = torch.from_numpy(np.array([r for r, _, _ in rows], dtype=np.int64)).to(self.device, non_blocking=True)
        return row_ids, host[:len(rows)].to(self.device, non_blocking=True)

    def accept(self, rows: list[tuple[int, str, int]], tokens: np.ndarray) -> None:
        """The applied step's token of each structured row (``tokens`` by sample row) to its matcher."""
        stops = self.compiler.stop_token_ids
        for r, rid, index in rows:
            req = self.requests.get(rid)
            if req is None or index in req.ended:
                continue
            tok = int(tokens[r])
            if not self._matcher(req, index).accept_token(tok) or tok in stops:
                req.ended.add(index)  # ended (a stop token), or a token the grammar refused

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
