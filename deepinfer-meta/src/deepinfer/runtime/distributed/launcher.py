"""Start the ranks of a tensor-parallel ``LLM`` and watch them.

* Spawned (the default): rank 0 is the calling process; ranks 1..N-1 are started with
  ``torch.multiprocessing`` (spawn) and rendezvous at a TCP store rank 0 hosts on 127.0.0.1.
  Scripts that create an ``LLM`` with ``tensor_parallel_size > 1`` therefore need the usual
  ``if __name__ == "__main__":`` guard.
* Under ``torchrun``: every process runs the user's script; ``LLM(...)`` joins the environment
  rendezvous (``env://``). On rank 0 it returns the ``LLM``; on the other ranks it serves rank 0's
  steps and then ends the process (``SystemExit(0)``) when rank 0's ``LLM`` is closed.

``WorkerProcesses`` keeps the spawned processes: a watchdog thread notices a rank that exits,
aborts the data group (so a collective blocked on NCCL returns) and the next or current step
fails with an error naming the rank.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import queue
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from deepinfer.runtime.distributed.rank import RankSpec, run_rank, worker_main
from deepinfer.runtime.parallel.process_group import (
    TensorParallelGroup,
    init_groups,
    torchrun_rank,
)

#: How long a failed collective waits for the rank that caused it to be seen exiting.
_DEATH_GRACE_S = 5.0


class TensorParallelError(RuntimeError):
    """A rank of a tensor-parallel LLM failed (it died, or a collective with it failed)."""


class WorkerProcesses:
    """The spawned ranks 1..N-1, their error reports and the watchdog over them."""

    def __init__(self, procs: dict[int, Any], errors: Any) -> None:
        self.procs = procs
        self.errors = errors
        self._reports: dict[int, tuple[str, str]] = {}
        self._closing = False
        self.group: TensorParallelGroup | None = None
        self.dead_event = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="deepinfer-tp-watchdog", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        from multiprocessing.connection import wait

        sentinels = {p.sentinel: r for r, p in self.procs.items()}
        wait(list(sentinels))  # returns when any rank's process has ended
        if self._closing:
            return
        self.dead_event.set()
        if self.group is not None and self.group.device.type == "cuda":
            # NCCL collectives do not notice a dead peer: abort them so the step returns
            with contextlib.suppress(Exception):
                dist.distributed_c10d._abort_process_group(self.group.data_group)

    def _drain(self) -> None:
        while True:
            try:
                rank, line, tb = self.errors.get_nowait()
            except (queue.Empty, OSError, EOFError, ValueError):
                return
            self._reports[rank] = (line, tb)

    def dead_rank(self) -> str | None:
        """A description of the first rank that has exited, or None while all run."""
        for rank, p in sorted(self.procs.items()):
            if p.exitcode is not None:
                self._drain()
                why = self._reports.get(rank, (None, None))[0]
                return (f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                        + (f": {why}" if why else ""))
        return None

    def failure(self, exc: BaseException | None,
                consequence: str = "the LLM cannot run further steps") -> TensorParallelError:
        """The error of a failed step: names the dead rank (waiting a moment for it to be seen)."""
        deadline = time.monotonic() + _DEATH_GRACE_S
        dead = self.dead_rank()
        while dead is None and exc is not None and time.monotonic() < deadline:
            time.sleep(0.05)
            dead = self.dead_rank()
        cause = f" ({type(exc).__name__}: {exc})" if exc is not None else ""
        if dead is not None:
            return TensorParallelError(f"{dead}; {consequence}{cause}")
        return TensorParallelError(f"a tensor-parallel step failed{cause}; {consequence}")

    @property
    def stopped(self) -> bool:
        return self._closing

    def stop(self, timeout: float = 10.0) -> None:
        """End every rank that still runs (after rank 0 sent OP_SHUTDOWN, they exit by themselves)."""
        self._closing = True
        end = time.monotonic() + timeout
        for p in self.procs.values():
            p.join(max(0.0, end - time.monotonic()))
        for p in self.procs.values():
            if p.exitcode is None:
                p.terminate()
                p.join(2.0)
            if p.exitcode is None:
                p.kill()
                p.join(2.0)


def start_tensor_parallel(spec: RankSpec) -> tuple[TensorParallelGroup, WorkerProcesses | None]:
    """Start (or join, under torchrun) the ranks of ``spec``; returns rank 0's group and the
    spawned processes (None under torchrun). On a torchrun rank > 0 this serves rank 0's steps
    and ends with SystemExit(0)."""
    env = torchrun_rank()
    if env is not None:
        rank, world, local = env
        dev = torch.device(spec.devices[local]) if local < len(spec.devices) else torch.device(spec.devices[0])
        group = init_groups(rank, world, dev, "env://", spec.timeout_s)
        if rank != 0:
            run_rank(spec, group)
            dist.destroy_process_group()
            raise SystemExit(0)
        return group, None
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, spec.world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=spec.timeout_s))
    spec.init_method = f"tcp://127.0.0.1:{store.port}"
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = {}
    for rank in range(1, spec.world_size):
        p = ctx.Process(target=worker_main, args=(rank, spec, errors), name=f"deepinfer-tp-rank{rank}", daemon=True)
        p.start()
        procs[rank] = p
    workers = WorkerProcesses(procs, errors)
    try:
        _wait_until_started(store, workers, spec.timeout_s)
        group = init_groups(0, spec.world_size, torch.device(spec.devices[0]), spec.init_method, spec.timeout_s,
                            store=store)
    except BaseException as exc:
        err = workers.failure(exc, "the tensor-parallel LLM could not start")
        workers.stop(timeout=0.0)
        raise err from exc
    workers.group = group
    _stop_at_exit(workers)
    return group, workers


def started_key(rank: int) -> str:
    """The store key a spawned rank sets once it runs and reached rank 0's store."""
    return f"deepinfer_tp_started_{rank}"


def _wait_until_started(store: Any, workers: WorkerProcesses, timeout_s: float) -> None:
    """Wait until every spawned rank has reached the store; a rank that dies first (an import
    error, a bad device) fails the start at once instead of after the rendezvous timeout."""
    keys = [started_key(r) for r in workers.procs]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        dead = workers.dead_rank()
        if dead is not None:
            raise TensorParallelError(f"{dead}; the tensor-parallel LLM could not start")
        if time.monotonic() > deadline:
            raise TensorParallelError(f"the tensor-parallel ranks did not start within {timeout_s:g} s "
                                      "(DEEPINFER_TP_TIMEOUT_S)")
        time.sleep(0.02)


def _stop_at_exit(workers: WorkerProcesses) -> None:
    ref = weakref.ref(workers)

    def stop() -> None:
        w = ref()
        if w is not None and not w.stopped:
            w.stop(timeout=2.0)
            if dist.is_initialized():
                dist.destroy_process_group()

    atexit.register(stop)


def start_group(spec: RankSpec, cfg: Any, tp_size: int,
                device: torch.device) -> tuple[TensorParallelGroup, WorkerProcesses | None]:
    """Check that ``cfg`` splits ``tp_size`` ways on ``device``'s kind, then start the ranks
    (ValueError naming both numbers otherwise)."""
    import os

    from deepinfer.runtime.parallel.process_group import check_devices, check_divisible

    env = torchrun_rank()
    if env is not None and env[1] != tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} differs from torchrun's WORLD_SIZE={env[1]}: "
                         "start as many processes as tensor-parallel ranks")
    check_divisible(cfg, tp_size)
    if dist.is_initialized() and env is None:
        raise RuntimeError("a torch.distributed process group is already active in this process (another "
                           "tensor-parallel LLM?): close() it before starting a tensor-parallel LLM")
    spec.devices = [str(d) for d in check_devices(tp_size, device)]
    if device.type == "cpu" and spec.num_threads is None:
        # the ranks share the host's cores: give each its part instead of every core
        spec.num_threads = max(1, (os.cpu_count() or 1) // tp_size)
    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    return start_tensor_parallel(spec)


def stop_group(workers: WorkerProcesses | None) -> None:
    """End the spawned ranks (at once) and leave the process group."""
    if workers is not None:
        workers.stop(timeout=0.0)
    if dist.is_initialized():
        dist.destroy_process_group()
