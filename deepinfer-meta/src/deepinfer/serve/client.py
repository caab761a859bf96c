"""The two ends of the engine-core process outside it (``deepinfer.serve.core``).

``CoreProcess``: the supervisor's handle. It starts the core as ``python -m
deepinfer.serve.core`` (a fresh interpreter, never a fork, never the caller's ``__main__``), waits
for its model to load, and stops it.

``EngineClient``: one HTTP front end's view of the core. It stands where the in-process server
has its ``LLM`` and ``EngineThread`` (the tokenizer and limits the routes need; submit / abort /
stop), talks to the core over a ZeroMQ DEALER socket driven by the front end's event loop
(``zmq.asyncio``: no thread, no lock), and decodes each step's message with one typed msgspec
decoder. It bounds each request's buffer of undelivered deltas (a client that stops reading is
cut with an error, counted in ``deepinfer:stream_buffer_overflows_total``), and when the core
process is gone it fails every open request, reports 503 on /health and calls ``on_core_death``
(the CLI exits non-zero).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import msgspec

from deepinfer.runtime.sampling_params import SamplingParams
from deepinfer.serve.core import pid_alive, sampling_params_fields
from deepinfer.serve.engine_thread import RequestDelta, RequestFailed
from deepinfer.serve.metrics import ServerMetrics

log = logging.getLogger("deepinfer.serve")

CORE_CHECK_S = 0.2  # how often an idle front end checks that the core still runs
#: undelivered step messages one HTTP request may have queued before it is cut (a stalled reader)
DEFAULT_MAX_STREAM_BUFFER = 4096

_LOAD_ERRORS: dict[str, type[Exception]] = {"ValueError": ValueError, "TypeError": TypeError,
                                            "FileNotFoundError": FileNotFoundError}

Message = tuple[str, Any, list[tuple[str, RequestDelta]], list[tuple[str, RequestFailed]]]


class CoreError(RuntimeError):
    """The engine-core process could not start (it exited, or its model failed to load)."""


class CoreProcess:
    """The engine-core process: ``LLM(**llm_kwargs)`` behind an ``ipc://`` socket. Construction
    returns once the model is loaded (``info``: its limits), raising the core's error if it
    could not be (ValueError, TypeError, FileNotFoundError as LLM raises them; else CoreError)."""

    def __init__(self, llm_kwargs: dict[str, Any], log_level: str = "info", env: dict[str, str] | None = None
                 ) -> None:
        self._dir = tempfile.mkdtemp(prefix="deepinfer-core-")
        self.address = f"ipc://{self._dir}/engine.sock"
        config = {"address": self.address, "llm_kwargs": llm_kwargs, "log_level": log_level,
                  "parent_pid": os.getpid(), "env": env or {}}
        try:
            payload = json.dumps(config)
        except TypeError as exc:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise TypeError(f"the engine core's arguments must be JSON values: {exc}") from None
        self.proc = subprocess.Popen([sys.executable, "-m", "deepinfer.serve.core", payload],
                                     stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        self._stopped = False
        try:
            assert self.proc.stdout is not None
            line = self.proc.stdout.readline()
            if not line:
                raise CoreError(f"the engine core (pid {self.proc.pid}) exited with code {self.proc.wait()} "
                                "while loading the model")
            msg = json.loads(line)
            if "failed" in msg:
                kind, text = msg["failed"]
                self.proc.wait(30)
                if kind in _LOAD_ERRORS:
                    raise _LOAD_ERRORS[kind](text)
                raise CoreError(f"the engine core could not load the model: {kind}: {text}")
        except BaseException:
            self.stop(5.0)
            raise
        self.info: dict[str, Any] = msg["ready"]
        log.info("engine core: pid %d, device %s, %d KV blocks", self.proc.pid, self.info["device"],
                 self.info["num_blocks"])
        # the core's stdout after its ready line (torch may print there) must not fill the pipe
        threading.Thread(target=_drain, args=(self.proc.stdout,), name="deepinfer-core-stdout", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (the core aborts what runs and exits 0), then SIGKILL after ``timeout`` s. Idempotent."""
        if not self._stopped:
            self._stopped = True
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    log.warning("the engine core did not stop within %.0f s: killing it", timeout)
                    self.proc.kill()
                    self.proc.wait(5)
            shutil.rmtree(self._dir, ignore_errors=True)
        return self.proc.poll()


def _drain(stream: Any) -> None:
    for line in iter(stream.readline, b""):
        sys.stdout.buffer.write(line)
        sys.stdout.flush()


@dataclass
class _Route:
    sink: asyncio.Queue[Any]
    tag: int


class EngineClient:
    """One front end's connection to the engine core at ``address`` (``info``: the core's ready
    message). Its methods run on the event loop (``start`` binds it)."""

    def __init__(self, address: str, info: dict[str, Any], max_stream_buffer: int = DEFAULT_MAX_STREAM_BUFFER,
                 on_core_death: Callable[[str], None] | None = None) -> None:
        from deepinfer.runtime.loading.tokenizer_loader import load_text_tokenizer

        if isinstance(max_stream_buffer, bool) or not isinstance(max_stream_buffer, int) or max_stream_buffer < 1:
            raise ValueError(f"max_stream_buffer must be an int >= 1, got {max_stream_buffer!r}")
        self.address, self.info = address, info
        self.core_pid: int = info["pid"]
        self.model_path: str = info["model_path"]
        self.max_model_len: int = info["max_model_len"]
        self.max_num_seqs: int = info["max_num_seqs"]
        self.vocab_size: int = info["vocab_size"]
        self.num_blocks: int = info["num_blocks"]
        self.cache_info: dict[str, str] = info["cache"]
        self.engine_args = SimpleNamespace(max_logprobs=info.get("max_logprobs", 20))
        self.max_stream_buffer = max_stream_buffer
        self.on_core_death = on_core_death
        self.text_tokenizer = load_text_tokenizer(self.model_path)
        self.metrics: ServerMetrics | None = None
        self._routes: dict[str, _Route] = {}
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Message)
        self._sock: Any = None
        self._ctx: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.death: str | None = None
        self._stopping = False

    # ---- what the HTTP side reads ----------------------------------------------------------
    def apply_chat_template(self, conversation: Sequence[dict[str, str]], add_generation_prompt: bool = True,
                            chat_template_kwargs: dict[str, Any] | None = None) -> dict[str, list[int]]:
        from deepinfer.runtime.llm import chat_prompt

        return chat_prompt(self.text_tokenizer, self.model_path, conversation, add_generation_prompt,
                           chat_template_kwargs)

    @property
    def alive(self) -> bool:
        return self.death is None and not self._stopping and self._sock is not None

    def unhealthy_reason(self) -> str | None:
        if self.death is not None:
            return self.death
        if self._sock is None:
            return "the front end is not connected to the engine core"
        return None

    @property
    def in_flight(self) -> int:
        return len(self._routes)

    # ---- called on the event loop ----------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        import zmq
        import zmq.asyncio

        if self.metrics is None:
            raise RuntimeError("set metrics before start()")
        self._loop = loop
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(self.address)
        self._sock = sock
        self._send(("hello", os.getpid()))
        self._reader = loop.create_task(self._read(), name="deepinfer-core-reader")

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               sink: asyncio.Queue[Any], tag: int, prompt_embeds: Any = None) -> None:
        if not self.alive:
            sink.put_nowait(RequestFailed(tag, 503, self.unhealthy_reason() or "the engine core is not running"))
            return
        import time

        self._routes[request_id] = _Route(sink, tag)
        message: tuple[Any, ...] = ("add", request_id, prompt_ids, sampling_params_fields(params), tag, time.monotonic())
        if prompt_embeds is not None:
            from deepinfer.serve.engine_thread import embeds_to_wire

            message += (embeds_to_wire(prompt_embeds),)
        self._send(message)

    def abort(self, request_id: str) -> None:
        """Abort a request in the core (idempotent; unknown ids are ignored)."""
        if self._loop is not None and self._loop.is_running() and not _on_loop(self._loop):
            self._loop.call_soon_threadsafe(self.abort, request_id)
            return
        if self._routes.pop(request_id, None) is not None and self.alive:
            self._send(("abort", [request_id]))

    def stop(self, timeout: float = 30.0) -> None:
        """This front end is done: abort what it still has in the core and close its socket
        (the core itself is the supervisor's to stop). Any thread; idempotent."""
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
    def _close(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self._routes and self.death is None and self._sock is not None:
            self._send(("abort", list(self._routes)))
        for route in self._routes.values():
            route.sink.put_nowait(RequestFailed(route.tag, 503, "the server is shutting down"))
        self._routes.clear()
        if self._reader is not None:
            self._reader.cancel()
        if self._sock is not None:
            self._sock.close(linger=200)  # let the aborts out
        if self._ctx is not None:
            self._ctx.term()

    def _send(self, message: Any) -> None:
        import zmq

        try:  # the high-water mark is unlimited: the message is queued at once
            self._sock.send(self._encoder.encode(message), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a closed socket
            log.error("could not send to the engine core: %r", exc)

    async def _read(self) -> None:
        import zmq

        sock = self._sock
        try:
            while True:
                if not await sock.poll(int(CORE_CHECK_S * 1000), zmq.POLLIN):
                    if not pid_alive(self.core_pid):
                        self._core_died(f"the engine core process (pid {self.core_pid}) is gone")
                        return
                    continue
                while True:
                    try:  # a NOBLOCK receive: its future is done at once (awaiting it does not yield)
                        raw = await sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_message(self._decoder.decode(raw))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the front end cannot read the core: it is as good as dead
            log.exception("reading the engine core's messages failed")
            self._core_died(f"this front end could not read the engine core's messages: {exc!r}")

    def _on_message(self, msg: Message) -> None:
        kind, payload, deltas, failures = msg
        if kind == "died":
            self._core_died(f"the engine core's loop stopped: {payload}")
            return
        if kind != "batch":
            return  # "ready": the core knows this front end now
        assert self.metrics is not None
        if payload:
            self.metrics.replay(payload)
        routes = self._routes
        limit = self.max_stream_buffer
        for rid, delta in deltas:
            route = routes.get(rid)
            if route is None:  # aborted by its client
                continue
            if delta.finished:
                del routes[rid]
            elif route.sink.qsize() >= limit:
                self._cut(rid, route)
                continue
            route.sink.put_nowait(delta)
        for rid, failure in failures:
            route = routes.pop(rid, None)
            if route is not None:
                route.sink.put_nowait(failure)

    def _cut(self, rid: str, route: _Route) -> None:
        """A client that does not read its stream: abort its request, drop what it has not read,
        and end its stream with an error (counted in the metrics)."""
        del self._routes[rid]
        self._send(("abort", [rid]))
        q = route.sink
        while not q.empty():
            q.get_nowait()
        q.put_nowait(RequestFailed(route.tag, 503, f"the client read its stream too slowly: more than "
                                                   f"{self.max_stream_buffer} undelivered steps "
                                                   "(--max-stream-buffer); the request was aborted"))
        assert self.metrics is not None
        self.metrics.stream_overflows.inc()
        log.warning("request %s: its client stalled; its stream was cut", rid)

    def _core_died(self, reason: str) -> None:
        if self.death is not None or self._stopping:
            return
        self.death = reason
        log.error("%s: every open request fails, /health reports 503, the server exits", reason)
        assert self.metrics is not None
        for route in self._routes.values():
            route.sink.put_nowait(RequestFailed(route.tag, 503, f"{reason}; the request was running there"))
            self.metrics.finished["error"].inc()
        self._routes.clear()
        if self.on_core_death is not None:
            self.on_core_death(reason)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    with contextlib.suppress(RuntimeError):
        return asyncio.get_running_loop() is loop
    return False
