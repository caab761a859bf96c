"""The engine-core process seen from the process that starts it (the ``deepinfer serve``
supervisor): ``CoreProcess`` starts ``python -m deepinfer.serve.core`` (a fresh interpreter, never
a fork, never the caller's ``__main__``), waits for its model to load, and stops it. Several
cores (``--data-parallel-size``) are started first and waited for after, so they load together.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Any

log = logging.getLogger("deepinfer.serve")

_LOAD_ERRORS: dict[str, type[Exception]] = {"ValueError": ValueError, "TypeError": TypeError,
                                            "FileNotFoundError": FileNotFoundError}

class CoreError(RuntimeError):
    """The engine-core process could not start (it exited, or its model failed to load)."""


class CoreProcess:
    """The engine-core process: ``LLM(**llm_kwargs)`` behind an ``ipc://`` socket, with ``env``
    added to its environment (e.g. its GPU group as CUDA_VISIBLE_DEVICES). Construction returns
    once the model is loaded (``info``: its limits), raising the core's error if it could not be
    (ValueError, TypeError, FileNotFoundError as LLM raises them; else CoreError); with
    ``wait=False`` it returns at once, and ``wait_ready()`` does that part."""

    def __init__(self, llm_kwargs: dict[str, Any], log_level: str = "info", env: dict[str, str] | None = None,
                 wait: bool = True, name: str = "engine core", arrival_gap_ms: float | None = None) -> None:
        self._dir = tempfile.mkdtemp(prefix="deepinfer-core-")
        self.address = f"ipc://{self._dir}/engine.sock"
        self.name = name
        config = {"address": self.address, "llm_kwargs": llm_kwargs, "log_level": log_level,
                  "parent_pid": os.getpid(), "env": env or {}, "arrival_gap_ms": arrival_gap_ms}
        try:
            payload = json.dumps(config)
        except TypeError as exc:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise TypeError(f"the engine core's arguments must be JSON values: {exc}") from None
        # the environment before the interpreter starts: nothing may initialise a device first
        self.proc = subprocess.Popen([sys.executable, "-m", "deepinfer.serve.core", payload],
                                     stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **env} if env else None)
        self._stopped = False
        self.info: dict[str, Any] = {}
        if wait:
            self.wait_ready()

    def wait_ready(self) -> dict[str, Any]:
        """Block until the core has loaded its model (its ``info``); its load error otherwise."""
        if self.info:
            return self.info
        try:
            assert self.proc.stdout is not None
            line = self.proc.stdout.readline()
            if not line:
                raise CoreError(f"the {self.name} (pid {self.proc.pid}) exited with code {self.proc.wait()} "
                                "while loading the model")
            msg = json.loads(line)
            if "failed" in msg:
                kind, text = msg["failed"]
                self.proc.wait(30)
                if kind in _LOAD_ERRORS:
                    raise _LOAD_ERRORS[kind](text)
                raise CoreError(f"the {self.name} could not load the model: {kind}: {text}")
        except BaseException:
            self.stop(5.0)
            raise
        self.info = msg["ready"]
        log.info("%s: pid %d, device %s, %d KV blocks, steps of up to %s tokens", self.name, self.proc.pid,
                 self.info["device"], self.info["num_blocks"], self.info["max_num_batched_tokens"])
        # the core's stdout after its ready line (torch may print there) must not fill the pipe
        threading.Thread(target=_drain, args=(self.proc.stdout,), name="deepinfer-core-stdout", daemon=True).start()
        return self.info

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
