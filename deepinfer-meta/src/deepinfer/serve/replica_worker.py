"""The process of one data-parallel replica: an ``LLM`` on its device(s) and the engine thread's
loop, fed by the front end's command queue, answering through a pipe.

The loop is the in-process server's (``EngineThread``) run on this process's main thread; only
the two ends differ: commands come from a ``multiprocessing`` queue, and each loop turn's
outputs and metric updates go back as one pickled message on a ``multiprocessing`` pipe.

Messages to the front end: ``("ready", info)`` once the model is loaded, or ``("failed", type
name, message)`` if it could not be; then ``("batch", metric events, [(request id, item)])`` per
loop turn with news; ``("died", reason)`` if the loop itself broke (the process then exits 1).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import sys
from typing import Any

from deepinfer.serve.engine_thread import EngineThread
from deepinfer.serve.metrics import MetricsRecorder

log = logging.getLogger("deepinfer.serve")

PARENT_CHECK_S = 1.0  # how often an idle replica checks that the front end still lives


class _CommandQueue:
    """The front end's command queue as the engine thread reads it; an idle replica whose front
    end is gone (killed, so it never said stop) stops by itself instead of waiting forever."""

    def __init__(self, commands: Any) -> None:
        self._commands = commands
        self._parent = multiprocessing.parent_process()

    def get(self) -> tuple[Any, ...]:
        while True:
            try:
                return self._commands.get(timeout=PARENT_CHECK_S)  # type: ignore[no-any-return]
            except queue.Empty:
                if self._parent is not None and not self._parent.is_alive():
                    return ("stop",)

    def get_nowait(self) -> tuple[Any, ...]:
        return self._commands.get_nowait()  # type: ignore[no-any-return]


class ReplicaEngine(EngineThread):
    """The engine thread's loop with a command queue and a pipe as its two ends. The sink of an
    add is its request id: the front end maps it back to the HTTP handler's queue."""

    def __init__(self, llm: Any, commands: Any, conn: Any) -> None:
        super().__init__(llm, MetricsRecorder())  # type: ignore[arg-type]
        self._commands = _CommandQueue(commands)  # type: ignore[assignment]
        self._conn = conn
        self._pending: list[tuple[Any, Any]] = []

    def run(self) -> None:
        self._run()
        if self.error is not None:
            self._send(("died", repr(self.error)))

    def _deliver(self, batch: list[tuple[Any, Any]]) -> None:
        self._pending.extend(batch)

    def _flush(self) -> None:
        events = self._metrics.take()  # type: ignore[attr-defined]
        if events or self._pending:
            batch, self._pending = self._pending, []
            self._send(("batch", events, batch))

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            self._conn.send(message)
        except OSError:  # the front end is gone: nobody is waiting for these outputs
            log.error("the front end closed its pipe; this replica exits")
            os._exit(1)


def replica_main(index: int, env: dict[str, str], llm_kwargs: dict[str, Any], commands: Any, conn: Any,
                 log_level: str) -> None:
    """Entry point of a replica process (spawned: a fresh interpreter, not a fork). ``env`` (e.g.
    CUDA_VISIBLE_DEVICES, its GPU group) is set before anything initialises a device."""
    os.environ.update(env)
    # Ctrl-C in a terminal reaches the whole process group: the front end drains and then
    # stops the replicas, so a replica must not die of that SIGINT first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=getattr(logging, log_level.upper()), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s [replica {index}]: %(message)s")
    try:
        from deepinfer.runtime.llm import LLM
        from deepinfer.serve.engine_defaults import serve_llm_kwargs

        llm = LLM(**serve_llm_kwargs(llm_kwargs))
    except BaseException as exc:  # noqa: BLE001 - reported to the front end, which raises it
        conn.send(("failed", type(exc).__name__, str(exc)))
        return
    from deepinfer.serve.metrics import cache_info

    cfg = llm.engine.cfg
    conn.send(("ready", {"pid": os.getpid(), "device": str(llm.device), "model_path": str(llm.model_path),
                         "max_model_len": cfg.max_model_len, "max_num_seqs": cfg.max_num_seqs,
                         "num_blocks": cfg.num_blocks, "vocab_size": llm.model_config.vocab_size,
                         "cache": cache_info(llm), "hidden_size": llm.model_config.hidden_size,
                         "eos_token_ids": sorted(llm.eos_token_ids),
                         "enable_prompt_embeds": bool(llm.engine_args.enable_prompt_embeds)}))
    engine = ReplicaEngine(llm, commands, conn)
    engine.run()
    conn.close()
    if engine.error is not None:
        sys.exit(1)
