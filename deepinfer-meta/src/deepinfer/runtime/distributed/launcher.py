"""Start the ranks of a tensor-parallel ``LLM`` and watch them.

* Spawned (the default): rank 0 is the calling process; ranks 1..N-1 are fresh interpreters
  started as ``python -m deepinfer.runtime.distributed.rank RANK`` (``subprocess``, the same
  ``sys.executable`` and ``sys.path``), never by importing the user's ``__main__``: scripts
  without an ``if __name__ == "__main__":`` guard, ``python -``, ``python -c`` and notebooks all
  work. Each rank reads its ``RankSpec`` from stdin and meets rank 0 at a TCP store rank 0 hosts
  on 127.0.0.1.
* Under ``torchrun``: every process runs the user's script; ``LLM(...)`` joins the environment
  rendezvous (``env://``). On rank 0 it returns the ``LLM``; on the other ranks it serves rank 0's
  steps and then ends the process (``SystemExit(0)``) when rank 0's ``LLM`` is closed.

``WorkerProcesses`` keeps the spawned processes: each one's stdout and stderr are read by a
thread that copies them to this process's stderr and keeps the last lines; a watchdog thread per
rank notices a rank that exits, aborts the data group (so a collective blocked on NCCL returns)
and the next or current step fails with an error naming the rank, with its own error report
and the last lines of its stderr.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import datetime
import json
import os
import pickle
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from deepinfer.runtime.distributed.rank import REPORT_PREFIX, RankSpec, run_rank, started_key
from deepinfer.runtime.engine_args import EngineArgs
from deepinfer.runtime.parallel.process_group import (
    TensorParallelGroup,
    check_devices,
    check_divisible,
    collective_timeout_s,
    init_groups,
    torchrun_rank,
)

#: How long a failed collective waits for the rank that caused it to be seen exiting.
_DEATH_GRACE_S = 5.0
#: Lines of a rank's stderr kept for the error that names it.
STDERR_TAIL_LINES = 20


class TensorParallelError(RuntimeError):
    """A rank of a tensor-parallel LLM failed (it died, or a collective with it failed)."""


def rank_command(rank: int) -> list[str]:
    """The command line of spawned rank ``rank``."""
    return [sys.executable, "-m", "deepinfer.runtime.distributed.rank", str(rank)]


def _rank_environment() -> dict[str, str]:
    """This process's environment, with its ``sys.path`` as PYTHONPATH: the rank imports what
    rank 0 imports (a script may have put deepinfer on its path by itself)."""
    paths = [p for p in sys.path if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


class RankProcess:
    """One spawned rank: its process, the reader of its output and what it reported."""

    def __init__(self, rank: int, spec: RankSpec) -> None:
        self.rank = rank
        self.tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self.report: str | None = None
        read_end, write_end = os.pipe()
        try:
            # its own session: a Ctrl-C at the terminal is rank 0's to handle (even while the
            # rank is still importing); rank 0 ends it (its stdin, then signals)
            self.popen = subprocess.Popen(rank_command(rank), stdin=subprocess.PIPE, stdout=write_end,
                                          stderr=write_end, env=_rank_environment(), close_fds=True,
                                          start_new_session=True)
        finally:
            os.close(write_end)
        self.pid = self.popen.pid
        self._reader = threading.Thread(target=self._read, args=(read_end,), name=f"deepinfer-tp-rank{rank}-output",
                                        daemon=True)
        self._reader.start()
        data = pickle.dumps(spec)
        assert self.popen.stdin is not None
        try:  # the pipe stays open: its end tells the rank that this process is gone
            self.popen.stdin.write(len(data).to_bytes(8, "little") + data)
            self.popen.stdin.flush()
        except OSError:  # it died at once: the watchdog sees it, the output says why
            pass

    def _read(self, fd: int) -> None:
        """Copy the rank's output to our stderr (its report lines excepted), keeping the last lines."""
        with open(fd, "rb") as stream:
            for raw in stream:
                line = raw.decode("utf-8", "replace")
                if line.startswith(REPORT_PREFIX):
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        self.report = str(json.loads(line[len(REPORT_PREFIX):])["error"])
                    continue
                self.tail.append(line.rstrip("\n"))
                with contextlib.suppress(Exception):  # our stderr may be closed
                    sys.stderr.write(line)
                    sys.stderr.flush()

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def output_done(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until the rank's output has been read to its end."""
        self._reader.join(timeout)

    def describe(self) -> str:
        """'tensor-parallel rank R (pid P) exited with code C: <its error>' (once it exited)."""
        self.output_done(2.0)
        why = f": {self.report}" if self.report else ""
        return f"tensor-parallel rank {self.rank} (pid {self.pid}) exited with code {self.exitcode}{why}"

    def stderr_tail(self) -> str:
        lines = [line for line in self.tail if line.strip()]
        if not lines:
            return ""
        body = "\n".join(f"  | {line}" for line in lines)
        return f"\nlast {len(lines)} lines of rank {self.rank}'s stderr:\n{body}"

    def close_stdin(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            if self.popen.stdin is not None:
                self.popen.stdin.close()


class WorkerProcesses:
    """The spawned ranks 1..N-1, what they report and the watchdog over them."""

    def __init__(self, procs: dict[int, RankProcess]) -> None:
        self.procs = procs
        self._closing = False
        self.group: TensorParallelGroup | None = None
        self.dead_event = threading.Event()
        self._watchdogs = [threading.Thread(target=self._watch, args=(p,), name=f"deepinfer-tp-watchdog{r}",
                                            daemon=True) for r, p in procs.items()]
        for t in self._watchdogs:
            t.start()

    def _watch(self, proc: RankProcess) -> None:
        with contextlib.suppress(Exception):
            proc.popen.wait()  # returns when the rank's process has ended
        if self._closing:
            return
        self.dead_event.set()
        if self.group is not None and self.group.device.type == "cuda":
            # NCCL collectives do not notice a dead peer: abort them so the step returns
            with contextlib.suppress(Exception):
                dist.distributed_c10d._abort_process_group(self.group.data_group)

    def dead(self) -> RankProcess | None:
        """The first rank that has exited, or None while all run."""
        for _, p in sorted(self.procs.items()):
            if p.exitcode is not None:
                return p
        return None

    def dead_rank(self) -> str | None:
        """A description of the first rank that has exited, or None while all run."""
        p = self.dead()
        return None if p is None else p.describe()

    def failure(self, exc: BaseException | None,
                consequence: str = "the LLM cannot run further steps") -> TensorParallelError:
        """The error of a failed step: names the dead rank (waiting a moment for it to be seen),
        with its report and the last lines of its stderr."""
        deadline = time.monotonic() + _DEATH_GRACE_S
        dead = self.dead()
        while dead is None and exc is not None and time.monotonic() < deadline:
            time.sleep(0.05)
            dead = self.dead()
        cause = f" ({type(exc).__name__}: {exc})" if exc is not None else ""
        if dead is not None:
            return TensorParallelError(f"{dead.describe()}; {consequence}{cause}{dead.stderr_tail()}")
        return TensorParallelError(f"a tensor-parallel step failed{cause}; {consequence}")

    @property
    def stopped(self) -> bool:
        return self._closing

    def stop(self, timeout: float = 10.0) -> None:
        """End every rank that still runs (after rank 0 sent OP_SHUTDOWN, they exit by themselves)."""
        self._closing = True
        end = time.monotonic() + timeout
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(max(0.0, end - time.monotonic()))
        for p in self.procs.values():
            p.close_stdin()  # a rank still running takes it as rank 0 gone and exits
            for end_it, grace in ((None, 0.5), (p.popen.terminate, 2.0), (p.popen.kill, 2.0)):
                if p.exitcode is not None:
                    break
                if end_it is not None:
                    with contextlib.suppress(OSError):
                        end_it()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.popen.wait(grace)
            p.output_done(1.0)


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
    store = dist.TCPStore("127.0.0.1", 0, spec.world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=spec.timeout_s))
    spec.init_method = f"tcp://127.0.0.1:{store.port}"
    procs: dict[int, RankProcess] = {}
    try:
        for rank in range(1, spec.world_size):
            procs[rank] = RankProcess(rank, spec)
    except BaseException:  # e.g. no such executable: end the ranks already started
        WorkerProcesses(procs).stop(timeout=0.0)
        raise
    workers = WorkerProcesses(procs)
    try:
        _wait_until_started(store, workers, spec.timeout_s)
        group = init_groups(0, spec.world_size, torch.device(spec.devices[0]), spec.init_method, spec.timeout_s,
                            store=store)
    except BaseException as exc:
        err = exc if isinstance(exc, TensorParallelError) else \
            workers.failure(exc, "the tensor-parallel LLM could not start")
        workers.stop(timeout=0.0)
        if err is exc:
            raise
        raise err from exc
    workers.group = group
    _stop_at_exit(workers)
    return group, workers


def _wait_until_started(store: Any, workers: WorkerProcesses, timeout_s: float) -> None:
    """Wait until every spawned rank has reached the store; a rank that dies first (an import
    error, a bad device) fails the start at once, with its error and the last lines of its
    stderr, instead of after the rendezvous timeout."""
    keys = [started_key(r) for r in workers.procs]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if workers.dead() is not None:
            raise workers.failure(None, "the tensor-parallel LLM could not start")
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


def start_group(args: EngineArgs, model_path: str, cfg: Any, device: torch.device
                ) -> tuple[EngineArgs, TensorParallelGroup, WorkerProcesses | None]:
    """Check that ``cfg`` splits ``args.tensor_parallel_size`` ways on ``device``'s kind
    (ValueError naming both numbers otherwise), then start the ranks (or join torchrun's).
    Returns the options every rank runs with (on CPU each rank gets its share of the cores
    unless ``num_threads`` is set), rank 0's group and the spawned processes (None under
    torchrun). ``args``: the options with the model's defaults filled (``EngineArgs.for_model``)."""
    import dataclasses

    tp_size = args.tensor_parallel_size
    env = torchrun_rank()
    if env is not None and env[1] != tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} differs from torchrun's WORLD_SIZE={env[1]}: "
                         "start as many processes as tensor-parallel ranks")
    check_divisible(cfg, tp_size)
    if dist.is_initialized() and env is None:
        raise RuntimeError("a torch.distributed process group is already active in this process (another "
                           "tensor-parallel LLM?): close() it before starting a tensor-parallel LLM")
    devices = [str(d) for d in check_devices(tp_size, device)]
    if device.type == "cpu" and args.num_threads is None:
        # the ranks share the host's cores: give each its part instead of every core
        args = dataclasses.replace(args, num_threads=max(1, (os.cpu_count() or 1) // tp_size))
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    spec = RankSpec(args=args, model_path=model_path, devices=devices, timeout_s=collective_timeout_s(),
                    init_method="")
    group, workers = start_tensor_parallel(spec)
    return args, group, workers


def stop_group(workers: WorkerProcesses | None) -> None:
    """End the spawned ranks (at once) and leave the process group."""
    if workers is not None:
        workers.stop(timeout=0.0)
    if dist.is_initialized():
        dist.destroy_process_group()
