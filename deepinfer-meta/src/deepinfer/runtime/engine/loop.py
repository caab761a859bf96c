"""The thin Python serving loop over the C++ engine.

One step: the engine schedules, builds the model inputs and the sampler inputs; Python runs the
model and the sampler, hands the tokens back, and detokenizes the request outputs the engine
builds (finishing sequences whose text reached a stop string).

Threads: every public method may be called from any thread. One lock (granted in arrival order)
is held while a step runs and while requests are added, aborted or their outputs taken; each
step's outputs go to their request's queue, so whichever thread runs a step serves every waiting
caller.

Failures: an exception while a step is in flight (before the model, inside it, in the sampler)
abandons the step (``Scheduler.abandon_step``): its requests fail with that exception (or, with
``retry_failed_steps``, are recomputed once), a KeyboardInterrupt puts them back for recompute
and is re-raised to the caller, which aborts its own requests. An exception while one request's
output is built fails that request only. The loop stays usable in every case.

Every step is launched by the one step executor (``engine.executor``: inputs, graph or eager,
greedy or sampled, penalties). Overlap (``overlap_scheduling``, ``engine.overlap``): in steady
decode a step returns while the next one runs on the device; a failure before a step's tokens
are applied abandons both steps in flight, as above.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any

import numpy as np

from deepinfer.runtime.engine.detokenizer import (
    IncrementalDetokenizer,
    decode_completion,
    text_token_ids,
)
from deepinfer.runtime.engine.executor import StepExecutor, StepShape
from deepinfer.runtime.engine.full_logprobs import RowStore, WholeVocabOutput
from deepinfer.runtime.engine.overlap import Overlap
from deepinfer.runtime.interrupts import sigint_deferred as _sigint_deferred
from deepinfer.runtime.sampling_params import SamplingParams
from deepinfer.runtime.structured.manager import StructuredOutputs
from deepinfer.runtime.worker.model_runner import ModelRunner
from deepinfer.runtime.worker.step_buffers import StepBuffers

_log = logging.getLogger(__name__)


class FairRLock:
    """A reentrant lock granted in arrival order.

    ``threading.RLock`` lets a thread that steps in a loop (release, re-acquire) starve the
    threads waiting to add or abort requests; here a released lock goes to the oldest waiter.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.RLock())
        self._owner: int | None = None
        self._depth = 0
        self._waiting: deque[object] = deque()

    def acquire(self, blocking: bool = True) -> bool:
        me = threading.get_ident()
        with self._cv:
            if self._owner == me:
                self._depth += 1
                return True
            if self._owner is None and not self._waiting:
                self._owner, self._depth = me, 1
                return True
            if not blocking:
                return False
            ticket = object()
            self._waiting.append(ticket)
            try:
                while self._owner is not None or self._waiting[0] is not ticket:
                    self._cv.wait()
            except BaseException:  # e.g. KeyboardInterrupt while waiting: give the turn up
                self._waiting.remove(ticket)
                self._cv.notify_all()
                raise
            self._waiting.popleft()
            self._owner, self._depth = me, 1
            return True

    def release(self) -> None:
        with self._cv:
            if self._owner != threading.get_ident():
                raise RuntimeError("FairRLock.release: the lock is not held by this thread")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cv.notify_all()

    def held_by_me(self) -> bool:
        return self._owner == threading.get_ident()

    def __enter__(self) -> FairRLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass
class _Failure:
    """Queued in place of an output: the request failed; taking it raises ``error``."""

    error: BaseException


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
    scheduling_policy: str = "fcfs"  # or "priority": smaller add_request priority first (vLLM)
    logprobs_mode: str = "raw_logprobs"  # what sampled tokens' logprobs report (EngineArgs.logprobs_mode)


@dataclass
class _RequestState:
    params: SamplingParams
    prompt_ids: list[int]
    detok: dict[int, IncrementalDetokenizer]  # by completion index
    seen: dict[int, int]  # tokens already detokenized, by completion index
    delta: bool = False  # outputs carry only new tokens; text gets only new characters
    final_text_only: bool = False  # decode once when a sample finishes (no stop strings to watch)
    detokenize: bool = True  # False: no text at all (SamplingParams.detokenize)
    retried: bool = False  # its step failed once and it was put back for recompute
    full: RowStore | None = None  # whole-vocabulary logprob rows (logprobs / prompt_logprobs = -1)
    columnar: bool = False  # its plain deltas are rows of take_columns (add_request columns_slot)


class EngineLoop:
    """Drives ``deepinfer._C.engine`` step by step for one ModelRunner and tokenizer."""

    def __init__(self, runner: ModelRunner, tokenizer: Any, cfg: EngineConfig,
                 extra_stop_token_ids: list[int] | None = None, retry_failed_steps: bool = False,
                 overlap_scheduling: bool = False, step_buffers: StepBuffers | None = None,
                 speculative_config: Any = None, logits_processors: Any = (), draft_runner: Any = None) -> None:
        """``step_buffers``: the host buffers the engine writes each step into (the worker's, which
        its CUDA graphs are captured over); None: the loop allocates them. ``speculative_config``:
        speculative decoding (a dict, JSON string or SpeculativeConfig; None: off).
        ``draft_runner``: (method "draft_model") the draft model's ModelRunner, whose KV cache has
        this runner's block count and block size (``Worker`` builds both).
        ``logits_processors``: vLLM v1 ``LogitsProcessor`` classes or their names
        (``sampling.logits_processors``); with any, steps run synchronously."""
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
            enable_prefix_caching=cfg.enable_prefix_caching, policy=cfg.scheduling_policy)
        # The one step executor: builds each step's inputs, runs the model (graph or eager) and
        # picks its tokens (greedy or sampled), for the synchronous and the overlap loop alike.
        # Its first host buffer set is pinned on CUDA: a replayed decode step copies it up in one go.
        self.executor = StepExecutor(
            runner, self.scheduler,
            StepShape(block_size=cfg.block_size, max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
                      max_num_batched_tokens=cfg.max_num_batched_tokens, seed=cfg.seed,
                      graph_batch_sizes=cfg.graph_batch_sizes, logprobs_mode=cfg.logprobs_mode),
            buffer_sets=2 if overlap_scheduling else 1, step_buffers=step_buffers)
        self.step_buffers = self.executor.buffers[0]  # what the CUDA graphs are captured over
        self.output_pool = E.RequestOutputPool(4 * cfg.max_num_seqs)
        self.requests: dict[str, _RequestState] = {}
        # Outputs kept for their owner (a stream, a generate call): whichever caller runs a step,
        # each output lands in its request's queue, so several drivers never lose each other's.
        self._queues: dict[str, deque[Any]] = {}
        self._final_only: set[str] = set()  # queue only the finished output of these
        # The ids whose queue got an output since ``take_outputs`` last looked (in order): it walks
        # these, not every request a server has live (~0.3 us a token at 256 streams, most of
        # whose tokens travel as columns and queue nothing). Only ids that still have a queue:
        # ``_drop_queue`` removes both, so callers that never take_outputs (generate) leave none.
        self._queued: dict[str, None] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        # A step that raised: recompute its requests once before failing them (else fail now).
        self.retry_failed_steps = retry_failed_steps
        self.lock = FairRLock()
        self._in_step = False
        self._pending_releases: deque[str] = deque()  # released where the lock was not free
        self._after_launch: Callable[[], None] | None = None  # step()'s, until it ran
        self._after_launch_error: BaseException | None = None
        # ZOS: decode steps launched ahead of the previous step's tokens (None: synchronous loop).
        self.overlap = Overlap() if overlap_scheduling else None
        # ---- speculative decoding (runtime.speculative): every step verifies the drafts the
        # scheduler carries and applies them with process_MTPInfo; such steps run synchronously.
        # The overlap loop runs plain decode steps (no drafts) ahead as without speculation while
        # no sequence is expected to draft (``_ahead_without_drafts``).
        from deepinfer.runtime.speculative.config import parse_speculative_config

        self.speculative_config = parse_speculative_config(speculative_config)
        self.speculator: Any = None
        if self.speculative_config is not None and cfg.logprobs_mode != "raw_logprobs":
            raise ValueError(f"logprobs_mode={cfg.logprobs_mode!r} does not run with speculative decoding yet")
        self.draft_runner = draft_runner
        if self.speculative_config is not None:
            from deepinfer.runtime.speculative.speculator import Speculator

            def params_of(request_id: str) -> Any:
                state = self.requests.get(request_id)
                return None if state is None else state.params

            draft = None
            if self.speculative_config.method == "draft_model":
                from deepinfer.runtime.speculative.draft_model import DraftModel

                if draft_runner is None:
                    raise ValueError("speculative_config method 'draft_model' needs the draft model's runner "
                                     "(LLM builds it from speculative_config['model'])")
                if (draft_runner.num_blocks, draft_runner.block_size) != (cfg.num_blocks, cfg.block_size):
                    raise ValueError(f"the draft runner's KV cache ({draft_runner.num_blocks} blocks of "
                                     f"{draft_runner.block_size}) must match the target's ({cfg.num_blocks} of "
                                     f"{cfg.block_size}): both are indexed by the same block tables")
                draft = DraftModel(draft_runner, self.speculative_config.num_speculative_tokens)
            self.speculator = Speculator(self.speculative_config, params_of, seed=cfg.seed, device=runner.device,
                                         draft=draft)
            self.executor.speculator = self.speculator
        if hasattr(runner, "native_verify_tokens"):  # CPU: verify steps on the native kernels
            runner.native_verify_tokens = 0 if self.speculative_config is None else \
                self.speculative_config.num_speculative_tokens + 1
        # Structured outputs: the grammar state of structured requests (compiler built on first use).
        self.structured = StructuredOutputs(self._grammar_compiler, runner.device)
        self.executor.structured = self.structured
        # Prompts given as embeddings, by request id (the executor reads the same dict).
        self.prompt_embeds: dict[str, Any] = self.executor.prompt_embeds
        self.executor.full_sink = self._take_full_rows  # whole-vocabulary logprob rows, to their request
        # Custom logits processors (vLLM's v1 interface): built once here, run on every step.
        self.logits_processor_classes = tuple(logits_processors or ())
        self.logits_processors: Any = None
        if self.logits_processor_classes and self.speculator is not None:  # verify steps would skip them
            raise ValueError("logits_processors do not run with speculative decoding yet: drop speculative_config "
                             "or logits_processors")
        if self.logits_processor_classes:
            from deepinfer.runtime.sampling.logits_processors import (
                LogitsProcessors,
                processor_config,
            )

            def request_of(request_id: str) -> Any:
                state = self.requests.get(request_id)
                return None if state is None else (state.params, state.prompt_ids)

            config = processor_config(cfg.max_num_seqs, cfg.max_model_len, cfg.vocab_size, None)
            self.logits_processors = LogitsProcessors(self.logits_processor_classes, config, runner.device,
                                                      request_of)
            self.executor.logits_processors = self.logits_processors
            self.overlap = None  # update_state must see each step's tokens before the next step

    def _grammar_compiler(self) -> Any:
        from deepinfer.runtime.structured.backend import GrammarCompiler

        stops = ([self.cfg.eos_token_id] if self.cfg.eos_token_id >= 0 else []) + self.extra_stop_token_ids
        return GrammarCompiler(self.tokenizer, self.cfg.vocab_size, stops)

    def fresh(self) -> EngineLoop:
        """A new loop with no request over the same runner, tokenizer, configuration and step
        buffers (which the CUDA graphs replay from): what a server takes after a step this loop
        could not abandon (``stuck``)."""
        return EngineLoop(self.runner, self.tokenizer, self.cfg, extra_stop_token_ids=self.extra_stop_token_ids,
                          retry_failed_steps=self.retry_failed_steps, overlap_scheduling=self.overlap is not None,
                          step_buffers=self.step_buffers, speculative_config=self.speculative_config,
                          logits_processors=self.logits_processor_classes,
                          draft_runner=self.draft_runner)

    # ---- requests ---------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    output_kind: str = "cumulative", final_text_only: bool = False,
                    collect: str | None = None, priority: int = 0, prompt_embeds: Any = None,
                    columns_slot: int | None = None, cache_salt: str | None = None) -> None:
        """Queue a request; ValueError (naming the problem) leaves the engine unchanged.

        ``prompt_embeds``: the prompt as embeddings [len(prompt_ids), hidden] (checked by
        ``engine.prompt_embeds.check_prompt_embeds``); ``prompt_ids`` are then its placeholder
        ids (``placeholder_ids``), which only schedule it.

        ``final_text_only``: fill ``text`` only when a sample finishes (one decode instead of one
        per token); ignored when the request has stop strings or ``output_kind`` is "delta".
        ``collect``: also keep the request's outputs in its own queue, whoever runs the steps —
        "all" (every output, read with ``next_output``) or "final" (only the finished one, read
        with ``pop_output``); None: outputs are only returned by the ``step`` that makes them.
        ``priority``: smaller is scheduled first under the "priority" scheduling policy.
        ``cache_salt`` (vLLM's): the request shares prefix-cached KV only with requests of the
        same salt (``Scheduler.add_request``); None: the shared cache.
        ``columns_slot``: (output_kind "delta", collect "all", ``detokenize=False``) the request's
        plain deltas — one sample, no logprobs, after its first output, not finished — are not
        queued as RequestOutputs but written as rows naming this slot, read with ``take_columns``
        (a server's engine core then handles a step's tokens without an object per request).
        """
        if collect not in (None, "all", "final"):
            raise ValueError(f"collect must be None, 'all' or 'final', got {collect!r}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        if columns_slot is not None:
            if isinstance(columns_slot, bool) or not isinstance(columns_slot, int):
                raise TypeError(f"columns_slot must be an int or None, got {type(columns_slot).__name__}")
            if not 0 <= columns_slot < 2**31:
                raise ValueError(f"columns_slot must be in [0, 2**31 - 1], got {columns_slot}")
            if output_kind != "delta" or collect != "all" or params.detokenize:
                raise ValueError("columns_slot needs output_kind='delta', collect='all' and "
                                 "SamplingParams.detokenize=False (rows carry token ids only)")
        with self.lock:
            self._release_pending()
            self._add_request(request_id, prompt_ids, params, output_kind, final_text_only, collect, priority,
                              prompt_embeds, cache_salt)
            if columns_slot is not None:
                self.output_pool.discard_columnar(request_id)  # (a finished request of that id left none)
                self.output_pool.add_columnar(request_id, columns_slot)
                self.requests[request_id].columnar = True

    def _add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     output_kind: str, final_text_only: bool, collect: str | None, priority: int = 0,
                     prompt_embeds: Any = None, cache_salt: str | None = None) -> None:
        if request_id in self.requests or request_id in self._queues:
            raise ValueError(f"request {request_id!r} is already in the engine")
        if len(prompt_ids) == 0:
            raise ValueError(f"request {request_id!r}: the prompt is empty (no tokens)")
        if prompt_embeds is not None:
            self._check_embeds_request(prompt_ids, params, prompt_embeds)
        full = params.wants_all_logprobs or params.wants_all_prompt_logprobs
        if full and self.speculator is not None:  # verify steps report the engine's top-k only
            raise ValueError("SamplingParams.logprobs=-1 / prompt_logprobs=-1 does not run with speculative "
                             "decoding yet")
        params.check_vocab(self.cfg.vocab_size)
        params.check_text_needs()  # stop strings without detokenization (fields assigned after construction)
        structured = params.structured_outputs
        if structured is not None:
            if self.speculator is not None:  # verify steps sample without the grammar's mask
                raise ValueError("structured_outputs does not run with speculative decoding yet: use an LLM "
                                 "without speculative_config for structured requests")
            self.structured.check(structured)  # an invalid schema: ValueError, nothing added
        if self.logits_processors is not None:
            self.logits_processors.check(params)  # a processor's validate_params: ValueError
        # Only the finished output is wanted and no text is watched: the engine then builds no
        # per-step outputs for the request (per-step Python work that a GPU step cannot hide).
        quiet = (collect == "final" and final_text_only and output_kind == "cumulative"
                 and not params.stop_strings)
        # the engine's SamplingParams, with the model's extra EOS ids, the effective temperature
        # and the bad words as token ids
        salted = {} if cache_salt is None else {"cache_salt": cache_salt}
        self.scheduler.add_request(
            request_id, np.asarray(prompt_ids, dtype=np.int32),
            params.engine_params(self.tokenizer, self.extra_stop_token_ids), arrival_time=time.time(),
            output_kind="final_only" if quiet else output_kind, priority=priority, **salted)
        delta = output_kind == "delta"
        if structured is not None:
            self.structured.add(request_id, structured, len(prompt_ids))
        if self.overlap is not None:
            self.overlap.track(request_id, params)
        if prompt_embeds is not None:
            self.prompt_embeds[request_id] = prompt_embeds.to(self.runner.device)
        if params.wants_all_logprobs:
            self.executor.full_output.add(request_id)
        if params.wants_all_prompt_logprobs:
            self.executor.full_prompt.add(request_id)
        # an embeddings prompt has no token ids: none give the detokenizer or processors context
        self.requests[request_id] = _RequestState(params, [] if prompt_embeds is not None else list(prompt_ids),
                                                  {}, {}, delta,
                                                  final_text_only and not delta and not params.stop_strings,
                                                  detokenize=params.detokenize, full=RowStore() if full else None)
        if collect is not None:
            self._queues[request_id] = deque()
            if collect == "final":
                self._final_only.add(request_id)

    def _take_full_rows(self, kind: str, keys: list[tuple[str, int]], rows: np.ndarray) -> None:
        """The executor's whole-vocabulary logprob rows: ``kind`` "output" (keys: request id,
        sample index; one row per token, in order) or "prompt" (keys: request id, position)."""
        for (rid, key), row in zip(keys, rows, strict=True):
            state = self.requests.get(rid)
            if state is None or state.full is None:
                continue  # finished or released meanwhile
            if kind == "output":
                state.full.add_output(key, row)
            else:
                state.full.prompt[key] = row

    def _check_embeds_request(self, prompt_ids: list[int], params: SamplingParams, embeds: Any) -> None:
        """ValueError for what an embeddings prompt cannot have: its positions have no token ids
        (nothing to score or penalise) and n-gram drafts would look up the placeholder ids."""
        if tuple(embeds.shape) != (len(prompt_ids), self.runner.model.config.hidden_size):
            raise ValueError(f"prompt_embeds has shape {tuple(embeds.shape)}, expected ({len(prompt_ids)}, "
                             f"{self.runner.model.config.hidden_size})")
        if self.speculator is not None:
            raise ValueError("prompt_embeds does not run with speculative decoding yet")
        if params.prompt_logprobs is not None:
            raise ValueError("SamplingParams.prompt_logprobs: an embeddings prompt has no token ids to score")
        if params.repetition_penalty != 1.0:
            raise ValueError("SamplingParams.repetition_penalty: not with an embeddings prompt (it has no token "
                             "ids to penalise); use frequency_penalty / presence_penalty, which count the output")

    def abort(self, request_id: str) -> None:
        """Abort an unfinished request (its next output reports finish_reason 'abort')."""
        with self.lock:
            self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        if request_id in self.requests:
            try:
                self.scheduler.abort_request(request_id)
            except ValueError:  # already finished and released by the engine
                self.requests.pop(request_id, None)

    def release(self, request_id: str) -> None:
        """The owner of a collected request is gone: abort it (its KV blocks are freed now) and
        drop its queue and every output still to come."""
        with self.lock:
            if self._in_step:  # e.g. a dropped stream collected while this thread runs a step
                self._pending_releases.append(request_id)
                return
            self._release(request_id)

    def release_soon(self, request_id: str) -> None:
        """``release`` that never waits (for ``__del__``): now if the lock is free, else at the
        start of the next step or call."""
        if self.lock.acquire(blocking=False):
            try:
                if not self._in_step:
                    self._release(request_id)
                    return
            finally:
                self.lock.release()
        self._pending_releases.append(request_id)

    def _release(self, request_id: str) -> None:
        self._drop_queue(request_id)
        self._abort(request_id)
        state = self.requests.pop(request_id, None)  # nobody reads it: its abort is reported to nobody
        if state is not None and state.columnar:
            self.output_pool.discard_columnar(request_id)

    def _release_pending(self) -> None:
        while self._pending_releases:
            self._release(self._pending_releases.popleft())

    def stats(self) -> dict[str, Any]:
        """``Scheduler.get_stats()`` plus, when speculating, the ``spec_decode_*`` totals (vLLM's
        names: num_drafts, num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos)."""
        st = dict(self.scheduler.get_stats())
        if self.speculator is not None:
            s = self.speculator.stats
            st.update(spec_decode_num_drafts=s.num_drafts, spec_decode_num_draft_tokens=s.num_draft_tokens,
                      spec_decode_num_accepted_tokens=s.num_accepted_tokens,
                      spec_decode_num_accepted_tokens_per_pos=list(s.accepted_per_pos))
        return st

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- collected outputs ------------------------------------------------------------------
    def pop_output(self, request_id: str) -> Any | None:
        """The oldest queued output of a collected request, or None when none is queued (no step
        is run). After its finished output is taken the request's queue is gone."""
        with self.lock:
            q = self._queues.get(request_id)
            if q is None:
                raise ValueError(f"request {request_id!r} has no output queue (not added with collect=, "
                                 "already finished and taken, or released)")
            if not q:
                return None
            ro = q.popleft()
            if isinstance(ro, _Failure) or ro.finished:
                self._drop_queue(request_id)
            if isinstance(ro, _Failure):
                raise ro.error
            return ro

    def take_outputs(self, request_ids: Container[str]) -> list[tuple[str, list[Any] | BaseException]]:
        """Every queued output of each collected request in ``request_ids``, under one lock: (id,
        its outputs in order) or (id, the error of its failed step), in the order the requests
        first queued one since the last call. Ids without a queue are skipped. The server's engine
        thread takes a whole step's outputs this way (``pop_output`` per request costs two lock
        round trips per request and step)."""
        taken: list[tuple[str, list[Any] | BaseException]] = []
        with self.lock:
            queued = self._queued
            for rid in list(queued):
                q = self._queues.get(rid)
                if not q:  # its outputs taken by pop_output meanwhile
                    del queued[rid]
                    continue
                if rid not in request_ids:  # another owner's: left queued for it
                    continue
                del queued[rid]
                outs: list[Any] = []
                item: list[Any] | BaseException = outs
                while q:
                    ro = q.popleft()
                    if isinstance(ro, _Failure) or ro.finished:
                        self._drop_queue(rid)
                        if isinstance(ro, _Failure):
                            item = ro.error
                        else:
                            outs.append(ro)
                        break
                    outs.append(ro)
                taken.append((rid, item))
        return taken

    def _drop_queue(self, request_id: str) -> None:
        """Forget ``request_id``'s output queue (its last output taken, or released)."""
        self._queues.pop(request_id, None)
        self._queued.pop(request_id, None)
        self._final_only.discard(request_id)

    def take_columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The rows of the ``columns_slot`` requests' plain deltas built since the last call, in
        build order: (slots int32[R], offsets int64[R + 1], token ids int32[T]); row r's new tokens
        are ``token_ids[offsets[r]:offsets[r + 1]]``. A caller that takes them after each step it
        runs sees them in order with the requests' queued RequestOutputs (a request's first and
        last outputs are queued; the rows are those in between)."""
        with self.lock:
            return self.output_pool.take_columns()  # type: ignore[no-any-return]

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
        while True:
            # The lock is released between steps: other threads add, abort and step too.
            with self.lock:
                if any(queues):
                    return
                outputs = self.step()
                idle = 0 if outputs or self.scheduler.num_unfinished_requests else idle + 1
                if idle > 1 and not any(queues):
                    raise RuntimeError(f"the engine has no work left but requests {request_ids[:4]} got no output")

    # ---- one step ---------------------------------------------------------------------------
    def step(self, after_launch: Callable[[], None] | None = None) -> list[Any]:
        """Run one engine step; returns the RequestOutputs updated by it (text filled in).

        With overlap scheduling a decode step may still run on the device when this returns (the
        next call applies it); the engine's scheduler then has a step in flight between calls.

        ``after_launch``: called once, as soon as this call has launched its work on the device
        and before it waits for the tokens, so that the caller's own work (``deepinfer serve``'s
        core sends the previous step's outputs) runs while the device computes; called at the end
        when the call launched nothing. It runs under the engine's lock: it may take outputs and
        columns; a ``release`` it makes waits for the next step. An exception it raises is raised
        here once the step has completed.

        A request that fails in this step (see the module docstring) gets its error in its queue
        (raised by ``pop_output`` / ``next_output``); the error is raised here too when a failed
        request has no queue, or when the step failed before any request was in it."""
        with self.lock:
            self._release_pending()
            self._in_step = True
            self._after_launch = after_launch
            failed = True
            try:
                outputs = self._step()
                failed = False
            finally:
                self._in_step = False
                self._launched()  # (not called yet: nothing was launched, or the step failed first)
                hook_error, self._after_launch_error = self._after_launch_error, None
                if hook_error is not None and failed:  # (the step's own error is the one raised)
                    _log.error("step()'s after_launch failed too: %r", hook_error)
                if not self.scheduler.num_unfinished_requests:
                    self.runner.restore_torch_threads()
            if hook_error is not None:
                raise hook_error
            return outputs

    def _launched(self) -> None:
        """The step's work is on the device: run ``step``'s ``after_launch`` (once), keeping its
        exception for the end of the step (raised here, it would abandon a launched step)."""
        hook, self._after_launch = self._after_launch, None
        if hook is not None:
            try:
                hook()
            except BaseException as err:  # noqa: BLE001 - raised by step() once the step completed
                self._after_launch_error = err

    @property
    def stuck(self) -> bool:
        """A step awaits its tokens with nothing left to deliver them (after a failure the loop could
        not abandon); a step launched ahead by the overlap loop is not stuck."""
        return bool(self.scheduler.step_in_flight) and (self.overlap is None or self.overlap.in_flight is None)

    def _step(self) -> list[Any]:
        if self.structured.requests:
            self.structured.prune(self.requests)
        if self.logits_processors is not None:
            self.logits_processors.prune(self.requests)
        if self.prompt_embeds:
            for rid in [r for r in self.prompt_embeds if r not in self.requests]:
                del self.prompt_embeds[rid]
        for asked in (self.executor.full_output, self.executor.full_prompt):
            if asked:
                asked.intersection_update(self.requests)
        if self.overlap is not None:
            return self._step_overlapped(self.overlap)
        out = self.scheduler.schedule()
        self.num_steps += 1
        try:
            launched = self.executor.launch(out)
            self._launched()
            launched.apply(self.scheduler)
        except BaseException as err:  # noqa: BLE001 - re-raised by _abandon_step unless delivered
            self._abandon_step(err)
            return []
        return self._step_outputs(out)

    def _step_overlapped(self, ov: Overlap) -> list[Any]:
        """One step of the overlap loop: apply the decode step in flight (launching the next one
        ahead of its tokens when the scheduler allows it), or run a step synchronously."""
        launched = ov.in_flight
        ov.in_flight = None
        out = None if launched is None else launched.scheduled  # (request ids failed if outputs fail)
        try:
            if launched is None:
                out = self.scheduler.schedule()
                self.num_steps += 1
                # (speculative decoding: a verify step is no plain decode, it runs synchronously)
                if not ov.may_run_ahead(out, self.requests):
                    synchronous = self.executor.launch(out)
                    self._launched()
                    synchronous.apply(self.scheduler)
                    return self._step_outputs(out)
                launched = self.executor.launch(out, copy_ahead=True)
            ahead = self.scheduler.schedule(overlap=True) if ov.allowed(self.requests) and (
                self.speculator is None or self._ahead_without_drafts(launched)) else None
            if ahead is not None:
                out = ahead
                self.num_steps += 1
                ov.in_flight = self.executor.launch(ahead, launched, copy_ahead=True)
                ov.num_ahead += 1
            self._launched()
            launched.apply(self.scheduler)
            if ov.in_flight is not None:
                ov.in_flight.finish()  # a structured step ahead samples now that its bitmask can be built
        except BaseException as err:  # noqa: BLE001 - re-raised by _abandon_step unless delivered
            ov.in_flight = None
            self._abandon_step(err)  # both steps in flight, when one was launched ahead
            return []
        try:
            return self._step_outputs(out)
        finally:  # (also when building the outputs failed and its requests were failed)
            if ov.in_flight is not None and not self.scheduler.num_unfinished_requests:
                # Nothing runs on: apply the step ahead now (every row is ignored) so the loop is idle.
                launched, ov.in_flight = ov.in_flight, None
                try:
                    launched.apply(self.scheduler)
                except BaseException as err:  # noqa: BLE001
                    self._abandon_step(err)

    def _ahead_without_drafts(self, launched: Any) -> bool:
        """(speculating) Whether to schedule a step ahead of the plain decode step ``launched``.
        A step ahead carries no drafts (the scheduler places none while a step is in flight):
        when some sequence of ``launched`` is expected to draft next (``Speculator.expects_drafts``),
        ``launched`` is applied first (storing the drafts) and the next step, scheduled
        synchronously, verifies them."""
        if launched.redraft is None:  # nothing ran (every request was aborted)
            return True
        return not self.speculator.expects_drafts(self.scheduler, launched.redraft[1])

    def _step_outputs(self, out: Any) -> list[Any]:
        with _sigint_deferred():
            try:
                return self._collect_outputs()
            except BaseException as err:  # building outputs failed as a whole: fail the step's requests
                ids = [] if out is None else out.request_ids
                self._fail_requests([r for r in dict.fromkeys(ids) if r in self.requests], err)
                raise

    def _abandon_step(self, err: BaseException) -> None:
        """The step in flight raised ``err``: give its requests back or fail them, then re-raise
        ``err`` unless every failed request's owner will see it in its queue."""
        interrupted = not isinstance(err, Exception)
        retry = interrupted or self.retry_failed_steps
        ids = list(self.scheduler.abandon_step(action="recompute" if retry else "fail"))
        self.executor.reset_penalties()  # updates the tables never applied may have been sent
        if interrupted:
            raise err  # the requests run on; the interrupted caller aborts its own
        if retry:
            again = [r for r in ids if r in self.requests and self.requests[r].retried]
            for r in ids:
                if r in self.requests:
                    self.requests[r].retried = True
            if not again:
                _log.warning("engine step failed (%s: %s); its %d request(s) will be recomputed",
                             type(err).__name__, err, len(ids))
                return
            for r in again:
                self._abort(r)
            ids = again
        owned = self._fail_requests([r for r in ids if r in self.requests], err)
        if not ids or not owned:
            raise err

    def _fail_requests(self, request_ids: list[str], err: BaseException) -> bool:
        """Finish ``request_ids`` with ``err``: abort them if the engine still runs them, drop
        their state, queue the error for their owners. True when every one of them has an owner."""
        error = err if isinstance(err, Exception) else RuntimeError(
            f"the engine step was interrupted ({type(err).__name__}) while building outputs")
        owned = True
        for rid in request_ids:
            try:
                self.scheduler.abort_request(rid)
            except ValueError:  # the engine already finished it
                pass
            state = self.requests.pop(rid, None)
            if state is not None and state.columnar:
                self.output_pool.discard_columnar(rid)
            self._final_only.discard(rid)
            q = self._queues.get(rid)
            if q is None:
                owned = False
            else:
                q.append(_Failure(error))
                self._queued[rid] = None
        return owned

    # ---- outputs ----------------------------------------------------------------------------
    def _detokenizer(self, state: _RequestState, index: int) -> IncrementalDetokenizer:
        d = state.detok.get(index)
        if d is None:
            p = state.params
            d = state.detok[index] = IncrementalDetokenizer(
                self.tokenizer, state.prompt_ids, skip_special_tokens=p.skip_special_tokens,
                stop=p.stop_strings, include_stop_str_in_output=p.include_stop_str_in_output,
                min_tokens=p.min_tokens)
            state.seen[index] = 0
        return d

    def _seq_id(self, request_id: str, index: int) -> int:
        # Only on a stop-string hit (rare): find the sample's live sequence.
        for seq in self.scheduler.get_sequences(request_id):
            if seq.sample_index == index:
                return int(seq.seq_id)
        raise RuntimeError(f"request {request_id!r} has no live sample {index}")

    @staticmethod
    def _text_ids(state: _RequestState, c: Any, ids: list[int]) -> list[int]:
        return text_token_ids(ids, c.finish_reason, c.stop_reason, state.params.include_stop_str_in_output)

    def _watch_stop_strings(self, ro: Any, state: _RequestState) -> None:
        """Feed one output's new tokens to its detokenizers; a stop string found ends its sample
        in the engine, which corrects ``ro`` in place (tokens cut, finish reason "stop")."""
        for c in list(ro.outputs):
            d = self._detokenizer(state, c.index)
            ids = list(c.token_ids)
            new = ids if state.delta else ids[state.seen[c.index]:]
            state.seen[c.index] += len(new)
            if d.finished:
                continue
            final = c.finish_reason is not None
            if final:
                new = self._text_ids(state, c, new)
            # A stop string completed by the max_tokens token still wins over "length": it
            # ends the text first (the engine then reports "stop", as vLLM does).
            if d.append(new, final=final) is not None and c.finish_reason in (None, "length"):
                self.scheduler.stop_sequence(self._seq_id(ro.request_id, c.index), d.stop_reason,
                                             d.num_output_tokens, output=ro)

    def _fill_text(self, ro: Any, state: _RequestState) -> None:
        if not state.detokenize:
            return  # token ids only: text stays empty
        for c in ro.outputs:
            if state.final_text_only:
                if c.finish_reason is not None:
                    c.text = decode_completion(self.tokenizer, state.prompt_ids,
                                               self._text_ids(state, c, list(c.token_ids)),
                                               state.params.skip_special_tokens)
                continue
            d = self._detokenizer(state, c.index)
            if c.finish_reason is not None:
                d.finish()
            c.text = d.take_delta() if state.delta else d.text

    def _collect_outputs(self) -> list[Any]:
        """The step's RequestOutputs with their text, each queued for its owner. An exception
        while one request's output is built fails that request only (its owner gets the error)."""
        outputs = list(self._E.build_request_outputs(self.scheduler, self.output_pool))
        # (each field read through pybind makes a new Python object: every output's id once)
        rids = [ro.request_id for ro in outputs]
        requests = self.requests
        failed: dict[str, Exception] = {}
        for ro, rid in zip(outputs, rids, strict=True):
            state = requests.get(rid)
            if state is None or state.final_text_only or not state.detokenize:
                continue
            try:
                self._watch_stop_strings(ro, state)
            except Exception as err:  # noqa: BLE001 - isolated to this request
                failed[rid] = err
        done = []
        queues, final_only, queued = self._queues, self._final_only, self._queued
        for ro, rid in zip(outputs, rids, strict=True):
            state = requests.get(rid)
            if rid in failed:
                continue
            if state is None:  # e.g. the abort of a released request: reported to nobody
                done.append(ro)
                continue
            try:
                if state.detokenize:
                    self._fill_text(ro, state)
                finished = ro.finished
                if state.full is not None and (finished or rid not in final_only):
                    ro = WholeVocabOutput(ro, state.full, state.params, state.prompt_ids, state.delta)
            except Exception as err:  # noqa: BLE001 - isolated to this request
                failed[rid] = err
                continue
            if finished:
                del requests[rid]  # (a columns_slot request: building this output unregistered it)
                self.structured.requests.pop(rid, None)
                self.prompt_embeds.pop(rid, None)
                self.executor.full_output.discard(rid)
                self.executor.full_prompt.discard(rid)
            q = queues.get(rid)
            if q is not None and (finished or rid not in final_only):
                q.append(ro)
                queued[rid] = None
            done.append(ro)
        if failed:
            first = next(iter(failed.values()))
            owned = all([self._fail_requests([rid], err) for rid, err in failed.items()])
            if not owned:
                raise first
        return done
