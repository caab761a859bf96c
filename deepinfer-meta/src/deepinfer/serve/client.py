"""One HTTP front end's view of the engine-core processes (``deepinfer.serve.core``).

``EngineClient`` stands where the in-process server has its ``LLM`` and ``EngineThread`` (the
tokenizer and limits the routes need; submit / abort / stop). It connects to every engine core
(one, or one per data-parallel replica: ``--data-parallel-size``) with a ZeroMQ DEALER socket each,
driven by the front end's event loop (``zmq.asyncio``: no thread, no lock), and decodes each step's
message with one typed msgspec decoder. It makes the text of the requests it sends without stop
strings (``output_text.py``: the core sends token ids), bounds each request's buffer of
undelivered deltas (a client that stops reading is cut with an error, counted in
``deepinfer:stream_buffer_overflows_total``), and places each request on the core where this
front end has the fewest open sequences (then tokens; ties round-robin).

A core whose process is gone fails its open requests with a 503 naming it; with one core /health
then reports 503 and ``on_core_death`` is called (the CLI exits non-zero); with several the others
serve on, /health reports 503 naming the dead replica, and ``on_core_death`` is called once every
core is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import msgspec

from deepinfer.runtime.sampling_params import SamplingParams
from deepinfer.serve.core import pid_alive, sampling_params_fields
from deepinfer.serve.core_process import CoreError, CoreProcess
from deepinfer.serve.engine_thread import RequestDelta, RequestFailed, SampleDelta, first_sample
from deepinfer.serve.metrics import ServerMetrics
from deepinfer.serve.output_text import RequestText, detokenized_here
from deepinfer.serve.replicas import least_loaded
from deepinfer.serve.token_stream import TokenStream

__all__ = ["CoreError", "CoreProcess", "EngineClient"]

log = logging.getLogger("deepinfer.serve")

CORE_CHECK_S = 0.2  # how often an idle front end checks that a core still runs
#: undelivered step messages one HTTP request may have queued before it is cut (a stalled reader)
DEFAULT_MAX_STREAM_BUFFER = 4096

Message = tuple[str, Any, list[tuple[str, RequestDelta]], list[tuple[str, RequestFailed]],
                list[tuple[list[str], bytes, bytes]]]


@dataclass
class _Core:
    """One engine core as this front end sees it."""

    index: int
    address: str
    info: dict[str, Any]
    sock: Any = None
    reader: asyncio.Task[None] | None = None
    metrics: ServerMetrics | None = None
    death: str | None = None
    seqs: int = 0  # sequences this front end has open there (a request with n samples counts n)
    tokens: int = 0  # their prompt + completion budget
    routes: dict[str, _Route] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return int(self.info["pid"])


@dataclass
class _Route:
    sink: asyncio.Queue[Any]
    tag: int
    core: _Core
    seqs: int = 1
    tokens: int = 0
    text: RequestText | None = None  # this front end detokenizes the request (output_text.py)
    stream: TokenStream | None = None  # its chunks are made and written here (token_stream.py)
    held: list[int] | None = None  # a whole response: tokens kept until its last delta (hold_tokens)


class EngineClient:
    """One front end's connection to the engine cores at ``address`` (one address, or one per
    data-parallel replica) whose ready messages are ``info`` (one, or one per address). Its
    methods run on the event loop (``start`` binds it)."""

    def __init__(self, address: str | Sequence[str], info: dict[str, Any] | Sequence[dict[str, Any]],
                 max_stream_buffer: int = DEFAULT_MAX_STREAM_BUFFER,
                 on_core_death: Callable[[str], None] | None = None) -> None:
        from deepinfer.runtime.loading.tokenizer_loader import load_text_tokenizer

        if isinstance(max_stream_buffer, bool) or not isinstance(max_stream_buffer, int) or max_stream_buffer < 1:
            raise ValueError(f"max_stream_buffer must be an int >= 1, got {max_stream_buffer!r}")
        addresses = [address] if isinstance(address, str) else list(address)
        infos = [info] if isinstance(info, dict) else list(info)
        if not addresses or len(addresses) != len(infos):
            raise ValueError(f"give one info per engine-core address: {len(addresses)} addresses, "
                             f"{len(infos)} infos")
        self._cores = [_Core(i, a, inf) for i, (a, inf) in enumerate(zip(addresses, infos, strict=True))]
        first = infos[0]
        self.info = first
        self.model_path: str = first["model_path"]
        self.max_model_len: int = first["max_model_len"]
        self.max_num_seqs: int = first["max_num_seqs"]
        self.vocab_size: int = first["vocab_size"]
        self.engine_args = SimpleNamespace(max_logprobs=first.get("max_logprobs", 20),
                                           scheduling_policy=first.get("scheduling_policy"))
        self.max_stream_buffer = max_stream_buffer
        self.on_core_death = on_core_death
        self.text_tokenizer = load_text_tokenizer(self.model_path)
        self._routes: dict[str, _Route] = {}
        self._pending_streams: list[tuple[str, _Route, TokenStream]] = []  # kept tokens (_flush_streams)
        self._next = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Message)
        self._ctx: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.death: str | None = None  # set once every core is gone

    # ---- what the HTTP side reads ----------------------------------------------------------
    @property
    def size(self) -> int:
        """Engine cores (data-parallel replicas) behind this front end."""
        return len(self._cores)

    @property
    def core_pid(self) -> int:
        return self._cores[0].pid

    @property
    def core_pids(self) -> list[int]:
        return [c.pid for c in self._cores]

    @property
    def num_blocks(self) -> list[int]:
        return [int(c.info["num_blocks"]) for c in self._cores]

    @property
    def cache_infos(self) -> list[dict[str, str]]:
        return [c.info["cache"] for c in self._cores]

    @property
    def metrics(self) -> ServerMetrics | None:
        """The first core's metrics (every core's: ``attach_metrics``)."""
        return self._cores[0].metrics

    def attach_metrics(self, metrics: Sequence[ServerMetrics]) -> None:
        """Each core's metrics (its messages' updates are replayed on them)."""
        if len(metrics) != self.size:
            raise ValueError(f"{self.size} engine cores need {self.size} ServerMetrics, got {len(metrics)}")
        for c, m in zip(self._cores, metrics, strict=True):
            c.metrics = m

    def apply_chat_template(self, conversation: Sequence[dict[str, str]], add_generation_prompt: bool = True,
                            chat_template_kwargs: dict[str, Any] | None = None,
                            chat_template: str | None = None) -> dict[str, list[int]]:
        from deepinfer.runtime.llm import chat_prompt

        return chat_prompt(self.text_tokenizer, self.model_path, conversation, add_generation_prompt,
                           chat_template_kwargs, chat_template)

    @property
    def alive(self) -> bool:
        """Whether a core can take requests."""
        return not self._stopping and self._ctx is not None and any(c.death is None for c in self._cores)

    def unhealthy_reason(self) -> str | None:
        if self._ctx is None:
            return "the front end is not connected to the engine core"
        dead = [c.death for c in self._cores if c.death is not None]
        if not dead:
            return None
        if self.size == 1:
            return dead[0]
        live = sum(c.death is None for c in self._cores)
        return f"{'; '.join(dead)} ({live} of {self.size} replicas serving)"

    @property
    def in_flight(self) -> int:
        return len(self._routes)

    # ---- called on the event loop ----------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        import zmq
        import zmq.asyncio

        if any(c.metrics is None for c in self._cores):
            raise RuntimeError("attach_metrics() before start()")
        self._loop = loop
        self._ctx = zmq.asyncio.Context()
        for c in self._cores:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.connect(c.address)
            c.sock = sock
            self._send(c, ("hello", os.getpid()))
            c.reader = loop.create_task(self._read(c), name=f"deepinfer-core-{c.index}-reader")

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               sink: asyncio.Queue[Any], tag: int, prompt_embeds: Any = None, priority: int = 0,
               cache_salt: str | None = None) -> None:
        if not self.alive:
            sink.put_nowait(RequestFailed(tag, 503, self.unhealthy_reason() or "the engine core is not running"))
            return
        i = least_loaded([(c.seqs, c.tokens) if c.death is None else None for c in self._cores], self._next)
        self._next = (i + 1) % self.size
        core = self._cores[i]
        fields = sampling_params_fields(params)
        text = None
        if detokenized_here(params):  # the core sends token ids only; the text is made here
            # (a prompt given as embeddings has placeholder ids: no decoding context, as in the engine)
            text = RequestText(self.text_tokenizer, [] if prompt_embeds is not None else prompt_ids, params)
            fields["detokenize"] = False
        route = _Route(sink, tag, core, params.n, len(prompt_ids) + (params.max_tokens or 0) * params.n, text)
        core.seqs += route.seqs
        core.tokens += route.tokens
        self._routes[request_id] = core.routes[request_id] = route
        message: tuple[Any, ...] = ("add", request_id, prompt_ids, fields, tag, time.monotonic())
        if prompt_embeds is not None or priority or cache_salt is not None:  # (optional trailing elements)
            from deepinfer.serve.engine_thread import embeds_to_wire

            message += (None if prompt_embeds is None else embeds_to_wire(prompt_embeds),)
            if priority or cache_salt is not None:
                message += (priority,) if cache_salt is None else (priority, cache_salt)
        self._send(core, message)

    def attach_stream(self, request_id: str, stream: TokenStream) -> bool:
        """Make and write the chunks of ``request_id``'s plain deltas with ``stream`` (one sample,
        text made here); False (nothing changes) when this front end does not make its text."""
        route = self._routes.get(request_id)
        if route is None or route.text is None or route.held is not None:
            return False
        stream.text = route.text
        route.stream = stream
        return True

    def hold_tokens(self, request_id: str) -> bool:
        """A whole (non-streamed) response: keep ``request_id``'s plain deltas' tokens here and
        hand them over with its last delta, detokenized then (one wake-up of its handler instead
        of one a step); False when this front end does not make its text."""
        route = self._routes.get(request_id)
        if route is None or route.text is None or route.stream is not None:
            return False
        route.held = []
        return True

    def abort(self, request_id: str) -> None:
        """Abort a request in its core (idempotent; unknown ids are ignored)."""
        if self._loop is not None and self._loop.is_running() and not _on_loop(self._loop):
            self._loop.call_soon_threadsafe(self.abort, request_id)
            return
        route = self._drop(request_id)
        if route is not None and route.core.death is None and not self._stopping:
            self._send(route.core, ("abort", [request_id]))

    def stop(self, timeout: float = 30.0) -> None:
        """This front end is done: abort what it still has in the cores and close its sockets
        (the cores themselves are the supervisor's to stop). Any thread; idempotent."""
        loop = self._loop
        if loop is not None and loop.is_running() and not _on_loop(loop):
            done = threading.Event()

            def close() -> None:
                self._close()
                done.set()

            try:
                loop.call_soon_threadsafe(close)
            except RuntimeError:
                return
            done.wait(timeout)
            return
        self._close()

    # ---- internals -------------------------------------------------------------------------
    def _drop(self, request_id: str) -> _Route | None:
        """Forget a request (finished, failed or aborted): its core's load goes down."""
        route = self._routes.pop(request_id, None)
        if route is not None:
            core = route.core
            del core.routes[request_id]
            core.seqs -= route.seqs
            core.tokens -= route.tokens
        return route

    def _close(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        for c in self._cores:
            if c.routes and c.death is None and c.sock is not None:
                self._send(c, ("abort", list(c.routes)))
        for route in self._routes.values():
            route.sink.put_nowait(RequestFailed(route.tag, 503, "the server is shutting down"))
        self._routes.clear()
        for c in self._cores:
            c.routes.clear()
            if c.reader is not None:
                c.reader.cancel()
            if c.sock is not None:
                c.sock.close(linger=200)  # let the aborts out
        if self._ctx is not None:
            self._ctx.term()

    def _send(self, core: _Core, message: Any) -> None:
        import zmq

        try:  # the high-water mark is unlimited: the message is queued at once
            core.sock.send(self._encoder.encode(message), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a closed socket
            log.error("could not send to engine core %d: %r", core.index, exc)

    async def _read(self, core: _Core) -> None:
        import zmq

        sock = core.sock
        try:
            while True:
                if not await sock.poll(int(CORE_CHECK_S * 1000), zmq.POLLIN):
                    if not pid_alive(core.pid):
                        self._core_died(core, f"its process (pid {core.pid}) is gone")
                        return
                    continue
                while True:
                    try:  # a NOBLOCK receive: its future is done at once (awaiting it does not yield)
                        raw = await sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_message(core, self._decoder.decode(raw), flush=False)
                    if core.death is not None:
                        return
                self._flush_streams()  # the socket is empty: write each stream's tokens as one chunk
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the front end cannot read the core: it is as good as dead
            log.exception("reading engine core %d's messages failed", core.index)
            self._core_died(core, f"this front end could not read its messages: {exc!r}")

    def _on_message(self, core: _Core, msg: Message, flush: bool = True) -> None:
        """One engine message. ``flush=False``: streams written from here keep the new tokens
        (``TokenStream.add``) until ``_flush_streams``, which ``_read`` calls once it has drained
        every waiting message, so a stream's tokens of several steps go out as one chunk."""
        kind, payload, deltas, failures, columns = msg
        if kind == "died":
            self._core_died(core, f"its loop stopped: {payload}")
            return
        if kind != "batch":
            return  # "ready": the core knows this front end now
        assert core.metrics is not None
        if payload:
            core.metrics.replay(payload)
        routes = self._routes
        limit = self.max_stream_buffer
        for rids, counts, tokens in columns:  # plain deltas (core.py: one sample, not finished)
            for rid, ids in zip(rids, _split_columns(rids, counts, tokens), strict=True):
                route = routes.get(rid)
                if route is None:  # aborted by its client
                    continue
                if route.held is not None:  # a whole response: nothing to hand over yet
                    self._hold(rid, route, ids)
                    continue
                stream = route.stream
                if stream is not None:  # written from here (token_stream.py)
                    self._stream_tokens(rid, route, stream, ids)
                    continue
                if route.sink.qsize() >= limit:
                    self._cut(rid, route)
                    continue
                self._put(rid, route, RequestDelta(route.tag, [SampleDelta(0, ids, "", None, None, None)] if ids
                                                   else [], False))
        for rid, delta in deltas:
            route = routes.get(rid)
            if route is None:  # aborted by its client
                continue
            filled = False
            if route.held:  # the held tokens go first in sample 0 (their text is made already)
                first = first_sample(delta)
                if not self._fill(rid, route, delta):
                    continue
                first.token_ids = route.held + first.token_ids
                route.held, filled = [], True
            if route.stream is not None and route.stream.pending:  # its kept tokens go out first
                self._flush_one(rid, route, route.stream)
                if routes.get(rid) is not route:  # writing them failed the request
                    continue
            if route.stream is not None and not delta.finished:  # (a plain delta sent whole: in order)
                ids = [t for smp in delta.samples if smp.index == 0 for t in smp.token_ids]
                if ids:
                    self._stream_tokens(rid, route, route.stream, ids)
                continue
            if delta.finished:
                self._drop(rid)
            elif route.sink.qsize() >= limit:
                self._cut(rid, route)
                continue
            self._put(rid, route, delta, filled)
        for rid, failure in failures:
            route = routes.get(rid)
            if route is not None and route.stream is not None and route.stream.pending:
                self._flush_one(rid, route, route.stream)  # what came before the failure, first
            route = self._drop(rid)
            if route is not None:
                if self.size > 1 and failure.status >= 500:
                    failure = RequestFailed(failure.tag, failure.status, f"replica {core.index}: {failure.message}")
                route.sink.put_nowait(failure)

        if flush:
            self._flush_streams()

    def _stream_tokens(self, rid: str, route: _Route, stream: TokenStream, ids: list[int]) -> None:
        if stream.backlog() >= self.max_stream_buffer:
            self._cut(rid, route)
            return
        if stream.add(ids):
            self._pending_streams.append((rid, route, stream))

    def _flush_streams(self) -> None:
        """Write the tokens the streams kept while messages were drained (one chunk a stream)."""
        pending, self._pending_streams = self._pending_streams, []
        routes = self._routes
        for rid, route, stream in pending:
            if routes.get(rid) is route:
                self._flush_one(rid, route, stream)
            else:  # cut, aborted or failed meanwhile
                stream.drop_pending()

    def _flush_one(self, rid: str, route: _Route, stream: TokenStream) -> None:
        try:
            stream.flush()
        except Exception as exc:  # noqa: BLE001 - this request's failure only
            self._fail_one(rid, route, exc)

    def _put(self, rid: str, route: _Route, delta: RequestDelta, filled: bool = False) -> None:
        """Hand a delta to its HTTP handler, with its text when this front end makes it
        (``filled``: made already)."""
        if filled or self._fill(rid, route, delta):
            route.sink.put_nowait(delta)

    def _fill(self, rid: str, route: _Route, delta: RequestDelta) -> bool:
        """Make the delta's text when this front end makes it; False: that failed the request."""
        if route.text is None:
            return True
        try:
            route.text.fill(delta)
        except Exception as exc:  # noqa: BLE001 - this request's failure only
            self._fail_one(rid, route, exc)
            return False
        return True

    def _hold(self, rid: str, route: _Route, ids: list[int]) -> None:
        """A whole response's new tokens: kept for its last delta, their text made now (a step's
        tokens decoded while the engine runs the next, rather than every token at the end)."""
        assert route.held is not None and route.text is not None  # (hold_tokens)
        route.held += ids
        try:
            route.text.absorb(ids)
        except Exception as exc:  # noqa: BLE001 - this request's failure only
            self._fail_one(rid, route, exc)

    def _fail_one(self, rid: str, route: _Route, exc: Exception) -> None:
        """Making or writing a request's text failed here with ``exc``: abort it in its core, fail
        its response."""
        message = f"the request failed: {type(exc).__name__}: {exc}"
        if self._drop(rid) is not None:
            self._send(route.core, ("abort", [rid]))
        log.error("request %s: %s", rid, message)
        route.sink.put_nowait(RequestFailed(route.tag, 500, message))

    def _cut(self, rid: str, route: _Route) -> None:
        """A client that does not read its stream: abort its request, drop what it has not read,
        and end its stream with an error (counted in the metrics)."""
        self._drop(rid)
        self._send(route.core, ("abort", [rid]))
        q = route.sink
        while not q.empty():
            q.get_nowait()
        q.put_nowait(RequestFailed(route.tag, 503, f"the client read its stream too slowly: more than "
                                                   f"{self.max_stream_buffer} undelivered steps "
                                                   "(--max-stream-buffer); the request was aborted"))
        assert route.core.metrics is not None
        route.core.metrics.stream_overflows.inc()
        log.warning("request %s: its client stalled; its stream was cut", rid)

    def _core_died(self, core: _Core, why: str) -> None:
        """Fail the core's requests with a 503 naming it; the last core's death ends the front end."""
        if core.death is not None or self._stopping:
            return
        self._flush_streams()  # the tokens that came before its death go out before the errors
        name = f"the engine core process (pid {core.pid})" if self.size == 1 else f"replica {core.index} died"
        reason = core.death = (f"{name} is gone" if why.startswith("its process") and self.size == 1
                               else f"{name}: {why}")
        metrics = core.metrics
        assert metrics is not None
        for rid, route in list(core.routes.items()):
            self._drop(rid)
            route.sink.put_nowait(RequestFailed(route.tag, 503, f"{reason}; the request was running there"))
            metrics.finished["error"].inc()
        metrics.running.set(0)  # nothing runs or waits there any more
        metrics.waiting.set(0)
        if any(c.death is None for c in self._cores):
            log.error("%s: its requests failed, the other replicas serve on, /health reports 503", reason)
            return
        self.death = reason
        log.error("%s: every open request fails, /health reports 503, the server exits", reason)
        if self.on_core_death is not None:
            self.on_core_death(reason)


def _split_columns(rids: list[str], counts: bytes, tokens: bytes) -> list[list[int]]:
    """Each row's token ids from a message's columns (core.py); ValueError when they disagree."""
    import numpy as np

    if len(counts) != 4 * len(rids) or len(tokens) % 4:
        raise ValueError(f"malformed columns: {len(rids)} request ids, {len(counts)} bytes of counts, "
                         f"{len(tokens)} bytes of token ids")
    n = np.frombuffer(counts, "<i4")
    if len(n) and (int(n.min()) < 0 or int(n.sum()) != len(tokens) // 4):
        raise ValueError(f"malformed columns: counts sum to {int(n.sum())} (min {int(n.min())}), "
                         f"{len(tokens) // 4} token ids")
    ids = np.frombuffer(tokens, "<i4").tolist()
    if not len(n) or (int(n.max()) == 1 and len(ids) == len(rids)):  # one token each (steady decode)
        return [[t] for t in ids]
    out, pos = [], 0
    for k in n.tolist():
        out.append(ids[pos:pos + k])
        pos += k
    return out


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    with contextlib.suppress(RuntimeError):
        return asyncio.get_running_loop() is loop
    return False
