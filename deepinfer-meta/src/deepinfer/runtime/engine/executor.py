"""The one step executor: launch a scheduled engine step on the model runner.

``StepExecutor.launch(scheduled, prev)`` does everything between the scheduler's decision and
the step's sampled tokens, for the synchronous loop and the overlap loop alike:

1. copy the KV blocks the scheduler asked for (forks of a partial block);
2. build the step's model inputs in one of the host buffer sets: ``prepare_prompt_v4`` (prefill
   or mixed), ``prepare_decode_v4`` (decode), or ``prepare_decode_zos_inputs`` when the step
   runs ahead of ``prev`` (its input ids then come from prev's sampled ids on the device);
3. build the sampler inputs (``prepare_sampler_inputs``) and keep the penalty tables in step;
4. run the model: replay a captured decode graph, or the eager forward;
5. prompt logprobs, when asked (a host sync: such steps never run ahead);
6. pick the tokens: the argmax for plain-greedy steps, else the sampler (penalties, bias, masks,
   seeds, logprobs, and the grammar bitmask of structured rows: ``runtime.structured``). A
   structured step launched ahead of ``prev`` samples only once prev's tokens are applied
   (``LaunchedStep.finish``): its bitmask is computed on the host while its forward runs.

It returns a ``LaunchedStep`` that may still be running on the device; ``apply`` waits for its
tokens and hands them to the scheduler (``Scheduler.update``). The engine loop decides when to
launch and when to apply (``engine.overlap``); nothing here reads the loop's state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deepinfer.runtime import switches
from deepinfer.runtime.engine.overlap import count_pending_tokens, gather_ids, resolve_ids
from deepinfer.runtime.engine.prompt_embeds import step_embeds
from deepinfer.runtime.host_to_device import host_to_device
from deepinfer.runtime.sampling.sampler import sample
from deepinfer.runtime.sampling.sampler_inputs import (
    PenaltyTables,
    is_plain_greedy,
    sampling_batch_from_engine,
)
from deepinfer.runtime.worker.step_buffers import StepBuffers, step_buffer_dims


@dataclass
class StepShape:
    """The sizes the executor's buffers and PrepareArgs are built for (from the engine config)."""

    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    seed: int = 0
    graph_batch_sizes: list[int] | None = None  # decode-only steps are padded to these (CUDA graphs)
    logprobs_mode: str = "raw_logprobs"  # what sampled tokens' logprobs report (EngineArgs.logprobs_mode)


@dataclass
class LaunchedStep:
    """A step launched on the device; ``apply`` waits for its tokens and updates the scheduler.

    ``row_tokens``: the sampled (or argmax) token of each logits row, on the device — what a step
    launched ahead of this one gathers its input ids from. ``sample_tokens``: the sampler's tokens
    by sample row (None for argmax steps, read from ``row_tokens``)."""

    args: Any  # the PrepareArgs it was built in (the ZOS builder's ``prev`` for the next step)
    scheduled: Any  # the SchedulerOutputs it was launched from (request ids when outputs fail)
    num_real_rows: int = 0
    logits_rows: np.ndarray | None = None  # the logits row of each real sample row
    row_tokens: torch.Tensor | None = None
    sample_tokens: torch.Tensor | None = None
    logprobs: tuple[Any, Any, Any] | None = None  # (sampled, top-k ids, top-k logprobs), by sample row
    host: torch.Tensor | None = None  # pinned copy of row_tokens under way (overlap on CUDA)
    event: Any = None  # CUDA event recorded after that copy
    spec: Any = None  # (speculative decoding) the verified step, applied with process_MTPInfo
    pending: Any = None  # sampling deferred until prev's tokens are applied (structured rows)
    structured: Any = None  # (StructuredOutputs, its rows in this step): the applied tokens go to the matchers
    processed: Any = None  # (LogitsProcessors, the step's sample keys): the applied tokens go to their lists
    full: Any = None  # (sink, [(request id, sample index)], float32 [F, V]): whole-vocabulary logprob rows
    # (speculative decoding, overlap loop) a plain decode step launched as one another may run
    # ahead of: (Speculator, int64 seq id of each real sample row). Applied with no step ahead of
    # it, it stores the sequences' next drafts (``Speculator.apply_plain``); with one, the step
    # ahead carries no drafts and ``Scheduler.update`` applies it as any decode step.
    redraft: Any = None

    def finish(self) -> None:
        """Launch the deferred sampling of a structured step launched ahead (a no-op otherwise):
        call it once the step it ran ahead of is applied."""
        if self.pending is not None:
            draw, self.pending = self.pending, None
            draw()

    def tokens(self) -> np.ndarray:
        """int32 tokens of the step's real sample rows (``Scheduler.update``'s input); waits for
        the device."""
        if self.logits_rows is None:  # nothing was scheduled to run
            return np.zeros(0, np.int32)
        self.finish()
        if self.event is not None:  # the pinned copy's event, or (blocking sync) the step's own
            self.event.synchronize()
        if self.sample_tokens is not None:
            return self.sample_tokens[:self.num_real_rows].to(torch.int32).cpu().numpy()
        assert self.row_tokens is not None
        src = self.row_tokens.cpu() if self.host is None else self.host
        return np.ascontiguousarray(src.numpy()[self.logits_rows], dtype=np.int32)

    def apply(self, scheduler: Any) -> None:
        """Wait for the step's tokens and give them (and logprobs, when asked) to ``scheduler``."""
        if self.spec is not None:  # ---- speculative decoding (runtime.speculative) ----
            self.spec.apply(scheduler)
            return
        tokens = self.tokens()
        if self.redraft is not None and not scheduler.step_ahead:
            speculator, seq_ids = self.redraft
            speculator.apply_plain(scheduler, seq_ids, tokens)
        elif self.logprobs is None:
            scheduler.update(tokens)
        else:
            real = self.num_real_rows
            lp, ids, vals = self.logprobs
            scheduler.update(tokens, lp[:real].cpu().numpy(),
                             None if ids is None else ids[:real].to(torch.int32).cpu().numpy(),
                             None if vals is None else vals[:real].cpu().numpy())
        if self.full is not None:  # whole-vocabulary logprobs (logprobs=-1), once the tokens are taken
            sink, keys, rows = self.full
            sink("output", keys, rows.cpu().numpy())
        if self.structured is not None:  # the tokens the scheduler took, to the grammar matchers
            so, rows = self.structured
            so.accept(rows, tokens)
        if self.processed is not None:  # and to the logits processors' output lists
            procs, keys = self.processed
            procs.accept(keys, tokens)


class StepExecutor:
    """Builds and launches engine steps on ``runner`` (a ModelRunner or tensor-parallel driver).

    ``buffer_sets``: 1 for the synchronous loop; 2 for the overlap loop, whose step N+1 is
    written in one set while step N's host-to-device copy may still read the other."""

    def __init__(self, runner: Any, scheduler: Any, shape: StepShape, *, buffer_sets: int = 1,
                 step_buffers: StepBuffers | None = None) -> None:
        from deepinfer._C import engine

        self.E: Any = engine  # the native module (its stub may lag behind the build)
        self.runner, self.scheduler = runner, scheduler
        self.cuda = runner.device.type == "cuda"
        dims = step_buffer_dims(shape.max_num_batched_tokens, shape.max_num_seqs, shape.max_model_len,
                                shape.block_size)
        rows = dims[0]
        first = step_buffers or StepBuffers(*dims, pin=self.cuda)
        self.buffers = [first] + [StepBuffers(*dims, pin=self.cuda) for _ in range(buffer_sets - 1)]
        self.args = [self.E.PrepareArgs(block_size=shape.block_size, max_model_len=shape.max_model_len,
                                        graph_batch_sizes=shape.graph_batch_sizes, **b.arrays)
                     for b in self.buffers]
        self.metadata = self.E.SequenceMetadataPool()
        self.sampler_inputs = self.E.SamplerInputs(shape.seed)
        self.penalty_tables = PenaltyTables(runner.device)  # fed by sampler_inputs, step by step
        self.logprobs_mode = shape.logprobs_mode
        self.side = 0  # the buffer set of the last launch
        # (overlap on CUDA) pinned landing place of each set's sampled ids, and its event
        self._host_tokens = [torch.zeros(rows, dtype=torch.int64, pin_memory=True) if self.cuda and buffer_sets > 1
                             else None for _ in self.buffers]
        # DEEPINFER_CUDA_BLOCKING_SYNC: a blocking event puts the waiting thread to sleep; CUDA's
        # default wait spins, so a serving engine's process keeps a core busy for every step
        blocking = switches.enabled("DEEPINFER_CUDA_BLOCKING_SYNC")
        self._events = [torch.cuda.Event(blocking=blocking) if self.cuda and buffer_sets > 1 else None
                        for _ in self.buffers]
        # (blocking sync) steps that copy their tokens when applied wait on this first
        self._wait_event = torch.cuda.Event(blocking=True) if self.cuda and blocking else None
        self.num_launched = 0
        # ---- speculative decoding (runtime.speculative): set by the engine loop when configured;
        # a step launched synchronously then goes through Speculator.verify and process_MTPInfo, a
        # plain decode step of the overlap loop (no drafts) runs as without speculation.
        self.speculator: Any = None
        self.structured: Any = None  # runtime.structured.StructuredOutputs (set by the engine loop)
        # sampling.logits_processors.LogitsProcessors (set by the engine loop; steps then run synchronously)
        self.logits_processors: Any = None
        # prompts given as embeddings, by request id (the engine loop's dict): their prompt
        # positions take these rows instead of the placeholder ids' embeddings
        self.prompt_embeds: dict[str, torch.Tensor] = {}
        # requests that asked the whole vocabulary's logprobs (logprobs / prompt_logprobs = -1; the
        # engine loop's sets) and where their rows go: full_sink("output" | "prompt",
        # [(request id, sample index | prompt position)], float32 rows [F, V])
        self.full_output: set[str] = set()
        self.full_prompt: set[str] = set()
        self.full_sink: Any = None

    def reset_penalties(self) -> None:
        """After an abandoned step: the sampler inputs may have sent penalty updates the tables
        never applied; both start over (the next call sends every table whole)."""
        self.sampler_inputs.reset_penalty_tables()
        self.penalty_tables.reset()

    # ---- launch ------------------------------------------------------------------------------
    def launch(self, scheduled: Any, prev: LaunchedStep | None = None, *, copy_ahead: bool = False
               ) -> LaunchedStep:
        """Build and launch the step ``scheduled`` (just returned by ``Scheduler.schedule``).

        ``prev``: the step still in flight that this plain decode step runs ahead of (overlap
        loop): its input ids are gathered on the device from prev's tokens. ``copy_ahead``: the
        step may itself be a ``prev`` (overlap loop): its tokens are kept by logits row and, on
        CUDA, copied to pinned host memory behind the step (no sync)."""
        E, runner = self.E, self.runner
        if prev is not None:
            prev.finish()  # (the loop finishes it right after applying the step before)
        copies = np.asarray(scheduled.blocks_to_copy).reshape(-1, 2)
        if len(copies):
            runner.copy_blocks(copies[:, 0], copies[:, 1])
            draft = getattr(self.speculator, "draft", None)
            if draft is not None:  # the draft's cache shares the block ids: its copy too
                draft.runner.copy_blocks(copies[:, 0], copies[:, 1])
        if len(self.buffers) > 1:
            self.side ^= 1
        args, bufs = self.args[self.side], self.buffers[self.side]
        self.metadata.build(self.scheduler)
        step = LaunchedStep(args, scheduled)
        if not len(self.metadata):
            return step  # nothing runs (e.g. every request was aborted); update() takes no tokens
        if prev is not None:
            E.prepare_decode_zos_inputs(args, self.metadata, prev.args)
        elif scheduled.num_decodes == len(self.metadata):
            E.prepare_decode_v4(args, self.metadata)
        else:
            E.prepare_prompt_v4(args, self.metadata)
        si = E.prepare_sampler_inputs(args, self.metadata, self.sampler_inputs)
        step.num_real_rows = int(si.driver.num_real_rows)
        # the engine reuses its storage next step: copy the rows now
        step.logits_rows = np.array(si.kernel.logits_rows[:step.num_real_rows], dtype=np.int64)
        grammar = None if self.structured is None else self.structured.step_rows(si, self.metadata)
        if grammar is not None:
            step.structured = (self.structured, grammar)
        embeds = None  # (prompt embeddings are refused with speculative decoding: EngineLoop)
        if self.prompt_embeds and prev is None and scheduled.num_decodes != len(self.metadata):
            embeds = step_embeds(self.metadata, bufs.arrays["query_start_loc"], int(scheduled.num_decodes),
                                 self.prompt_embeds)
        if self.speculator is not None and (prev is not None or copy_ahead):
            # a plain decode step of the overlap loop (no drafts: ``Overlap.may_run_ahead``): it
            # runs as without speculation; applied with no step ahead, it stores next drafts
            if int(scheduled.num_decode_tokens) != int(scheduled.num_decodes):
                raise RuntimeError("verify steps never run ahead (the overlap loop runs them synchronously)")
            step.redraft = (self.speculator, np.array(si.driver.seq_ids[:step.num_real_rows], dtype=np.int64))
        elif self.speculator is not None:  # ---- speculative decoding (runtime.speculative) ----
            if is_plain_greedy(si) and self.speculator.draft is None:
                # every row greedy, no processing: acceptance from the logits rows' argmax with one
                # device-to-host copy (no SamplingBatch, no sampler)
                self.penalty_tables.apply(si)  # it must see every prepare_sampler_inputs call
                logits, greedy = self._forward(args, bufs, prev, verify=True)
                if int(si.prompt_logprobs.num_rows):
                    self._prompt_logprobs(si, logits)
                step.spec = self.speculator.verify_greedy(si, logits.argmax(dim=-1) if greedy is None else greedy)
                self.num_launched += 1
                return step
            rows, batch = sampling_batch_from_engine(si, self.runner.device, self.penalty_tables)
            # (draft model) the drafts the scheduler placed are drafted now, into the input ids
            drafted = self.speculator.propose(self.scheduler, scheduled, si, bufs.arrays,
                                              int(args.num_rows) or int(args.num_seqs), batch)
            logits, _ = self._forward(args, bufs, prev, verify=True)
            if int(si.prompt_logprobs.num_rows):
                self._prompt_logprobs(si, logits)
            res = sample(logits[rows], batch)
            step.spec = self.speculator.verify(si, logits, rows, batch, res, drafted)
            self.num_launched += 1
            return step
        logits, greedy = self._forward(args, bufs, prev, embeds)
        if int(si.prompt_logprobs.num_rows):
            self._prompt_logprobs(si, logits)
        procs = self.logits_processors
        if procs is not None:
            if prev is not None:
                raise RuntimeError("steps with logits processors never run ahead (the loop runs them synchronously)")
            step.processed = (procs, procs.step_keys(si, self.metadata))
        if is_plain_greedy(si) and grammar is None and procs is None:
            self.penalty_tables.apply(si)  # it must see every prepare_sampler_inputs call
            step.row_tokens = logits.argmax(dim=-1) if greedy is None else greedy
        elif grammar is not None and is_plain_greedy(si) and procs is None:  # greedy, structured rows: masked argmax
            self.penalty_tables.apply(si)
            self._greedy_structured(logits, greedy, prev, step, grammar)
        else:
            self._sample(si, logits, prev, step, by_row=copy_ahead, grammar=grammar)
        if copy_ahead and step.pending is None:
            self._copy_tokens_behind(step, self.side)
        self.num_launched += 1
        return step

    def _forward(self, args: Any, bufs: StepBuffers, prev: LaunchedStep | None,
                 embeds: tuple[np.ndarray, torch.Tensor] | None = None, verify: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits of the step's logits rows, their argmax when a graph computed it, else None).
        ``embeds``: prompt embeddings of some token rows (``prompt_embeds.step_embeds``): eager.
        ``verify``: a speculative step, which the verify graphs (``runner.verify_graphs``) may take."""
        graphs = self.runner.graphs
        rows = int(args.num_rows)
        vgraphs = getattr(self.runner, "verify_graphs", None) if verify and prev is None and embeds is None else None
        if vgraphs is not None and not (graphs is not None and graphs.can_replay(args)):
            logits = vgraphs.try_replay(args, bufs.arrays)
            if logits is not None:
                return logits, None
        if graphs is not None and embeds is None and graphs.can_replay(args):
            if prev is None and self.side == 0:
                return graphs.replay(rows)  # type: ignore[no-any-return]
            prev_tokens = None if prev is None else prev.row_tokens
            resolve = None if prev_tokens is None else (
                lambda views, n: resolve_ids(views["input_ids"][:n], views["zos_source_index"][:n], prev_tokens))
            return graphs.replay(rows, host=bufs.host, before_replay=resolve)  # type: ignore[no-any-return]
        a = bufs.arrays
        n_tokens = int(args.num_tokens)
        n_seqs = rows or int(args.num_seqs)
        ids: np.ndarray | torch.Tensor = a["input_ids"][:n_tokens]
        if prev is not None and prev.row_tokens is not None:
            dev = self.runner.device
            src = host_to_device(a["zos_source_index"][:n_tokens], dev)
            ids = gather_ids(host_to_device(ids, dev), src, prev.row_tokens)
        extra = {} if embeds is None else {"prompt_embeds": embeds}  # (only the ModelRunner takes them)
        logits = self.runner.execute(
            input_ids=ids, positions=a["positions"][:n_tokens], slot_mapping=a["slot_mapping"][:n_tokens],
            query_start_loc=a["query_start_loc"][:n_seqs + 1], seq_lens=a["seq_lens"][:n_seqs],
            block_tables=a["block_tables"][:n_seqs], logits_indices=a["logits_indices"][:int(args.num_logits)],
            **extra)
        return logits, None

    def _full_output_rows(self, si: Any) -> list[tuple[int, tuple[str, int]]]:
        """(sample row, (request id, sample index)) of the real sample rows whose request asked
        the whole vocabulary's logprobs."""
        n = int(si.driver.num_real_rows)
        batch_rows = np.asarray(si.driver.batch_rows)[:n]
        samples = np.asarray(si.kernel.subsequences)[:n]
        names: dict[int, str] = {}
        out = []
        for r in range(n):
            br = int(batch_rows[r])
            rid = names.get(br)
            if rid is None:
                rid = names[br] = self.metadata[br].request_id
            if rid in self.full_output:
                out.append((r, (rid, int(samples[r]))))
        return out

    def _full_prompt_rows(self, pl: Any, logits: torch.Tensor, rows: torch.Tensor) -> None:
        """Hand the whole-vocabulary rows of the prompt positions whose request asked them
        (prompt_logprobs=-1) to ``full_sink``."""
        n = int(pl.num_rows)
        seq_ids, positions = np.asarray(pl.seq_ids)[:n], np.asarray(pl.positions)[:n]
        owner = {int(m.seq_id): m.request_id for m in (self.metadata[i] for i in range(len(self.metadata)))}
        picked = [j for j in range(n) if owner.get(int(seq_ids[j])) in self.full_prompt]
        if not picked:
            return
        at = torch.tensor(picked, dtype=torch.int64, device=logits.device)
        # raw logprobs in every logprobs_mode (vLLM's prompt logprobs); whole rows
        full = torch.log_softmax(logits[rows[at]].float(), dim=-1)
        keys = [(owner[int(seq_ids[j])], int(positions[j])) for j in picked]
        self.full_sink("prompt", keys, full.cpu().numpy())

    def _prompt_logprobs(self, si: Any, logits: torch.Tensor) -> None:
        from deepinfer.runtime.sampling.sampler import prompt_logprobs

        pl = si.prompt_logprobs
        rows = torch.from_numpy(np.array(pl.logits_rows, dtype=np.int64)).to(logits.device)
        if self.full_prompt:
            self._full_prompt_rows(pl, logits, rows)
        k = max(int(pl.max_num_logprobs), 0)
        targets = torch.from_numpy(np.array(pl.target_token_ids)).to(logits.device)
        lp, ids, vals = prompt_logprobs(logits[rows], targets, k)
        self.E.update_prompt_logprobs(self.scheduler, si, lp.cpu().numpy(),
                                      None if ids is None else ids.to(torch.int32).cpu().numpy(),
                                      None if vals is None else vals.cpu().numpy())

    def _greedy_structured(self, logits: torch.Tensor, greedy: torch.Tensor | None, prev: LaunchedStep | None,
                           step: LaunchedStep, grammar: list[tuple[int, str, int]]) -> None:
        assert step.logits_rows is not None
        logits_rows = step.logits_rows
        side = self.side

        def draw() -> None:
            step.row_tokens = self.structured.masked_argmax(grammar, logits, greedy, logits_rows)
            if prev is not None and self._host_tokens[side] is not None:
                self._copy_tokens_behind(step, side)

        if prev is not None:
            step.pending = draw  # the bitmask needs prev's tokens: LaunchedStep.finish draws
        else:
            draw()

    def _sample(self, si: Any, logits: torch.Tensor, prev: LaunchedStep | None, step: LaunchedStep,
                by_row: bool, grammar: list[tuple[int, str, int]] | None = None) -> None:
        tables, tr = self.penalty_tables, si.transform
        if prev is not None and not tr.no_penalties:
            tables.grow(int(tr.num_penalty_slots), int(logits.shape[-1]))  # room for any pending token
        rows, batch = sampling_batch_from_engine(si, logits.device, tables)
        batch.logprobs_mode = self.logprobs_mode
        full_keys = self._full_output_rows(si) if self.full_output else []
        if full_keys:
            batch.full_rows = torch.tensor([r for r, _ in full_keys], dtype=torch.int64, device=logits.device)
        if prev is not None and prev.row_tokens is not None and batch.penalty_rows is not None \
                and batch.penalty_rows.numel():
            # Penalties of a step launched ahead count step N's token on the device (the engine's
            # ``penalty_pending_source``; the host sends it to the tables a step later).
            count_pending_tokens(batch.penalty_rows, batch.penalty_counts, batch.penalty_seen,
                                 np.asarray(tr.penalty_pending_source), prev.row_tokens)
        side = self.side

        def draw() -> None:
            if grammar is not None:  # prev is applied by now: its tokens are in the matchers
                batch.grammar_rows, batch.grammar_bitmask = self.structured.bitmask(grammar, int(logits.shape[-1]))
            sub = logits[rows]
            if step.processed is not None:  # custom logits processors, on the sample rows' logits
                sub = step.processed[0].apply(step.processed[1], sub)
            res = sample(sub, batch)
            if res.logprobs is not None:
                step.logprobs = (res.logprobs, res.topk_ids, res.topk_logprobs)
            if res.full is not None:
                step.full = (self.full_sink, [key for _, key in full_keys], res.full)
            if by_row:  # a plain decode step another may run ahead of: tokens by logits row
                by_logits_row = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
                by_logits_row[rows] = res.tokens
                step.row_tokens = by_logits_row
                if step.pending is None and grammar is not None and prev is not None:
                    self._copy_tokens_behind(step, side)
            else:
                step.sample_tokens = res.tokens
                if self._wait_event is not None:  # (blocking sync) tokens() sleeps on it, then copies
                    self._wait_event.record()
                    step.event = self._wait_event

        if grammar is not None and prev is not None:
            step.pending = draw  # the bitmask needs prev's tokens: LaunchedStep.finish draws
        else:
            draw()

    def _copy_tokens_behind(self, step: LaunchedStep, side: int) -> None:
        host, event = self._host_tokens[side], self._events[side]
        if host is None or event is None or step.row_tokens is None:
            return
        n = int(step.row_tokens.shape[0])
        host[:n].copy_(step.row_tokens[:n], non_blocking=True)
        event.record()
        step.host, step.event = host[:n], event
