"""The engine-core process of ``deepinfer serve``: an ``LLM`` and its step loop, alone in a process.

It owns the device, the scheduler and the step loop, and never waits on HTTP work: the HTTP front
ends (one or more processes, ``--api-server-count``) talk to it over one ZeroMQ ROUTER socket
(pyzmq, an ``ipc://`` address), every message a msgpack array (msgspec). The loop is the
in-process server's (``EngineThread``) on this process's main thread; only its two ends differ.

Front end -> core (a DEALER socket each)::

    ["hello", pid]                                   once, first
    ["add", request_id, prompt_ids, params, tag, arrival(, embeds(, priority(, cache_salt)))]
                                                     params: sampling_params_fields();
                                                     embeds: [float32 bytes, [L, hidden]] (prompt embeddings)
    ["abort", [request_id, ...]]
    ["stop"]                                         abort everything and exit 0

Core -> front end, one message per loop turn (a step and the commands before it)::

    ["ready", info, [], [], []]                      the answer to hello
    ["batch", metric events, [[request_id, RequestDelta], ...], [[request_id, RequestFailed], ...],
     [[[request_id, ...], counts, token_ids], ...]]
    ["died", reason, [], [], []]                     the loop broke; the process exits 1

(every message has the batch's shape, so one typed msgspec decoder reads them all).

The last part carries the plain deltas (a request's output between its first and its last, with
one sample, no logprobs, token ids only) as columns: per request id the number of its new tokens
(``counts``, int32 little-endian bytes) and the tokens themselves, concatenated (``token_ids``,
the same), with no object per request in the core (``RequestOutputPool.add_columnar``). Each
row stands for ``RequestDelta(tag, [SampleDelta(0, ids, "", None, None, None)], False)`` (no
sample when it has no token); a request's first and last outputs, and every output of any other
request, are RequestDeltas. A request is in one part of a message at most.

Metric events go to every front end (each one's /metrics shows the whole engine); deltas and
failures go to the front end that added the request. A front end whose process is gone (its
pid no longer runs) has its requests aborted, so their blocks are free within one step.

Started as ``python -m deepinfer.serve.core CONFIG_JSON`` (a fresh interpreter: it never
re-imports the caller's ``__main__``); it prints one JSON line on stdout when the model is
loaded (``{"ready": info}``) or could not be (``{"failed": [type name, message]}``).
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import os
import queue
import signal
import sys
import time
from typing import Any

if __name__ == "__main__":  # the core process: torch before the engine's native module (below)
    # A native module built by a compiler that links libstdc++ statically, loaded before torch,
    # crashes torch's import (the H200 runs of this process did; docs/troubleshooting.md).
    # GOMP_SPINCOUNT first, as runtime/llm.py sets it: torch's OpenMP reads it when it loads.
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    import torch  # noqa: F401

from deepinfer.runtime.sampling_params import engine_values
from deepinfer.serve.engine_thread import (
    EngineThread,
    RequestDelta,
    RequestFailed,
    arrival_gap_seconds,
    embeds_from_wire,
)
from deepinfer.serve.metrics import MetricsRecorder

log = logging.getLogger("deepinfer.serve")

LIVENESS_CHECK_S = 0.5  # how often the core checks that its front ends and its parent still run

def sampling_params_fields(params: Any) -> dict[str, Any]:
    """A SamplingParams as plain data (what msgpack carries); ``SamplingParams(**fields)`` builds it
    back. Every field of the dataclass goes (a field added later is carried without an edit here):
    tuples as lists, ``logit_bias`` as a dict, ``structured_outputs`` as the dict of its fields."""
    import dataclasses

    engine = engine_values(params)  # (the engine's fields in one call, plain already)
    out: dict[str, Any] = {}
    for name in _field_names(params.__class__):
        if name in engine:
            out[name] = engine[name]
            continue
        v = getattr(params, name)
        if type(v) in _SCALARS:  # (most fields: checked first, once per request and field)
            pass
        elif isinstance(v, tuple):
            v = list(v)
        elif name == "logit_bias":
            v = dict(v)
        elif dataclasses.is_dataclass(v):  # StructuredOutputsParams
            v = {g.name: list(x) if isinstance(x := getattr(v, g.name), tuple) else x
                 for g in dataclasses.fields(v) if g.init}
        out[name] = v
    return out


_SCALARS = (int, float, bool, str, type(None))


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    import dataclasses

    return tuple(f.name for f in dataclasses.fields(cls))


#: a step's plain deltas of one front end's requests: (request ids, counts, token ids) as above
Columns = tuple[list[str], bytes, bytes]
BatchMessage = tuple[str, list[Any], list[tuple[str, RequestDelta]], list[tuple[str, RequestFailed]], list[Columns]]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] not in (b"Z", b"X")


class _Commands:
    """The ROUTER socket as the engine loop's command queue: decodes adds and aborts, answers
    hellos, and turns a gone front end (or a gone parent) into aborts (or a stop)."""

    def __init__(self, core: CoreEngine, sock: Any, parent_pid: int) -> None:
        import msgspec

        self._core, self._sock, self._parent_pid = core, sock, parent_pid
        self._decoder = msgspec.msgpack.Decoder()
        self._ready: list[tuple[Any, ...]] = []
        self._next_check = 0.0

    def get(self, timeout: float | None = None) -> tuple[Any, ...]:
        """The next command, waiting for one (at most ``timeout`` seconds: then queue.Empty)."""
        import zmq

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._ready:
                return self._ready.pop(0)
            wait = LIVENESS_CHECK_S if deadline is None else min(LIVENESS_CHECK_S, deadline - time.monotonic())
            if wait <= 0:
                raise queue.Empty
            if self._sock.poll(max(1, int(wait * 1000)), zmq.POLLIN):
                self._receive()
            self._check(force=deadline is None)

    def get_nowait(self) -> tuple[Any, ...]:
        if not self._ready:
            self._receive()
            self._check(force=False)
        if not self._ready:
            raise queue.Empty
        return self._ready.pop(0)

    def _receive(self) -> None:
        import zmq

        from deepinfer.runtime.sampling_params import SamplingParams

        sock = self._sock
        # (the socket's event flags first: a receive on an empty socket raises zmq.Again, and
        # building that exception every loop turn cost more than the rest of this check)
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                ident, raw = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self._decoder.decode(raw)
            kind = msg[0]
            if kind == "add":
                _, rid, prompt_ids, fields, tag, arrival, *rest = msg
                try:
                    params = SamplingParams(**fields)
                    embeds = embeds_from_wire(rest[0]) if rest and rest[0] is not None else None
                    priority = rest[1] if len(rest) > 1 else 0
                    if isinstance(priority, bool) or not isinstance(priority, int):
                        raise TypeError(f"priority must be an int, got {priority!r}")
                    salt = rest[2] if len(rest) > 2 else None
                    if salt is not None and not isinstance(salt, str):
                        raise TypeError(f"cache_salt must be a str, got {salt!r:.40}")
                except (TypeError, ValueError) as exc:  # the front end checked it; say so, never crash
                    self._core.send_to(ident, ("batch", [], [], [(rid, RequestFailed(tag, 400, str(exc)))], []))
                    continue
                self._ready.append(("add", rid, prompt_ids, params, (ident, rid), tag, arrival, embeds, priority,
                                    salt))
            elif kind == "abort":
                self._ready.extend(("abort", rid) for rid in msg[1])
            elif kind == "hello":
                self._core.frontends[ident] = int(msg[1])
                self._core.send_to(ident, ("ready", self._core.info, [], [], []))
            elif kind == "stop":
                self._ready.append(("stop",))
            else:
                log.error("unknown message %r from a front end: ignored", kind)

    def _check(self, force: bool) -> None:
        now = time.monotonic()
        if not force and now < self._next_check:
            return
        self._next_check = now + LIVENESS_CHECK_S
        if self._core.stop_requested or os.getppid() != self._parent_pid:
            self._ready.append(("stop",))
            return
        for ident, pid in list(self._core.frontends.items()):
            if pid_alive(pid):
                continue
            del self._core.frontends[ident]
            gone = [rid for rid, live in self._core.live_requests() if live.sink[0] == ident]
            log.warning("front end pid %d is gone: aborting its %d requests", pid, len(gone))
            self._ready.extend(("abort", rid) for rid in gone)


class CoreEngine(EngineThread):
    """The engine thread's loop with the ROUTER socket as both ends. The sink of an add is
    ``(front end identity, request id)``.

    A request sent as token ids only (its front end makes the text) with one sample and no
    logprobs has a slot: the engine writes its plain deltas as rows naming the slot
    (``EngineLoop.take_columns``), and a step's rows go to their front ends as columns, counted
    in the metrics with numpy over the slot arrays (its last token time, its generated tokens,
    its id and its front end), so the core does no Python work per request and step for them."""

    columnar = True
    defer_outputs = True

    def __init__(self, llm: Any, sock: Any, info: dict[str, Any], parent_pid: int, arrival_gap_s: float = 0.0) -> None:
        import msgspec
        import numpy as np

        super().__init__(llm, MetricsRecorder(), arrival_gap_s)  # type: ignore[arg-type]
        self._sock = sock
        self.info = info
        self.frontends: dict[bytes, int] = {}
        self.stop_requested = False
        self._encoder = msgspec.msgpack.Encoder()
        self._commands = _Commands(self, sock, parent_pid)  # type: ignore[assignment]
        # per front end: (deltas, failures, columns)
        self._pending: dict[bytes, tuple[list[Any], list[Any], list[Any]]] = {}
        self._np = np
        self._slot_last = np.zeros(0, np.float64)  # last token time (time.monotonic())
        self._slot_generated = np.zeros(0, np.int64)
        self._slot_rid = np.zeros(0, object)  # None: free
        self._slot_used = np.zeros(0, np.bool_)
        self._slot_fe = np.zeros(0, np.int32)  # index in _fe_idents
        self._free_slots: list[int] = []
        self._fe_index: dict[bytes, int] = {}
        self._fe_idents: list[bytes] = []

    def live_requests(self) -> list[tuple[str, Any]]:
        return list(self._live.items())

    def run(self) -> None:
        self._run()
        if self.error is not None:
            self._broadcast(("died", repr(self.error), [], [], []))

    def send_to(self, ident: bytes, message: Any) -> None:
        import zmq

        try:
            self._sock.send_multipart([ident, self._encoder.encode(message)], zmq.NOBLOCK)
        except zmq.Again:  # this front end does not read (gone or stuck): its pid check aborts its requests
            log.warning("a front end's queue is full: a message to it was dropped")

    def _broadcast(self, message: Any) -> None:
        for ident in list(self.frontends):
            self.send_to(ident, message)

    def _deliver(self, batch: list[tuple[Any, Any]]) -> None:
        pending = self._pending
        for (ident, rid), item in batch:
            lists = pending.get(ident)  # (not setdefault: it built the lists per item)
            if lists is None:
                lists = pending[ident] = ([], [], [])
            lists[1 if type(item) is RequestFailed else 0].append((rid, item))  # (deltas, failures)

    # ---- slots and columns -----------------------------------------------------------------
    def _new_slot(self, sink: Any, request_id: str) -> int:
        np = self._np
        if not self._free_slots:  # twice the arrays (a slot is a request that runs)
            old = len(self._slot_rid)
            size = max(64, 2 * old)
            self._slot_last = np.concatenate([self._slot_last, np.zeros(size - old, np.float64)])
            self._slot_generated = np.concatenate([self._slot_generated, np.zeros(size - old, np.int64)])
            self._slot_rid = np.concatenate([self._slot_rid, np.full(size - old, None, object)])
            self._slot_used = np.concatenate([self._slot_used, np.zeros(size - old, np.bool_)])
            self._slot_fe = np.concatenate([self._slot_fe, np.zeros(size - old, np.int32)])
            self._free_slots = list(range(size - 1, old - 1, -1))
        slot = self._free_slots.pop()
        ident = sink[0]
        fe = self._fe_index.get(ident)
        if fe is None:
            fe = self._fe_index[ident] = len(self._fe_idents)
            self._fe_idents.append(ident)
        self._slot_rid[slot] = request_id
        self._slot_used[slot] = True
        self._slot_fe[slot] = fe
        self._slot_last[slot] = 0.0
        self._slot_generated[slot] = 0
        return slot

    def _free_slot(self, slot: int) -> None:
        self._slot_rid[slot] = None
        self._slot_used[slot] = False
        self._free_slots.append(slot)

    def _slot_times(self, slot: int) -> tuple[float, int]:
        return float(self._slot_last[slot]), int(self._slot_generated[slot])

    def _set_slot_times(self, slot: int, last_token: float, generated: int) -> None:
        self._slot_last[slot] = last_token
        self._slot_generated[slot] = generated

    def _take_columns(self, engine: Any, now: float, itl: list[float]) -> int:
        # (taken after every step: the rows of one build, a slot in one row at most, which the
        # inter-token latencies below assume)
        np = self._np
        slots, offsets, tokens = engine.take_columns()
        if not len(slots):
            return 0
        known = self._slot_used[slots]
        if not known.all():  # rows of a request released since its step (not taken after it)
            keep = np.repeat(known, np.diff(offsets))
            slots, tokens = slots[known], tokens[keep]
            offsets = np.concatenate([[0], np.cumsum(np.diff(offsets)[known])])
            if not len(slots):
                return 0
        rids = self._slot_rid[slots]
        per_row = np.diff(offsets)  # int64
        counts = per_row.astype("<i4")
        moved = slots[counts > 0]
        # the same values, per request, as EngineThread's per-output path: now - its last token
        itl.extend((now - self._slot_last[moved]).tolist())
        self._slot_last[moved] = now
        # (int64 into int64: ~4 us a step of 256 rows; with the int32 counts np.add.at took ~27)
        np.add.at(self._slot_generated, slots, per_row)
        tokens = tokens.astype("<i4", copy=False)
        fe = self._slot_fe[slots] if len(self._fe_idents) > 1 else None
        if fe is None or (fe == fe[0]).all():  # one front end (the common case)
            self._columns_for(0 if fe is None else int(fe[0])).append((rids.tolist(), counts.tobytes(),
                                                                       tokens.tobytes()))
        else:  # (a loop over the few front ends, not np.unique; a plain decode has one token a row)
            per_token = fe if len(tokens) == len(fe) and (per_row == 1).all() else np.repeat(fe, counts)
            for k in range(len(self._fe_idents)):
                mine = fe == k
                if mine.any():
                    self._columns_for(k).append((rids[mine].tolist(), counts[mine].tobytes(),
                                                 tokens[per_token == k].tobytes()))
        return int(offsets[-1])

    def _columns_for(self, fe: int) -> list[Columns]:
        ident = self._fe_idents[fe]
        lists = self._pending.get(ident)
        if lists is None:
            lists = self._pending[ident] = ([], [], [])
        return lists[2]

    def _flush(self) -> None:
        events = self._metrics.take()  # type: ignore[attr-defined]
        if not events and not self._pending:
            return
        pending, self._pending = self._pending, {}
        for ident in self.frontends:
            deltas, failures, columns = pending.pop(ident, ([], [], []))
            self.send_to(ident, ("batch", events, deltas, failures, columns))
        for ident, (deltas, failures, columns) in pending.items():  # a front end that never said hello
            self.send_to(ident, ("batch", [], deltas, failures, columns))


def core_main(config: dict[str, Any]) -> int:
    """Load the model, bind ``config["address"]`` and run the loop until told to stop (0) or the
    loop breaks (1). ZeroMQ and msgspec are imported only once the model is loaded, so torch and
    the device come first in this process. (On the H200 a core that had loaded msgspec and numpy
    died of a segfault inside its first ``import torch``; whether the order is the cause is not
    established yet: see the serving guide, "Known issues".)"""
    os.environ.update(config.get("env") or {})
    logging.basicConfig(level=getattr(logging, config.get("log_level", "info").upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s [engine core]: %(message)s")
    parent_pid = int(config.get("parent_pid") or os.getppid())
    stop = {"flag": False}

    def on_term(signum: int, frame: Any) -> None:  # SIGTERM: abort what runs, exit 0
        stop["flag"] = True
        if engine is not None:
            engine.stop_requested = True

    engine: CoreEngine | None = None
    # Ctrl-C reaches the whole process group: the front ends drain, then the supervisor stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, on_term)
    try:
        from deepinfer.runtime.llm import LLM
        from deepinfer.serve.engine_defaults import serve_llm_kwargs

        llm = LLM(**serve_llm_kwargs(config["llm_kwargs"]))
    except BaseException as exc:  # noqa: BLE001 - reported to the supervisor, which raises it
        print(json.dumps({"failed": [type(exc).__name__, str(exc)]}), flush=True)
        return 1
    import zmq

    from deepinfer.serve.metrics import cache_info

    cfg = llm.engine.cfg
    info = {"pid": os.getpid(), "device": str(llm.device), "model_path": str(llm.model_path),
            "max_model_len": cfg.max_model_len, "max_num_seqs": cfg.max_num_seqs, "num_blocks": cfg.num_blocks,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "vocab_size": llm.model_config.vocab_size, "cache": cache_info(llm),
            "max_logprobs": getattr(llm.engine_args, "max_logprobs", 20),
            "scheduling_policy": getattr(llm.engine_args, "scheduling_policy", "fcfs"),
            "hidden_size": llm.model_config.hidden_size, "eos_token_ids": sorted(llm.eos_token_ids),
            "enable_prompt_embeds": bool(getattr(llm.engine_args, "enable_prompt_embeds", False))}
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # one message per step: never drop one for a live front end
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(config["address"])
    engine = CoreEngine(llm, sock, info, parent_pid, arrival_gap_seconds(llm.device.type, config.get("arrival_gap_ms")))
    engine.stop_requested = stop["flag"]
    # The model, torch and every module live as long as this process: out of the garbage
    # collector's sight, so that a full collection (~190 ms of CPU over a tiny model's 375k
    # objects on the 2-core CI machine) never stalls the step loop; what serving makes is
    # collected as before.
    gc.collect()
    gc.freeze()
    print(json.dumps({"ready": info}), flush=True)
    engine.run()
    sock.close(0)
    ctx.term()
    return 1 if engine.error is not None else 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m deepinfer.serve.core CONFIG_JSON", file=sys.stderr)
        return 2
    return core_main(json.loads(args[0]))


if __name__ == "__main__":
    sys.exit(main())
