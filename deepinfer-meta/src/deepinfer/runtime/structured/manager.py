"""The grammar state of every structured request, and each step's token bitmask.

``StructuredOutputs`` keeps one xgrammar matcher per (request, sample index). Before a step
samples, ``step_rows`` finds the step's sample rows that belong to structured requests (from the
engine's ``SamplerInputs``; a steady decode batch reuses the last step's answer); ``bitmask`` fills
each row's allowed-token bitmask on the host (int32, 32 tokens a word, bit set = allowed; one
xgrammar call for the step's rows, on one thread) and copies it, with the rows it applies to, to
the device in one copy. The sampler applies it to the logits before sampling, after the forward;
an all-greedy step takes ``masked_argmax`` instead (on CUDA in one kernel, replayed as a graph
after a decode graph: ``kernels.grammar_mask``). When the step's tokens are applied (``LaunchedStep.apply``),
``accept`` gives each structured row's token to its matcher: the same tokens the scheduler appends
(a sequence's tokens never change afterwards; a recomputed sequence keeps them), with no per-row
call into the scheduler.

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
        # (seq ids, subsequences, rows, their request ids) of the last step (``step_rows``)
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher (several rows' masks in one call)
        self._graphs: Any = None  # kernels.grammar_mask.MaskedArgmaxGraphs (CUDA, created on first use)
        self._last_rows: tuple[np.ndarray, np.ndarray, list[tuple[int, str, int]] | None, set[str]] | None = None

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
        inputs are ``si``, or None when it has none. Copies what it reads (the engine reuses it).
        Sequence ids are never reused, so a step with the same rows of the same sequences as the
        last one has the last one's answer (steady decode: no per-row work)."""
        if not self.requests:
            return None
        n = int(si.driver.num_real_rows)
        seq_ids = np.array(si.driver.seq_ids[:n], dtype=np.int64)
        subs = np.array(si.kernel.subsequences[:n], dtype=np.int64)
        last = self._last_rows
        if last is not None and np.array_equal(last[0], seq_ids) and np.array_equal(last[1], subs) \
                and all(rid in self.requests for rid in last[3]):
            return last[2]
        rows = sample_row_keys(si, metadata, self.requests) or None
        self._last_rows = (seq_ids, subs, rows, {rid for _, rid, _ in rows or ()})
        return rows

    def _matcher(self, req: _Request, index: int) -> Any:
        matcher = req.matchers.get(index)
        if matcher is None:
            matcher = req.matchers[index] = self.compiler.matcher(req.params)
        return matcher

    def fill(self, rows: list[tuple[int, str, int]], vocab_size: int, row_index: np.ndarray | None = None,
             capacity: int | None = None) -> tuple[torch.Tensor, int]:
        """(a host int32 buffer in ``kernels.grammar_mask``'s packed layout — count, ``capacity``
        row slots (default: the count), each row's allowed-token bitmask — and the words per mask).
        The rows are the sample rows, or ``row_index[sample row]`` when given (the logits rows, for
        a greedy step's masked argmax). Pinned on CUDA; two buffers used in turn."""
        words = (vocab_size + 31) // 32
        g = len(rows)
        cap = g if capacity is None else int(capacity)
        flat = self._buffer(1 + cap + g * words)
        out = flat[:1 + cap + g * words]
        view = out.numpy()
        view[0] = g
        sample_rows = np.fromiter((r for r, _, _ in rows), dtype=np.int64, count=g)
        view[1:1 + g] = sample_rows if row_index is None else row_index[sample_rows]
        masks = out[1 + cap:].view(g, words)
        live, where = [], []
        for i, (_, rid, index) in enumerate(rows):
            req = self.requests.get(rid)
            if req is None or index in req.ended:
                masks[i].fill_(-1)  # no constraint (the row is not used: its sequence has finished)
            else:
                live.append(self._matcher(req, index))
                where.append(i)
        if len(live) == 1:
            live[0].fill_next_token_bitmask(masks, where[0])
        elif live:  # one call: on one thread, xgrammar's batch call beat both a Python loop and its
            # own threads on the H200 host (64 rows: 71 us vs 195 us looped, 238-477 us threaded)
            if self._batch is None:
                self._batch = self.compiler.xgr.BatchGrammarMatcher(max_threads=1)
            self._batch.batch_fill_next_token_bitmask(live, masks, where)
        self.num_masked_rows += g
        return out, words

    def bitmask(self, rows: list[tuple[int, str, int]], vocab_size: int, row_index: np.ndarray | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the rows int32 [G], their allowed-token bitmask int32 [G, ceil(V/32)]) on the device, in
        one host-to-device copy (rows as in ``fill``)."""
        packed, words = self.fill(rows, vocab_size, row_index)
        g = len(rows)
        dev = packed.to(self.device, non_blocking=True)
        return dev[1:1 + g], dev[1 + g:].view(g, words)

    def masked_argmax(self, rows: list[tuple[int, str, int]], logits: torch.Tensor, argmax: torch.Tensor | None,
                      logits_rows: np.ndarray) -> torch.Tensor:
        """The step's token of each logits row for an all-greedy step: the argmax (``argmax``, when
        a decode graph computed it, is updated in place), over the allowed tokens in the structured
        ``rows``. On CUDA one copy up and one launch (a graph replay after a decode graph)."""
        vocab = int(logits.shape[-1])
        if not logits.is_cuda:
            from deepinfer.runtime.sampling.sampler import masked_argmax

            where, bitmask = self.bitmask(rows, vocab, logits_rows)
            return masked_argmax(logits, argmax, where, bitmask)
        from deepinfer.runtime.kernels.grammar_mask import MaskedArgmaxGraphs, masked_argmax_

        if argmax is not None:  # the decode graph's static buffers: replay a capture over them
            packed, words = self.fill(rows, vocab, logits_rows, capacity=int(logits.shape[0]))
            if self._graphs is None:
                self._graphs = MaskedArgmaxGraphs()
            return self._graphs.run(argmax, logits, packed, words)
        packed, words = self.fill(rows, vocab, logits_rows)
        return masked_argmax_(logits.argmax(dim=-1), logits, packed.to(self.device, non_blocking=True), len(rows),
                              words)

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

    def _buffer(self, n: int) -> torch.Tensor:
        """One of two flat int32 host buffers of at least ``n`` words, used in turn (the copy of the
        last step's may still be reading the other); pinned on CUDA."""
        self._turn ^= 1
        while len(self._host) < 2:
            self._host.append(torch.empty(0, dtype=torch.int32))
        buf = self._host[self._turn]
        if buf.shape[0] < n:
            buf = torch.empty(max(n, 2 * buf.shape[0]), dtype=torch.int32, pin_memory=self.device.type == "cuda")
            self._host[self._turn] = buf
        return buf
