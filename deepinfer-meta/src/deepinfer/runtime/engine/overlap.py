"""Zero-overhead scheduling (ZOS): the host prepares decode step N+1 while the device runs step N.

In steady decode the engine loop launches a step without waiting for its tokens: the step's
sampled ids stay on the device, a non-blocking copy brings them to pinned host memory and a
CUDA event marks when they are there. Before waiting on that event the loop schedules the next
step ahead (``Scheduler.schedule(overlap=True)``), builds it with ``prepare_decode_zos_inputs``
and launches it: its input ids are gathered on the device from the previous step's sampled ids
(``zos_source_index``), so the device never waits for the host. Only then does the host wait for
step N's tokens, apply them (``update``) and detokenize, while step N+1 runs.

Two host buffer sets (``StepBuffers`` + ``PrepareArgs``) alternate: step N+1 is written while
step N's host-to-device copy may still be queued. On CPU the same path runs synchronously (the
"device" tensors are CPU tensors), so CI exercises it.

Penalties of a step launched ahead count step N's token on the device (the engine's
``penalty_pending_source``; the host sends it to the penalty tables a step later). Requests that
ask for logprobs keep the loop synchronous while they run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from deepinfer.runtime.sampling.sampler import sample
from deepinfer.runtime.sampling.sampler_inputs import sampling_batch_from_engine
from deepinfer.runtime.worker.step_buffers import StepBuffers

if TYPE_CHECKING:
    from deepinfer.runtime.engine.loop import EngineLoop
    from deepinfer.runtime.sampling_params import SamplingParams


def blocks_overlap(params: SamplingParams) -> bool:
    """Whether a request keeps the loop synchronous (its logprobs are read per step on the host)."""
    return params.logprobs is not None


def is_plain_decode(out: Any) -> bool:
    """A step of plain decodes (one token and one sample per sequence): it may be launched ahead."""
    n = len(out)
    return n > 0 and out.num_decodes == n and out.num_decode_tokens == n and out.num_sample_rows == n


@dataclass
class LaunchedStep:
    """A decode step running on the device; ``tokens()`` waits for its sampled ids."""

    args: Any  # the PrepareArgs it was built in (the ZOS builder's ``prev`` for the next step)
    tokens_dev: torch.Tensor  # int64 sampled token per logits row, on the device
    host: torch.Tensor | None  # pinned int64 copy of tokens_dev (CUDA), None on CPU
    event: Any  # torch.cuda.Event recorded after the copy, or None
    logits_rows: np.ndarray  # the logits row of each real sample row
    num_logits: int
    scheduled: Any  # the SchedulerOutputs it was launched from (request ids when outputs fail)

    def tokens(self) -> np.ndarray:
        """int32 tokens of the step's sample rows (``Scheduler.update``'s input); waits for the device."""
        if self.event is not None:
            self.event.synchronize()
        src = self.tokens_dev if self.host is None else self.host
        return src[:self.num_logits].numpy()[self.logits_rows].astype(np.int32)


class OverlapDecoder:
    """Launches plain decode steps for an EngineLoop without waiting for their tokens."""

    def __init__(self, loop: EngineLoop) -> None:
        from deepinfer._C import engine

        E: Any = engine
        self.loop = loop
        cfg, runner = loop.cfg, loop.runner
        self.cuda = runner.device.type == "cuda"
        other = StepBuffers(loop.step_buffers.max_tokens, loop.step_buffers.max_seqs, loop.step_buffers.width,
                            pin=self.cuda)
        self.buffers = [loop.step_buffers, other]
        self.args = [loop.args, E.PrepareArgs(block_size=cfg.block_size, max_model_len=cfg.max_model_len,
                                              graph_batch_sizes=cfg.graph_batch_sizes, **other.arrays)]
        n = loop.step_buffers.max_tokens
        self.host_tokens = [torch.zeros(n, dtype=torch.int64, pin_memory=self.cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)] if self.cuda else [None, None]
        self.side = 1
        self.in_flight: LaunchedStep | None = None  # launched, not yet applied by update()
        self.num_launched = 0
        self.num_ahead = 0  # steps launched before the previous step's tokens were known

    def launch(self, out: Any, prev: LaunchedStep | None) -> LaunchedStep:
        """Build and launch the plain decode step ``out`` just scheduled; ``prev``: the step in
        flight that it runs ahead of (its input ids come from prev's sampled ids on the device).
        Not under inference mode, as the synchronous loop's sampler (the penalty tables it may
        grow are updated in place by later steps)."""
        loop = self.loop
        E, runner, dev = loop._E, loop.runner, loop.runner.device
        copies = np.asarray(out.blocks_to_copy).reshape(-1, 2)
        if len(copies):
            runner.copy_blocks(copies[:, 0], copies[:, 1])
        self.side ^= 1
        side = self.side
        args, bufs = self.args[side], self.buffers[side]
        loop.metadata.build(loop.scheduler)
        if prev is None:
            E.prepare_decode_v4(args, loop.metadata)
        else:
            E.prepare_decode_zos_inputs(args, loop.metadata, prev.args)
        si = E.prepare_sampler_inputs(args, loop.metadata, loop.sampler_inputs)
        k, tr = si.kernel, si.transform
        real = int(si.driver.num_real_rows)
        logits_rows = np.array(k.logits_rows[:real], dtype=np.int64)  # the engine reuses its storage
        num_logits = int(args.num_logits)
        greedy_only = bool(k.all_greedy and tr.no_penalties and tr.no_logit_bias and tr.no_banned and tr.no_allowed)
        graphs = runner.graphs
        if graphs is not None and graphs.can_replay(args):
            resolve = None if prev is None else (lambda views, rows: _resolve_ids(views["input_ids"][:rows],
                                                                                 views["zos_source_index"][:rows],
                                                                                 prev.tokens_dev))
            logits, greedy = graphs.replay(int(args.num_rows), host=bufs.host, before_replay=resolve)
            if greedy_only:
                loop.penalty_tables.apply(si)  # it must see every prepare_sampler_inputs call
                tokens_dev = greedy
            else:
                tokens_dev = self._sample(si, logits, num_logits, prev)
        else:
            a = bufs.arrays
            T = int(args.num_tokens)
            rows = int(args.num_rows) or int(args.num_seqs)
            ids = torch.from_numpy(a["input_ids"][:T].astype(np.int64)).to(dev)
            if prev is not None:
                src = torch.from_numpy(a["zos_source_index"][:T].astype(np.int64)).to(dev)
                ids = _gather_ids(ids, src, prev.tokens_dev)
            logits = runner.execute(
                input_ids=ids, positions=a["positions"][:T], slot_mapping=a["slot_mapping"][:T],
                query_start_loc=a["query_start_loc"][:rows + 1], seq_lens=a["seq_lens"][:rows],
                block_tables=a["block_tables"][:rows], logits_indices=a["logits_indices"][:num_logits])
            tokens_dev = self._sample(si, logits, num_logits, prev)
        host, event = None, self.events[side]
        if event is not None:  # CUDA: the ids come to pinned memory behind the step, no sync
            host = self.host_tokens[side]
            host[:num_logits].copy_(tokens_dev[:num_logits], non_blocking=True)
            event.record()
        self.num_launched += 1
        self.num_ahead += prev is not None
        return LaunchedStep(args, tokens_dev, host, event, logits_rows, num_logits, out)

    def _sample(self, si: Any, logits: torch.Tensor, num_logits: int, prev: LaunchedStep | None) -> torch.Tensor:
        # The synchronous loop's sampler; its tokens are kept by logits row (what ZOS indexes).
        tables = self.loop.penalty_tables
        tr = si.transform
        if prev is not None and not tr.no_penalties:
            tables.grow(int(tr.num_penalty_slots), int(logits.shape[-1]))  # room for any pending token
        rows, batch = sampling_batch_from_engine(si, logits.device, tables)
        if prev is not None and batch.penalty_rows is not None and batch.penalty_rows.numel():
            _count_pending(batch.penalty_rows, batch.penalty_counts, batch.penalty_seen,
                           np.asarray(tr.penalty_pending_source), prev.tokens_dev)
        res = sample(logits[rows], batch)
        by_row = torch.zeros(num_logits, dtype=torch.int64, device=logits.device)
        by_row[rows] = res.tokens
        return by_row


def _count_pending(rows: torch.Tensor, counts: Any, seen: Any, pending: np.ndarray,
                   prev_tokens: torch.Tensor) -> None:
    # Step N's token of each penalized row (still on the device) is one more output token of it.
    src = torch.from_numpy(pending.astype(np.int64)).to(rows.device, non_blocking=True)[rows]
    hit = torch.nonzero(src >= 0).flatten()
    tok = prev_tokens[src[hit]]
    counts[hit, tok] += 1
    seen[hit, tok] = True


def _gather_ids(ids: torch.Tensor, src: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
    # Rows with src >= 0 take the previous step's sampled id of logits row src (no host sync).
    return torch.where(src >= 0, prev_tokens[src.clamp(min=0)].to(ids.dtype), ids)


def _resolve_ids(ids: torch.Tensor, src: torch.Tensor, prev_tokens: torch.Tensor) -> None:
    ids.copy_(_gather_ids(ids, src.long(), prev_tokens))
