"""The one thread that owns the engine loop.

HTTP handlers never touch the engine: they put adds and aborts on a thread-safe queue, and the
engine thread takes them between steps, so an abort lands within one step. The thread steps
while any request is live, batching every request whatever HTTP request it came from, and hands
each step's outputs to the event loop in one ``call_soon_threadsafe`` per step, as plain Python
objects (the engine's pooled outputs never cross the thread boundary).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from deepinfer.runtime.sampling_params import SamplingParams
from deepinfer.serve.metrics import ServerMetrics

log = logging.getLogger("deepinfer.serve")


def embeds_to_wire(tensor: Any) -> list[Any]:
    """Prompt embeddings as msgpack carries them: [float32 bytes, shape]."""
    import torch

    t = tensor.detach().to("cpu", torch.float32).contiguous()
    return [t.numpy().tobytes(), list(t.shape)]


def embeds_from_wire(wire: Any) -> Any:
    """``embeds_to_wire``'s tensor back (ValueError when the bytes do not fill the shape)."""
    import torch

    data, shape = wire
    if not isinstance(data, bytes) or not isinstance(shape, list) or len(shape) != 2 \
            or len(data) != 4 * int(shape[0]) * int(shape[1]):
        raise ValueError("prompt_embeds: malformed message")
    return torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(int(shape[0]), int(shape[1]))


class SampleDelta(msgspec.Struct, array_like=True, gc=False):
    """What one step added to one sample (choice) of a request. (msgspec Structs, sent as
    arrays: a dataclass cost ~3x more to build and to encode, per request and step.)"""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None


class RequestDelta(msgspec.Struct, array_like=True, gc=False):
    """One step's output of one engine request."""

    tag: int  # which prompt of the HTTP request
    samples: list[SampleDelta]
    finished: bool
    # the prompt's logprobs (None at position 0), on the first output when asked for
    prompt_logprobs: list[dict[int, float] | None] | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (on the finished output)


def first_sample(delta: RequestDelta) -> SampleDelta:
    """The delta's sample 0; one with no tokens and no text is put first when it has none."""
    for s in delta.samples:
        if s.index == 0:
            return s
    s = SampleDelta(0, [], "", None, None, None)
    delta.samples.insert(0, s)
    return s


class RequestFailed(msgspec.Struct, array_like=True, gc=False):
    """The engine request cannot complete; ``status`` is the HTTP status to report."""

    tag: int
    status: int
    message: str


@dataclass
class _Live:
    sink: asyncio.Queue[Any]
    tag: int
    arrival: float  # time.monotonic() when the HTTP handler submitted it
    prompt_len: int
    n: int = 1
    max_tokens: int | None = None
    first_token: float | None = None
    last_token: float | None = None
    generated: int = 0
    reasons: dict[int, str] = field(default_factory=dict)
    # n == 1 without logprobs or prompt logprobs: a delta before the last one has one sample,
    # index 0, no finish or stop reason (_step's fast path reads only its token ids and text)
    plain: bool = False
    text: bool = True  # the engine fills in text (detokenize=False: always "")
    # >= 0: the engine writes its plain deltas as rows of its step's columns (``columnar``), and
    # its last token time and generated count live in the thread's arrays at this index
    slot: int = -1


def rebuild_if_stuck(llm: Any) -> bool:
    """After a step raised out of the engine loop: if its scheduler is still waiting for the
    step's tokens (a failure the loop could not abandon), give the LLM a fresh engine loop over
    the same model runner and KV cache and return True (every live request has failed)."""
    engine = llm.engine
    if not engine.stuck:  # (a decode step launched ahead by the overlap loop is not stuck)
        return False
    llm.engine = engine.fresh()
    return True


# An idle engine that receives a request keeps taking the requests that follow it within
# ``--arrival-gap-ms`` of each other, for at most this many gaps, before its first step: a burst
# of requests that reach the engine one by one (each parsed and sent by a front end in turn) is
# then prefilled in one step, not in a step of the first few and another of the rest. On the
# 2-core VM (default model, 16 clients x (32 + 32) tokens, `bench/serve_bench.py`, two rounds) a
# 3 ms gap took serve/generate from 0.816 / 0.839 to 0.885 / 0.912 (32 steps instead of 33, TTFT
# p50 ~80 ms lower), for ~2 ms more TTFT of a lone request (guide 10).
ARRIVAL_WINDOW_GAPS = 10
DEFAULT_CPU_ARRIVAL_GAP_MS = 3.0


def check_priority(priority: int, scheduling_policy: str | None) -> None:
    """ValueError, as vLLM's, for a nonzero ``priority`` under a policy other than "priority"
    (None: not known here, nothing to check)."""
    if priority and scheduling_policy is not None and scheduling_policy != "priority":
        raise ValueError("priority was given but priority scheduling is not enabled: start the server "
                         "with --scheduling-policy priority")


def arrival_gap_seconds(device_type: str, gap_ms: float | None) -> float:
    """``--arrival-gap-ms`` in seconds: the value given, else 3 ms on CPU (where a prompt step takes
    tens of milliseconds) and 0 elsewhere (on the H200, SmolLM2 at 64 clients, a 2 ms gap changed
    neither the step count nor the ratio beyond the runs' spread). A negative value is a
    ValueError naming the flag."""
    if gap_ms is None:
        gap_ms = DEFAULT_CPU_ARRIVAL_GAP_MS if device_type == "cpu" else 0.0
    if isinstance(gap_ms, bool) or not isinstance(gap_ms, (int, float)) or not gap_ms >= 0:
        raise ValueError(f"--arrival-gap-ms must be a number >= 0, got {gap_ms!r}")
    return float(gap_ms) / 1000.0


class EngineThread:
    """Owns ``llm.engine``: adds, aborts and steps happen on this thread only."""

    #: a subclass that takes a step's plain deltas as columns (``EngineLoop.take_columns``)
    #: implements ``_new_slot``, ``_free_slot``, ``_take_columns`` and the slot arrays
    columnar = False
    #: take and send a step's outputs while the next step runs on the device (``EngineLoop.step``'s
    #: ``after_launch``), not between the steps, where the device would wait for them
    defer_outputs = False

    def __init__(self, llm: Any, metrics: ServerMetrics, arrival_gap_s: float = 0.0) -> None:
        # an idle engine's first step waits while requests keep coming this close together
        # (``arrival_gap_seconds``)
        self.arrival_gap_s = arrival_gap_s
        self._llm = llm
        self._metrics = metrics
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # why the thread died, if it did
        self.num_steps = 0
        self._step_tokens = 0  # tokens of the step being taken apart (iteration_tokens_total)
        self._step_generated = 0  # its generated tokens (generation_tokens_total, one update a step)
        self._step_itl: list[float] = []  # its inter-token latencies (observed at its end)
        self._outputs_due = False  # (defer_outputs) the last step's outputs are not taken yet
        self._outputs_error: BaseException | None = None  # taking them raised (a bug): _run dies

    # ---- called from the event loop --------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def unhealthy_reason(self) -> str | None:
        """None while the engine serves; else why not (what /health reports)."""
        return None if self.alive else f"the engine loop is not running: {self.error!r}"

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               sink: asyncio.Queue[Any], tag: int, prompt_embeds: Any = None, priority: int = 0,
               cache_salt: str | None = None) -> None:
        """Queue a request; its RequestDelta / RequestFailed items arrive on ``sink``
        (``prompt_embeds``: the prompt's embeddings, ``prompt_ids`` its placeholder ids;
        ``priority``: the scheduler's, smaller first; ``cache_salt``: its prefix-cache salt)."""
        self._commands.put(("add", request_id, prompt_ids, params, sink, tag, time.monotonic(), prompt_embeds,
                            priority, cache_salt))

    def abort(self, request_id: str) -> None:
        """Abort a request at whatever stage it is (idempotent; unknown ids are ignored)."""
        self._commands.put(("abort", request_id))

    def stop(self, timeout: float = 30.0) -> None:
        """Abort every live request and end the thread."""
        self._commands.put(("stop",))
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._take_commands(block=not self._llm.engine.has_unfinished() and not self._outputs_due):
                if self._llm.engine.has_unfinished():
                    self._step()
                else:  # (aborts ended what ran: no step follows to send the last one's outputs)
                    self._take_due_outputs()
                if self._outputs_error is not None:  # (taking a step's outputs failed: a bug)
                    raise self._outputs_error
                self._flush()
        except BaseException as exc:
            self.error = exc
            log.exception("the engine thread died; /health reports 503 from now on")
            self._fail(list(self._live), 503, f"the engine stopped: {exc!r}")
        else:
            self._take_due_outputs()
            self._abort_all("the server is shutting down")
        self._flush()

    def _flush(self) -> None:
        """End of one loop turn: in-process, every output went to the event loop already."""

    def _take_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one when ``block``); False once told to stop."""
        try:
            cmd = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        aborted = False
        gap = self.arrival_gap_s if block else 0.0
        deadline = time.monotonic() + ARRIVAL_WINDOW_GAPS * gap
        while True:
            if cmd[0] == "stop":
                return False
            if cmd[0] == "add":
                self._add(*cmd[1:])
            else:
                aborted |= self._abort(cmd[1])
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                # an idle engine's first step waits while requests keep arriving (a burst)
                wait = min(gap, deadline - time.monotonic())
                if wait <= 0 or not self._llm.engine.has_unfinished():
                    break
                try:
                    cmd = self._commands.get(timeout=wait)
                except queue.Empty:
                    break
        if aborted:  # the blocks are free already: the gauges say so before the next step
            self._metrics.observe_engine(self._llm.engine.stats())
        return True

    def _add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
             sink: asyncio.Queue[Any], tag: int, arrival: float, prompt_embeds: Any = None, priority: int = 0,
             cache_salt: str | None = None) -> None:
        n = params.n
        plain = n == 1 and params.logprobs is None and params.prompt_logprobs is None
        # token ids only (a front end makes the text): its plain deltas can come as columns
        slot = self._new_slot(sink, request_id) if self.columnar and plain and not params.detokenize else -1
        try:
            if isinstance(prompt_embeds, list):  # from another process: embeds_to_wire's form
                prompt_embeds = embeds_from_wire(prompt_embeds)
            if priority:  # (the policy read only then: the engine's args are not needed otherwise)
                check_priority(priority, self._llm.engine_args.scheduling_policy)
            self._llm.engine.add_request(request_id, prompt_ids, params, output_kind="delta", collect="all",
                                         prompt_embeds=prompt_embeds, priority=priority,
                                         columns_slot=slot if slot >= 0 else None, cache_salt=cache_salt)
        except (ValueError, TypeError) as exc:
            if slot >= 0:
                self._free_slot(slot)
            self._deliver([(sink, RequestFailed(tag, 400, str(exc)))])
            return
        self._live[request_id] = _Live(sink, tag, arrival, len(prompt_ids), n, params.max_tokens,
                                       plain=plain, text=bool(params.detokenize), slot=slot)

    def _abort(self, request_id: str) -> bool:
        live = self._live.pop(request_id, None)
        if live is None:
            return False
        if live.slot >= 0:
            self._free_slot(live.slot)
        self._llm.engine.release(request_id)  # blocks are free now; its outputs are dropped
        self._metrics.finished["abort"].inc()
        return True

    def _abort_all(self, message: str) -> None:
        for rid in list(self._live):
            self._llm.engine.release(rid)
        self._fail(list(self._live), 503, message, reason="abort")

    def _fail(self, request_ids: list[str], status: int, message: str, reason: str = "error") -> None:
        batch = []
        for rid in request_ids:
            live = self._live.pop(rid, None)
            if live is not None:
                if live.slot >= 0:
                    self._free_slot(live.slot)
                batch.append((live.sink, RequestFailed(live.tag, status, message)))
                self._metrics.finished[reason].inc()
        self._deliver(batch)

    def _step(self) -> None:
        """One engine step, then every output (or failure) it queued for a live request.

        The engine loop abandons a step that raises: the requests of that step get the error in
        their queues (500 / an error event), the others run on. An error that leaves the loop
        (none of its requests could take it) is logged, and a scheduler left mid-step is
        rebuilt, failing every live request."""
        engine = self._llm.engine
        failed_step = False
        try:
            if self.defer_outputs:  # (the last step's outputs go once this one is on the device)
                engine.step(after_launch=self._take_due_outputs)
            else:
                engine.step()  # (its outputs are taken from their queues below)
        except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, not the server
            log.error("engine step failed: %r", exc)
            failed_step = True
            if rebuild_if_stuck(self._llm):
                self._metrics.engine_replaced()
                self._fail(list(self._live), 500, f"the engine step failed: {exc!r}")
                self._metrics.observe_engine(self._llm.engine.stats())
                return
        self.num_steps += 1
        if self._outputs_error is not None:  # (raised by _run)
            return
        if self.defer_outputs and not failed_step and engine.has_unfinished():
            self._outputs_due = True  # taken by the next step's after_launch (or _run, idle)
            return
        self._take_outputs(engine)

    def _take_due_outputs(self) -> None:
        """(``defer_outputs``) The last step's outputs, taken and sent: called by the engine once
        the next step is on the device (its ``after_launch``), or by the loop when no step
        follows. An exception is kept for ``_run`` to raise after the engine's step (raised into
        the engine, it would be taken for a failed step)."""
        if not self._outputs_due:
            return
        self._outputs_due = False
        try:
            self._take_outputs(self._llm.engine)
            self._flush()
        except BaseException as exc:  # noqa: BLE001 - raised by _step after the engine's step
            self._outputs_error = exc

    def _take_outputs(self, engine: Any) -> None:
        """Every output (or failure) the engine queued for a live request since the last call."""
        self._step_tokens = 0
        self._step_generated = 0
        itl = self._step_itl = []  # the step's inter-token latencies, observed at its end
        plain_new = 0  # tokens of the fast path's deltas
        now = time.monotonic()
        live_ids = self._live
        batch: list[tuple[asyncio.Queue[Any], Any]] = []
        failed: dict[str, str] = {}
        if self.columnar:  # the plain deltas, as columns (before the outputs queued in this step)
            plain_new += self._take_columns(engine, now, itl)
        # Every queued output of every live request (this step's, or the last of a request gone
        # from the engine: finished, failed) in one lock round trip; aborted requests are not live.
        for rid, taken in engine.take_outputs(live_ids):
            live = live_ids[rid]
            if isinstance(taken, BaseException):
                failed[rid] = f"the request failed: {type(taken).__name__}: {taken}"
                engine.release(rid)
                continue
            try:
                for ro in taken:
                    # The common delta (a plain request's, after its first token, not its last)
                    # reads only what it needs: at 256 streams every field read per request and
                    # step counts (~0.1-0.4 us each through pybind).
                    if live.plain and live.first_token is not None and live.slot < 0 and not ro.finished:
                        outs = ro.outputs
                        if outs:
                            c = outs[0]
                            ids = c.token_ids  # (a fresh list each read)
                            samples = [SampleDelta(0, ids, c.text if live.text else "", None, None, None)]
                            new = len(ids)
                            if new:
                                itl.append(now - (live.last_token or now))
                                live.last_token = now
                                live.generated += new
                                plain_new += new
                        else:
                            samples = []
                        batch.append((live.sink, RequestDelta(live.tag, samples, False)))
                        continue
                    delta = self._delta(ro, live, now)
                    batch.append((live.sink, delta))
                    if delta.finished:
                        del live_ids[rid]
                        if live.slot >= 0:
                            self._free_slot(live.slot)
                        break
            except Exception as exc:  # noqa: BLE001 - this request's failure only
                failed[rid] = f"the request failed: {type(exc).__name__}: {exc}"
                engine.release(rid)
        self._step_tokens += plain_new
        self._step_generated += plain_new
        if itl:
            self._observe_itl(itl)
        self._deliver(batch)
        for rid, message in failed.items():
            self._fail([rid], 500, message)
        if self._step_generated:  # one counter update per step, not one per request
            self._metrics.generation_tokens.inc(self._step_generated)
        # vLLM's iteration tokens: the prompts that got their first token in this step + the
        # tokens this step generated
        self._metrics.iteration_tokens.observe(self._step_tokens)
        self._metrics.observe_engine(engine.stats())

    def _observe_itl(self, values: list[float]) -> None:
        """A step's inter-token latencies: one call for a MetricsRecorder's (which a front end
        replays with ``observe_all``), else ``observe`` per value, in order, as before."""
        itl = self._metrics.itl
        many = getattr(itl, "observe_many", None)
        if many is not None:
            many(values)
        else:
            for v in values:
                itl.observe(v)

    def _delta(self, ro: Any, live: _Live, now: float) -> RequestDelta:
        m = self._metrics
        slot = live.slot
        if slot >= 0 and live.first_token is not None:  # its plain deltas were counted in the arrays
            live.last_token, live.generated = self._slot_times(slot)
        samples = []
        new = 0
        for c in ro.outputs:
            ids = list(c.token_ids)
            lps = c.logprobs
            samples.append(SampleDelta(int(c.index), ids, c.text, None if lps is None else list(lps),
                                       c.finish_reason, c.stop_reason))
            new += len(ids)
            if c.finish_reason is not None:
                live.reasons[int(c.index)] = c.finish_reason
        if new:
            if live.first_token is None:
                live.first_token = now
                m.ttft.observe(now - live.arrival)
                m.prompt_tokens.inc(live.prompt_len)
                m.n_param.observe(live.n)
                self._step_tokens += live.prompt_len
            else:
                self._step_itl.append(now - (live.last_token or now))
            live.last_token = now
            live.generated += new
            self._step_tokens += new
            self._step_generated += new
        cached = 0
        if ro.finished:
            metrics = ro.metrics
            cached = int(metrics.get("num_cached_tokens") or 0)
            reason = live.reasons.get(0, "stop")
            m.finished[reason if reason in m.finished else "stop"].inc()
            m.e2e.observe(now - live.arrival)
            if metrics.get("first_scheduled_time") and metrics.get("arrival_time"):
                m.queue_time.observe(max(0.0, metrics["first_scheduled_time"] - metrics["arrival_time"]))
            m.prompt_len.observe(live.prompt_len)
            m.generation_len.observe(live.generated)
            if live.max_tokens:
                m.max_tokens_param.observe(live.max_tokens)
            # vLLM's phases, from the engine's own timestamps: running = prefill + decode
            scheduled, first, done = (metrics.get(k) for k in ("first_scheduled_time", "first_token_time",
                                                               "finished_time"))
            if scheduled and done:
                m.inference_time.observe(max(0.0, done - scheduled))
                if first:
                    m.prefill_time.observe(max(0.0, first - scheduled))
                    m.decode_time.observe(max(0.0, done - first))
        if slot >= 0 and live.last_token is not None:
            self._set_slot_times(slot, live.last_token, live.generated)
        plp = ro.prompt_logprobs
        return RequestDelta(live.tag, samples, bool(ro.finished), list(plp) if plp else None, cached)

    # ---- columns (a subclass with ``columnar = True`` implements these) -----------------------
    def _new_slot(self, sink: Any, request_id: str) -> int:
        """A free slot for a request whose plain deltas come as columns."""
        raise NotImplementedError

    def _free_slot(self, slot: int) -> None:
        raise NotImplementedError

    def _slot_times(self, slot: int) -> tuple[float, int]:
        """The slot's (last token time, generated tokens)."""
        raise NotImplementedError

    def _set_slot_times(self, slot: int, last_token: float, generated: int) -> None:
        raise NotImplementedError

    def _take_columns(self, engine: Any, now: float, itl: list[float]) -> int:
        """Deliver the step's columns; adds their inter-token latencies to ``itl`` and returns
        their token count."""
        raise NotImplementedError

    def _deliver(self, batch: list[tuple[asyncio.Queue[Any], Any]]) -> None:
        if not batch or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass


def _put_all(batch: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for sink, item in batch:
        sink.put_nowait(item)
