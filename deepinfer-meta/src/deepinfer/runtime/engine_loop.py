"""The thin Python serving loop over the C++ engine.

One step: the engine schedules, builds the model inputs and the sampler inputs; Python runs the
model and the sampler, hands the tokens back, and detokenizes the request outputs the engine
builds (finishing sequences whose text reached a stop string).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deepinfer.runtime.cuda_graph_runner import greedy_tokens
from deepinfer.runtime.detokenizer import IncrementalDetokenizer, decode_completion
from deepinfer.runtime.model_runner import ModelRunner
from deepinfer.runtime.sampler import prompt_logprobs, sample
from deepinfer.runtime.sampler_inputs import PenaltyTables, sampling_batch_from_engine
from deepinfer.runtime.sampling_params import SamplingParams
from deepinfer.runtime.step_buffers import StepBuffers


@dataclass
class EngineConfig:
    """Scheduler and input-buffer sizes of an EngineLoop."""

    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    vocab_size: int
    eos_token_id: int
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    seed: int = 0
    graph_batch_sizes: list[int] | None = None  # decode-only steps are padded to these (CUDA graphs)


@dataclass
class _RequestState:
    params: SamplingParams
    prompt_ids: list[int]
    detok: dict[int, IncrementalDetokenizer]  # by completion index
    seen: dict[int, int]  # tokens already detokenized, by completion index
    delta: bool = False  # outputs carry only new tokens; text gets only new characters
    final_text_only: bool = False  # decode once when a sample finishes (no stop strings to watch)


class EngineLoop:
    """Drives ``deepinfer._C.engine`` step by step for one ModelRunner and tokenizer."""

    def __init__(self, runner: ModelRunner, tokenizer: Any, cfg: EngineConfig,
                 extra_stop_token_ids: list[int] | None = None) -> None:
        from deepinfer._C import engine

        E: Any = engine  # the native module (its stub may lag behind the build)
        self._E = E
        self.runner, self.tokenizer, self.cfg = runner, tokenizer, cfg
        self.extra_stop_token_ids = list(extra_stop_token_ids or [])
        self.scheduler = E.Scheduler(
            block_size=cfg.block_size, num_blocks=cfg.num_blocks, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=cfg.max_model_len,
            vocab_size=cfg.vocab_size, eos_token_id=cfg.eos_token_id if cfg.eos_token_id >= 0 else None,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
            enable_prefix_caching=cfg.enable_prefix_caching)
        t = max(cfg.max_num_batched_tokens, cfg.max_num_seqs)
        s = cfg.max_num_seqs
        w = (cfg.max_model_len + cfg.block_size - 1) // cfg.block_size
        # One host allocation (pinned on CUDA: a replayed decode step copies it up in one go).
        self.step_buffers = StepBuffers(t, s, w, pin=runner.device.type == "cuda")
        self.buffers: dict[str, np.ndarray] = self.step_buffers.arrays
        self.args = E.PrepareArgs(block_size=cfg.block_size, max_model_len=cfg.max_model_len,
                                  graph_batch_sizes=cfg.graph_batch_sizes, **self.buffers)
        self.metadata = E.SequenceMetadataPool()
        self.sampler_inputs = E.SamplerInputs(cfg.seed)
        self.penalty_tables = PenaltyTables(runner.device)  # fed by sampler_inputs, step by step
        self.output_pool = E.RequestOutputPool(4 * cfg.max_num_seqs)
        self.requests: dict[str, _RequestState] = {}
        # Outputs kept for their owner (a stream, a generate call): whichever caller runs a step,
        # each output lands in its request's queue, so several drivers never lose each other's.
        self._queues: dict[str, deque[Any]] = {}
        self._final_only: set[str] = set()  # queue only the finished output of these
        self._ids = itertools.count()
        self.num_steps = 0

    # ---- requests ---------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    output_kind: str = "cumulative", final_text_only: bool = False,
                    collect: str | None = None) -> None:
        """Queue a request; ValueError (naming the problem) leaves the engine unchanged.

        ``final_text_only``: fill ``text`` only when a sample finishes (one decode instead of one
        per token); ignored when the request has stop strings or ``output_kind`` is "delta".
        ``collect``: also keep the request's outputs in its own queue, whoever runs the steps —
        "all" (every output, read with ``next_output``) or "final" (only the finished one, read
        with ``pop_output``); None: outputs are only returned by the ``step`` that makes them.
        """
        if collect not in (None, "all", "final"):
            raise ValueError(f"collect must be None, 'all' or 'final', got {collect!r}")
        if request_id in self.requests or request_id in self._queues:
            raise ValueError(f"request {request_id!r} is already in the engine")
        if len(prompt_ids) == 0:
            raise ValueError(f"request {request_id!r}: the prompt is empty (no tokens)")
        params.check_vocab(self.cfg.vocab_size)
        stop_ids = sorted(set(params.stop_token_ids or []) | set(self.extra_stop_token_ids))
        # Only the finished output is wanted and no text is watched: the engine then builds no
        # per-step outputs for the request (per-step Python work that a GPU step cannot hide).
        quiet = (collect == "final" and final_text_only and output_kind == "cumulative"
                 and not params.stop_strings)
        self.scheduler.add_request(
            request_id, np.asarray(prompt_ids, dtype=np.int32), arrival_time=time.time(),
            n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            min_p=params.min_p, presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty, repetition_penalty=params.repetition_penalty,
            seed=params.seed, stop_token_ids=stop_ids, ignore_eos=params.ignore_eos,
            max_tokens=params.max_tokens, min_tokens=params.min_tokens,
            logprobs=params.logprobs, prompt_logprobs=params.prompt_logprobs,
            logit_bias=dict(params.logit_bias or {}), output_kind="final_only" if quiet else output_kind)
        delta = output_kind == "delta"
        self.requests[request_id] = _RequestState(params, list(prompt_ids), {}, {}, delta,
                                                  final_text_only and not delta and not params.stop_strings)
        if collect is not None:
            self._queues[request_id] = deque()
            if collect == "final":
                self._final_only.add(request_id)

    def abort(self, request_id: str) -> None:
        """Abort an unfinished request (its next output reports finish_reason 'abort')."""
        if request_id in self.requests:
            try:
                self.scheduler.abort_request(request_id)
            except ValueError:  # already finished and released by the engine
                self.requests.pop(request_id, None)

    def release(self, request_id: str) -> None:
        """The owner of a collected request is gone: abort it (its KV blocks are freed now) and
        drop its queue and every output still to come."""
        self._queues.pop(request_id, None)
        self._final_only.discard(request_id)
        self.abort(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- collected outputs ------------------------------------------------------------------
    def pop_output(self, request_id: str) -> Any | None:
        """The oldest queued output of a collected request, or None when none is queued (no step
        is run). After its finished output is taken the request's queue is gone."""
        q = self._queues.get(request_id)
        if q is None:
            raise ValueError(f"request {request_id!r} has no output queue (not added with collect=, "
                             "already finished and taken, or released)")
        if not q:
            return None
        ro = q.popleft()
        if ro.finished:
            del self._queues[request_id]
            self._final_only.discard(request_id)
        return ro

    def next_output(self, request_id: str) -> Any:
        """The next output of a collected request, running engine steps (which advance every
        request) while none is queued; ValueError as in ``pop_output``."""
        self.wait_for_outputs([request_id])
        return self.pop_output(request_id)

    def wait_for_outputs(self, request_ids: list[str]) -> None:
        """Run steps until one of the collected ``request_ids`` has a queued output.

        RuntimeError if the engine has nothing left to run and still none came (a lost output
        would otherwise spin here forever)."""
        queues = []
        for rid in request_ids:
            q = self._queues.get(rid)
            if q is None:
                raise ValueError(f"request {rid!r} has no output queue (not added with collect=, "
                                 "already finished and taken, or released)")
            queues.append(q)
        idle = 0
        while not any(queues):
            outputs = self.step()
            idle = 0 if outputs or self.scheduler.num_unfinished_requests else idle + 1
            if idle > 1:
                raise RuntimeError(f"the engine has no work left but requests {request_ids[:4]} got no output")

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[Any]:
        """Run one engine step; returns the RequestOutputs updated by it (text filled in)."""
        E, runner = self._E, self.runner
        out = self.scheduler.schedule()
        self.num_steps += 1
        copies = np.asarray(out.blocks_to_copy).reshape(-1, 2)
        if len(copies):
            runner.copy_blocks(copies[:, 0], copies[:, 1])
        self.metadata.build(self.scheduler)
        if len(self.metadata):
            decode = out.num_decodes == len(self.metadata)
            if decode:
                n_tokens = E.prepare_decode_v4(self.args, self.metadata)
            else:
                n_tokens = E.prepare_prompt_v4(self.args, self.metadata)
            self._run_model(n_tokens, decode)
        else:
            self.scheduler.update(np.zeros(0, np.int32))
        return self._collect_outputs()

    def _run_model(self, n_tokens: int, decode: bool = False) -> None:
        E, b, args = self._E, self.buffers, self.args
        si = E.prepare_sampler_inputs(args, self.metadata, self.sampler_inputs)
        graphs = self.runner.graphs
        if decode and graphs is not None and graphs.can_replay(args):
            logits, greedy = graphs.replay(args.num_rows)
            tokens = greedy_tokens(si, greedy, self.penalty_tables)
            if tokens is not None:
                self.scheduler.update(tokens)
                return
            self._sample(si, logits)
            return
        n_seqs = args.num_seqs if args.num_rows == 0 else args.num_rows
        logits = self.runner.execute(
            input_ids=b["input_ids"][:n_tokens], positions=b["positions"][:n_tokens],
            slot_mapping=b["slot_mapping"][:n_tokens], query_start_loc=b["query_start_loc"][:n_seqs + 1],
            seq_lens=b["seq_lens"][:n_seqs], block_tables=b["block_tables"][:n_seqs],
            logits_indices=b["logits_indices"][:args.num_logits])
        pl = si.prompt_logprobs
        if pl.num_rows:
            rows = torch.from_numpy(np.array(pl.logits_rows, dtype=np.int64)).to(logits.device)
            k = max(int(pl.max_num_logprobs), 0)
            targets = torch.from_numpy(np.array(pl.target_token_ids)).to(logits.device)
            lp, ids, vals = prompt_logprobs(logits[rows], targets, k)
            E.update_prompt_logprobs(self.scheduler, si, lp.cpu().numpy(),
                                     None if ids is None else ids.to(torch.int32).cpu().numpy(),
                                     None if vals is None else vals.cpu().numpy())
        self._sample(si, logits)

    def _sample(self, si: Any, logits: torch.Tensor) -> None:
        rows, batch = sampling_batch_from_engine(si, logits.device, self.penalty_tables)
        res = sample(logits[rows], batch)
        real = si.driver.num_real_rows
        tokens = res.tokens[:real].to(torch.int32).cpu().numpy()
        if res.logprobs is None:
            self.scheduler.update(tokens)
        else:
            self.scheduler.update(
                tokens, res.logprobs[:real].cpu().numpy(),
                None if res.topk_ids is None else res.topk_ids[:real].to(torch.int32).cpu().numpy(),
                None if res.topk_logprobs is None else res.topk_logprobs[:real].cpu().numpy())

    # ---- outputs ----------------------------------------------------------------------------
    def _detokenizer(self, state: _RequestState, index: int) -> IncrementalDetokenizer:
        d = state.detok.get(index)
        if d is None:
            p = state.params
            d = state.detok[index] = IncrementalDetokenizer(
                self.tokenizer, state.prompt_ids, skip_special_tokens=p.skip_special_tokens,
                stop=p.stop_strings, include_stop_str_in_output=p.include_stop_str_in_output)
            state.seen[index] = 0
        return d

    def _seq_id(self, request_id: str, index: int) -> int:
        # Only on a stop-string hit (rare): find the sample's live sequence.
        for seq in self.scheduler.get_sequences(request_id):
            if seq.sample_index == index:
                return int(seq.seq_id)
        raise RuntimeError(f"request {request_id!r} has no live sample {index}")

    def _collect_outputs(self) -> list[Any]:
        outputs = list(self._E.build_request_outputs(self.scheduler, self.output_pool))
        stopped = False
        for ro in outputs:
            state = self.requests.get(ro.request_id)
            if state is None or state.final_text_only:
                continue
            for c in ro.outputs:
                d = self._detokenizer(state, c.index)
                ids = list(c.token_ids)
                new = ids if state.delta else ids[state.seen[c.index]:]
                state.seen[c.index] += len(new)
                # A stop string completed by the max_tokens token still wins over "length": it
                # ends the text first (the engine then reports "stop", as vLLM does).
                if new and not d.finished and d.append(new) is not None and c.finish_reason in (None, "length"):
                    self.scheduler.stop_sequence(self._seq_id(ro.request_id, c.index), d.stop_reason,
                                                 d.num_output_tokens)
                    stopped = True
        if stopped:  # the engine re-reports the groups a stop string finished
            again = {ro.request_id: ro for ro in self._E.build_request_outputs(self.scheduler, self.output_pool)}
            outputs = [again.get(ro.request_id, ro) for ro in outputs]
        for ro in outputs:
            state = self.requests.get(ro.request_id)
            if state is None:
                continue
            for c in ro.outputs:
                if state.final_text_only:
                    if c.finish_reason is not None:
                        c.text = decode_completion(self.tokenizer, state.prompt_ids, list(c.token_ids),
                                                   state.params.skip_special_tokens)
                    continue
                d = self._detokenizer(state, c.index)
                if c.finish_reason is not None:
                    d.finish()
                c.text = d.take_delta() if state.delta else d.text
            if ro.finished:
                del self.requests[ro.request_id]
        for ro in outputs:
            q = self._queues.get(ro.request_id)
            if q is not None and (ro.finished or ro.request_id not in self._final_only):
                q.append(ro)
        return outputs
