"""Rank 0's side of a tensor-parallel step: send the step to the other ranks, then run it too.

``DriverRunner`` is the ``ModelRunner`` the engine loop drives on rank 0: ``execute`` and
``copy_blocks`` first broadcast what they run (``step_channel``), and captured decode graphs
are wrapped so each replay is announced with the step buffers it reads. Every rank then runs
the same forward on its shard, meeting in the same collectives. A failure of any of this ends
the tensor-parallel group: the step raises ``TensorParallelError`` naming the rank that died
(when one did), and so does every later step.
"""

from __future__ import annotations

import atexit
import contextlib
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

from deepinfer.runtime.distributed.launcher import TensorParallelError, WorkerProcesses, stop_group
from deepinfer.runtime.distributed.step_channel import (
    OP_COPY_BLOCKS,
    OP_EXECUTE,
    OP_REPLAY,
    OP_SHUTDOWN,
    StepChannel,
    pack_execute,
)
from deepinfer.runtime.interrupts import sigint_deferred as _sigint_deferred
from deepinfer.runtime.parallel.process_group import TensorParallelGroup
from deepinfer.runtime.worker.model_runner import ModelRunner

T = TypeVar("T")


class DriverRunner(ModelRunner):
    """A ModelRunner on rank 0 of ``group`` that makes the other ranks run every call with it."""

    def __init__(self, loaded: Any, *, group: TensorParallelGroup, workers: WorkerProcesses | None,
                 **kwargs: Any) -> None:
        self.group, self.workers = group, workers
        self.channel = StepChannel(group)
        self.broken: TensorParallelError | None = None
        super().__init__(loaded, **kwargs)
        _close_at_exit(self)

    # graphs captured by capture_decode_graphs are announced to the other ranks on each replay
    @property  # type: ignore[override]
    def graphs(self) -> Any:
        return self._graphs

    @graphs.setter
    def graphs(self, value: Any) -> None:
        self._graphs = None if value is None or isinstance(value, BroadcastGraphs) else BroadcastGraphs(value, self)

    def guarded(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run one piece of a step; any failure (or a rank found dead) ends the group with an
        error naming the rank."""
        if self.broken is not None:
            raise self.broken
        if self.workers is not None and self.workers.dead_event.is_set():
            self._break(None)
        try:
            return fn(*args, **kwargs)
        except TensorParallelError:
            raise
        except Exception as exc:
            self._break(exc)
            raise AssertionError("unreachable") from exc

    def _break(self, exc: BaseException | None) -> None:
        if self.workers is not None:
            err = self.workers.failure(exc)
            stop_group(self.workers)  # the rest of the ranks cannot go on without the dead one
        else:
            err = TensorParallelError(f"a tensor-parallel step failed ({type(exc).__name__}: {exc}); "
                                      "the LLM cannot run further steps")
        self.broken = err
        raise err from exc

    # A Ctrl-C between the message and the forward would leave the other ranks inside a
    # collective that rank 0 never joins: it is delivered once the step's part is done.
    def execute(self, **arrays: np.ndarray) -> torch.Tensor:  # type: ignore[override]
        fields, payload = pack_execute(arrays, self.block_size)
        with _sigint_deferred():
            self.guarded(self.channel.send, OP_EXECUTE, fields, payload)
            return self.guarded(super().execute, **arrays)

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        if len(src) == 0:
            return
        pairs = torch.from_numpy(np.stack([np.asarray(src, np.int64), np.asarray(dst, np.int64)]).reshape(-1))
        with _sigint_deferred():
            self.guarded(self.channel.send, OP_COPY_BLOCKS, [len(src)], pairs)
            self.guarded(super().copy_blocks, src, dst)

    def close(self) -> None:
        """Tell the other ranks to stop and wait for them (idempotent)."""
        if self.broken is None:
            try:
                self.channel.send(OP_SHUTDOWN)
                self.channel.leave()
            except Exception:  # noqa: BLE001 - a rank is already gone: stop the rest below
                pass
            self.broken = TensorParallelError("the tensor-parallel LLM was closed")
        if self.workers is not None:
            self.workers.stop()
        stop_group(None)


def _close_at_exit(driver: DriverRunner) -> None:
    """A program that ends without ``LLM.close()`` still shuts the other ranks down in order
    (registered after the launcher's stop, so it runs first)."""
    ref = weakref.ref(driver)

    def close() -> None:
        d = ref()
        if d is not None:
            with contextlib.suppress(Exception):
                d.close()

    atexit.register(close)


class BroadcastGraphs:
    """A CudaGraphRunner on rank 0 whose replays are announced to the other ranks first."""

    def __init__(self, inner: Any, driver: DriverRunner) -> None:
        self.inner, self.driver = inner, driver

    def __getattr__(self, name: str) -> Any:  # batch_sizes, timer, num_replays, ...
        return getattr(self.inner, name)

    def can_replay(self, args: Any) -> bool:
        return bool(self.inner.can_replay(args))

    def replay(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        buffers = self.inner.buffers
        n = buffers.bytes_for_batch(rows)
        # The other ranks copy these bytes into their pinned buffers and replay; they overwrite
        # them only after the next message, which rank 0 sends after this step's results came
        # back (so after every rank's copy of them ran: it precedes the graph's collectives).
        with _sigint_deferred():
            self.driver.guarded(self.driver.channel.send, OP_REPLAY, [rows, n], buffers.host[:n])
            result: tuple[torch.Tensor, torch.Tensor] = self.driver.guarded(self.inner.replay, rows)
        return result
