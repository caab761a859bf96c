"""Data-parallel serving: N independent engine replicas, each in its own process on its own
device group, behind the one HTTP front end (``deepinfer serve --data-parallel-size N``).

Transport: the standard library's ``multiprocessing`` with the spawn start method (a fresh
interpreter per replica: forking a process that has torch threads or a CUDA context is unsafe).
Each replica reads a command queue (add / abort / stop) and answers on a one-way pipe, one
pickled message per engine-loop turn; a reader thread per replica hands each message to the
event loop with one ``call_soon_threadsafe``, so the front end's bookkeeping (routes, loads)
lives on the event-loop thread only, as the in-process server's does.

``ReplicaSet`` stands where the in-process server has its ``LLM`` and ``EngineThread``: it has
the tokenizer and limits the HTTP side needs, and the engine thread's submit / abort / stop.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from deepinfer.runtime.sampling_params import SamplingParams
from deepinfer.serve.engine_thread import RequestDelta, RequestFailed, embeds_to_wire
from deepinfer.serve.metrics import ServerMetrics
from deepinfer.serve.replica_worker import replica_main

log = logging.getLogger("deepinfer.serve")


class ReplicaError(RuntimeError):
    """A replica process could not start (it exited, or its model failed to load)."""


@dataclass(frozen=True)
class ReplicaPlacement:
    """Where one replica runs: its LLM's device, its process's extra environment (its GPU group
    as CUDA_VISIBLE_DEVICES) and its torch intra-op threads."""

    device: str
    env: dict[str, str]
    num_threads: int | None


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def visible_cuda_devices() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (ids or UUIDs)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def plan_replicas(device: str | None, data_parallel_size: int, tensor_parallel_size: int = 1,
                  num_threads: int | None = None, cuda_devices: Sequence[str] | None = None
                  ) -> list[ReplicaPlacement]:
    """One placement per replica. On CUDA replica i gets the GPUs i*tp .. (i+1)*tp-1 of the
    visible ones (``cuda_devices``, default: CUDA_VISIBLE_DEVICES or all), and a ValueError
    names both numbers when there are fewer; on CPU any number of replicas may share the cores
    (``num_threads`` each, default: the cores divided among them)."""
    n = _count("data_parallel_size", data_parallel_size)
    tp = _count("tensor_parallel_size", tensor_parallel_size)
    if device is None:
        from deepinfer.runtime.worker.device import resolve_runtime_device

        device = resolve_runtime_device(None).device
    if not isinstance(device, str) or not device:
        raise ValueError(f"device must be a string such as 'cpu' or 'cuda', got {device!r}")
    kind, _, index = device.partition(":")
    if kind == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = num_threads if num_threads is not None else max(1, cores // (n * tp))
        return [ReplicaPlacement("cpu", {}, threads) for _ in range(n)]
    if kind != "cuda":
        raise ValueError(f"data-parallel replicas run on 'cpu' or 'cuda' devices, got device={device!r}")
    if index:
        raise ValueError(f"device={device!r} names one GPU, but {n} replicas need a GPU group each: give "
                         f"device='cuda' (and CUDA_VISIBLE_DEVICES to choose the GPUs)")
    gpus = list(cuda_devices) if cuda_devices is not None else visible_cuda_devices()
    if n * tp > len(gpus):
        raise ValueError(f"data_parallel_size={n} (x tensor_parallel_size={tp}) needs {n * tp} GPUs, but only "
                         f"{len(gpus)} are visible")
    return [ReplicaPlacement("cuda", {"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * tp:(i + 1) * tp])}, num_threads)
            for i in range(n)]


def replica_seed(seed: int, index: int) -> int:
    """The engine seed of replica ``index``. An engine derives the random stream of a request
    without its own seed from its seed and the sequence's id, and every replica numbers its
    sequences from 0: with one seed, replica 1's k-th request would sample exactly as replica 0's.
    Replica 0 keeps ``seed`` (so one replica samples as the in-process server does); a request
    with its own seed samples the same on any replica."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    return (seed + index * 0xD1B54A32D192ED03) % (1 << 64)


def least_loaded(loads: Sequence[tuple[int, int] | None], start: int) -> int:
    """Index of the smallest load (sequences in flight, then tokens in flight; None: a dead
    replica); among equal loads the first at or after ``start``, so ties go round-robin."""
    best: int | None = None
    for k in range(len(loads)):
        i = (start + k) % len(loads)
        load = loads[i]
        if load is not None and (best is None or load < loads[best]):  # type: ignore[operator]
            best = i
    if best is None:
        raise LookupError("no live replica")
    return best


@dataclass
class _Replica:
    index: int
    process: Any  # multiprocessing.Process
    commands: Any  # multiprocessing.Queue: front end -> replica
    conn: Any  # multiprocessing.connection.Connection: replica -> front end
    info: dict[str, Any] = field(default_factory=dict)
    metrics: ServerMetrics | None = None
    alive: bool = True
    death: str | None = None
    seqs: int = 0  # sequences in flight (a request with n samples counts n)
    tokens: int = 0  # prompt + completion budget of the requests in flight
    reader: threading.Thread | None = None


@dataclass
class _Route:
    replica: _Replica
    sink: asyncio.Queue[Any]
    tag: int
    seqs: int
    tokens: int


_LOAD_ERRORS: dict[str, type[Exception]] = {"ValueError": ValueError, "TypeError": TypeError,
                                            "FileNotFoundError": FileNotFoundError}


class ReplicaSet:
    """N replica processes, each an ``LLM(**llm_kwargs)`` on its placement; requests go to the
    least-loaded live replica. Construction returns once every replica has loaded its model
    (a replica that fails raises its error, and the others are stopped). The replicas are
    spawned, so a script that builds a ReplicaSet needs the ``if __name__ == "__main__":`` guard."""

    def __init__(self, llm_kwargs: dict[str, Any], data_parallel_size: int, tensor_parallel_size: int = 1,
                 log_level: str = "info") -> None:
        from deepinfer.runtime.loading.model_loader import resolve_model_path
        from deepinfer.runtime.loading.tokenizer_loader import load_text_tokenizer

        kwargs = dict(llm_kwargs)
        placements = plan_replicas(kwargs.pop("device", None), data_parallel_size, tensor_parallel_size,
                                   kwargs.pop("num_threads", None))
        if tensor_parallel_size != 1:
            kwargs["tensor_parallel_size"] = tensor_parallel_size
        self.model_path = str(resolve_model_path(kwargs.get("model")))
        self._replicas: list[_Replica] = []
        self._routes: dict[str, _Route] = {}
        self._next = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._stopping = False
        self._stopped = False
        ctx = multiprocessing.get_context("spawn")
        try:
            for i, place in enumerate(placements):
                commands = ctx.Queue()
                reader, writer = ctx.Pipe(duplex=False)
                llm_i = {**kwargs, "device": place.device, "num_threads": place.num_threads,
                         "seed": replica_seed(kwargs.get("seed", 0), i)}
                proc = ctx.Process(target=replica_main, name=f"deepinfer-replica-{i}",
                                   args=(i, place.env, llm_i, commands, writer, log_level))
                proc.start()
                writer.close()  # the replica's end: its exit must read as EOF here
                self._replicas.append(_Replica(i, proc, commands, reader))
                log.info("replica %d: pid %d, device %s%s", i, proc.pid, place.device,
                         "".join(f", {k}={v}" for k, v in place.env.items()))
            # while the replicas load their models
            self.text_tokenizer = load_text_tokenizer(self.model_path)
            for r in self._replicas:
                r.info = self._wait_ready(r)
        except BaseException:
            self._stopping = True
            self._end_processes(10.0)
            raise
        atexit.register(self.stop, 10.0)
        first = self._replicas[0].info
        self.max_model_len: int = first["max_model_len"]
        self.max_num_seqs: int = first["max_num_seqs"]
        self.vocab_size: int = first["vocab_size"]
        self.info = first  # (hidden_size, enable_prompt_embeds: what the front end checks embeddings by)

    # ---- what the HTTP side reads ----------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self._replicas)

    @property
    def num_blocks(self) -> list[int]:
        """KV-cache blocks of each replica (they may differ on GPUs with different free memory)."""
        return [r.info["num_blocks"] for r in self._replicas]

    @property
    def cache_infos(self) -> list[dict[str, str]]:
        """The labels of each replica's ``cache_config_info`` metric."""
        return [r.info["cache"] for r in self._replicas]

    @property
    def pids(self) -> list[int]:
        return [r.process.pid for r in self._replicas]

    def apply_chat_template(self, conversation: Sequence[dict[str, str]], add_generation_prompt: bool = True,
                            chat_template_kwargs: dict[str, Any] | None = None,
                            chat_template: str | None = None) -> dict[str, list[int]]:
        from deepinfer.runtime.llm import chat_prompt

        return chat_prompt(self.text_tokenizer, self.model_path, conversation, add_generation_prompt,
                           chat_template_kwargs, chat_template)

    def attach_metrics(self, metrics: Sequence[ServerMetrics]) -> None:
        """Each replica's metrics (the front end replays its recorded updates on them)."""
        if len(metrics) != self.size:
            raise ValueError(f"{self.size} replicas need {self.size} ServerMetrics, got {len(metrics)}")
        for r, m in zip(self._replicas, metrics, strict=True):
            r.metrics = m

    @property
    def alive(self) -> bool:
        """Whether any replica can take requests."""
        return any(r.alive for r in self._replicas) and not self._stopping

    def unhealthy_reason(self) -> str | None:
        """None while every replica runs; else which died and why (what /health reports)."""
        dead = [r.death for r in self._replicas if r.death is not None]
        if not dead:
            return None
        live = sum(r.alive for r in self._replicas)
        return f"{'; '.join(dead)} ({live} of {self.size} replicas serving)"

    # ---- called on the event loop ----------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if any(r.metrics is None for r in self._replicas):
            raise RuntimeError("attach_metrics() before start()")
        self._loop = loop
        self._loop_thread = threading.get_ident()
        for r in self._replicas:
            r.reader = threading.Thread(target=self._read, args=(r,), name=f"deepinfer-replica-{r.index}-reader",
                                        daemon=True)
            r.reader.start()

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               sink: asyncio.Queue[Any], tag: int, prompt_embeds: Any = None, priority: int = 0,
               cache_salt: str | None = None) -> None:
        """Send a request to the least-loaded live replica; its RequestDelta / RequestFailed items
        arrive on ``sink`` (``prompt_embeds``: sent as ``embeds_to_wire``'s bytes)."""
        try:
            i = least_loaded([(r.seqs, r.tokens) if r.alive else None for r in self._replicas], self._next)
        except LookupError:
            sink.put_nowait(RequestFailed(tag, 503, self.unhealthy_reason() or "no replica is running"))
            return
        self._next = (i + 1) % self.size
        r = self._replicas[i]
        route = _Route(r, sink, tag, params.n, len(prompt_ids) + (params.max_tokens or 0) * params.n)
        r.seqs += route.seqs
        r.tokens += route.tokens
        self._routes[request_id] = route
        wire = None if prompt_embeds is None else embeds_to_wire(prompt_embeds)
        r.commands.put(("add", request_id, prompt_ids, params, request_id, tag, time.monotonic(), wire, priority,
                        cache_salt))

    def abort(self, request_id: str) -> None:
        """Abort a request on its replica (idempotent; unknown ids are ignored); any thread."""
        if self._loop is not None and threading.get_ident() != self._loop_thread:
            self._post(self.abort, request_id)
            return
        route = self._routes.pop(request_id, None)
        if route is None:
            return
        self._release(route)
        if route.replica.alive:
            route.replica.commands.put(("abort", request_id))

    def stop(self, timeout: float = 30.0) -> None:
        """Tell every replica to abort its requests and exit; terminate those that do not within
        ``timeout`` seconds. Idempotent."""
        if self._stopped:
            return
        self._stopped = self._stopping = True
        atexit.unregister(self.stop)
        self._end_processes(timeout)

    # ---- internals -------------------------------------------------------------------------
    def _wait_ready(self, r: _Replica) -> dict[str, Any]:
        while not r.conn.poll(0.5):
            if not r.process.is_alive() and not r.conn.poll(0):
                raise ReplicaError(f"replica {r.index} (pid {r.process.pid}) exited with code "
                                   f"{r.process.exitcode} while loading the model")
        try:
            msg = r.conn.recv()
        except EOFError:
            raise ReplicaError(f"replica {r.index} (pid {r.process.pid}) exited while loading the model") from None
        if msg[0] == "failed":
            _, kind, text = msg
            if kind in _LOAD_ERRORS:  # bad arguments: the same for every replica, say it as LLM does
                raise _LOAD_ERRORS[kind](text)
            raise ReplicaError(f"replica {r.index} could not load the model: {kind}: {text}")
        return msg[1]  # type: ignore[no-any-return]

    def _end_processes(self, timeout: float) -> None:
        for r in self._replicas:
            if r.process.is_alive():
                try:
                    r.commands.put(("stop",))
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + timeout
        for r in self._replicas:
            r.process.join(max(0.0, deadline - time.monotonic()))
        for r in self._replicas:
            if r.process.is_alive():
                log.warning("replica %d did not stop within %.0f s: terminating it", r.index, timeout)
                r.process.terminate()
                r.process.join(5)
            if r.process.is_alive():
                r.process.kill()
                r.process.join(5)
            r.commands.cancel_join_thread()  # a command a dead replica never read must not block exit
            r.commands.close()
        for r in self._replicas:
            if r.reader is not None:
                r.reader.join(10)

    def _read(self, r: _Replica) -> None:
        """Reader thread of one replica: every message to the event loop; EOF: the process ended."""
        while True:
            try:
                msg = r.conn.recv()
            except (EOFError, OSError):
                break
            self._post(self._on_message, r, msg)
        r.process.join(10)
        self._post(self._on_exit, r, r.process.exitcode)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass

    def _release(self, route: _Route) -> None:
        route.replica.seqs -= route.seqs
        route.replica.tokens -= route.tokens

    def _on_message(self, r: _Replica, msg: tuple[Any, ...]) -> None:
        if msg[0] == "died":
            self._mark_dead(r, f"its engine loop stopped: {msg[1]}")
            return
        _, events, batch = msg
        assert r.metrics is not None
        r.metrics.replay(events)
        for request_id, item in batch:
            route = self._routes.get(request_id)
            if route is None:  # aborted by its client
                continue
            if isinstance(item, RequestFailed) and item.status >= 500:
                item = RequestFailed(item.tag, item.status, f"replica {r.index}: {item.message}")
            if isinstance(item, RequestFailed) or (isinstance(item, RequestDelta) and item.finished):
                del self._routes[request_id]
                self._release(route)
            route.sink.put_nowait(item)

    def _on_exit(self, r: _Replica, exitcode: int | None) -> None:
        if self._stopping:
            r.alive = False
            return
        self._mark_dead(r, f"its process (pid {r.process.pid}) exited with code {exitcode}")

    def _mark_dead(self, r: _Replica, reason: str) -> None:
        """Fail the replica's requests with a 503 that names it; new requests go to the others."""
        if not r.alive:
            return
        r.alive = False
        r.death = f"replica {r.index} died: {reason}"
        log.error("%s; its requests fail, the other replicas keep serving, /health reports 503", r.death)
        assert r.metrics is not None
        for request_id, route in list(self._routes.items()):
            if route.replica is r:
                del self._routes[request_id]
                self._release(route)
                route.sink.put_nowait(RequestFailed(route.tag, 503, f"{r.death}; the request was running on it"))
                r.metrics.finished["error"].inc()
        r.metrics.running.set(0)  # nothing runs or waits there any more
        r.metrics.waiting.set(0)
