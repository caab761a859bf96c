"""What ranks > 0 run: build their ``Worker``, then serve rank 0's steps.

A spawned rank is a fresh interpreter started as ``python -m deepinfer.runtime.distributed.rank
RANK`` (never by importing the user's ``__main__``, so scripts without a main guard, ``python -``,
``python -c`` and notebooks work). Its ``RankSpec`` (picklable) arrives on stdin, length-prefixed;
stdin then stays open, and its end (rank 0's process is gone) ends this rank. A failure is
reported to rank 0 as one ``REPORT_PREFIX`` line on stderr (the exception's type and text), the
traceback follows, and the process exits with status 1.

``run_rank`` builds the same ``Worker`` rank 0 builds (load, agree on the KV block count,
capture the same decode graphs), so the collectives of start-up pair up; then ``serve_steps``
replays rank 0's step messages until it says shut down.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deepinfer.runtime.distributed.step_channel import (
    OP_COPY_BLOCKS,
    OP_EXECUTE,
    OP_REPLAY,
    OP_SHUTDOWN,
    StepChannel,
    unpack_execute,
)
from deepinfer.runtime.engine_args import EngineArgs
from deepinfer.runtime.parallel.process_group import (
    TensorParallelGroup,
    agree_num_blocks,
    init_groups,
)

__all__ = ["REPORT_PREFIX", "RankSpec", "agree_num_blocks", "rank_main", "run_rank", "serve_steps"]

#: Starts the stderr line in which a failing rank reports its exception to rank 0.
REPORT_PREFIX = "deepinfer-tp-report: "


@dataclass
class RankSpec:
    """What every rank builds from: rank 0's engine options (model defaults filled), the model
    path, one device per rank and the rendezvous."""

    args: EngineArgs
    model_path: str
    devices: list[str]  # one per rank
    timeout_s: float
    init_method: str  # tcp://host:port of rank 0's store, or env:// under torchrun

    @property
    def world_size(self) -> int:
        return len(self.devices)


def started_key(rank: int) -> str:
    """The store key a spawned rank sets once it runs and reached rank 0's store."""
    return f"deepinfer_tp_started_{rank}"


def run_rank(spec: RankSpec, group: TensorParallelGroup) -> None:
    """Build this rank's worker (model shard, KV cache, graphs), then serve steps until rank 0
    shuts down."""
    from deepinfer.runtime.worker.worker import Worker

    worker = Worker(spec.args, spec.model_path, group.device, group=group)
    worker.capture_graphs()
    serve_steps(worker.runner, StepChannel(group), worker.step_buffers)


def serve_steps(runner: Any, channel: StepChannel, buffers: Any) -> None:
    """Run rank 0's messages on this rank's shard until OP_SHUTDOWN."""
    while True:
        op, fields, payload = channel.receive()
        if op == OP_SHUTDOWN:
            channel.leave()
            return
        if op == OP_EXECUTE:
            assert payload is not None
            runner.execute(**unpack_execute(fields, payload))
        elif op == OP_COPY_BLOCKS:
            n = fields[0]
            pairs = payload.numpy().reshape(2, n) if payload is not None else None
            if pairs is not None:
                runner.copy_blocks(pairs[0], pairs[1])
        elif op == OP_REPLAY:
            rows, nbytes = fields[0], fields[1]
            assert payload is not None and runner.graphs is not None
            buffers.host[:nbytes].copy_(payload)
            runner.graphs.replay(rows)
        else:
            raise RuntimeError(f"tensor-parallel rank {channel.group.rank}: unknown step message {op}")


def rank_main(rank: int, spec: RankSpec) -> None:
    """Join rank 0's group as ``rank`` and serve it (what a spawned rank runs)."""
    # what can fail here locally fails before rank 0 is told this rank started (then it
    # reports the failure at once instead of waiting in the rendezvous)
    dev = torch.device(spec.devices[rank])
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    store = None
    if spec.init_method.startswith("tcp://"):  # rank 0's store (see launcher.start_tensor_parallel)
        host, port = spec.init_method[len("tcp://"):].rsplit(":", 1)
        store = dist.TCPStore(host, int(port), spec.world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=spec.timeout_s))
        store.set(started_key(rank), "1")  # rank 0 waits for it
    group = init_groups(rank, spec.world_size, dev, spec.init_method, spec.timeout_s, store=store)
    run_rank(spec, group)
    dist.destroy_process_group()


def _read_exact(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise EOFError(f"rank 0 closed the spec pipe after {len(data)} of {n} bytes")
        data += chunk
    return data


def _exit_when_rank0_is_gone(fd: int, rank: int) -> None:
    """Rank 0 holds our stdin open as long as it runs: its end (a crash, a kill) ends this rank,
    which would otherwise wait for rank 0's next step for ever. (Raw reads of the descriptor: a
    daemon thread blocked inside ``sys.stdin`` would hold its lock at interpreter shutdown.)"""
    try:
        while os.read(fd, 4096):
            pass
    except (OSError, ValueError):
        pass
    print(f"deepinfer: tensor-parallel rank {rank}: rank 0 (pid {os.getppid()}) has gone away; stopping",
          file=sys.stderr, flush=True)
    os._exit(1)


def main(argv: list[str] | None = None) -> None:
    """``python -m deepinfer.runtime.distributed.rank RANK``: the spec arrives on stdin."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    argv = sys.argv[1:] if argv is None else argv
    rank = int(argv[0])
    try:
        stdin = sys.stdin.fileno()
        size = int.from_bytes(_read_exact(stdin, 8), "little")
        spec: RankSpec = pickle.loads(_read_exact(stdin, size))
        threading.Thread(target=_exit_when_rank0_is_gone, args=(stdin, rank), name="deepinfer-rank0-watch",
                         daemon=True).start()
        rank_main(rank, spec)
    except BaseException as exc:  # noqa: BLE001 - reported, then the process ends
        report = json.dumps({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})
        sys.stderr.write(f"{REPORT_PREFIX}{report}\n")
        traceback.print_exc()
        print(f"deepinfer: tensor-parallel rank {rank} stops: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.stderr.flush()
        raise SystemExit(1) from None


if __name__ == "__main__":
    # run the canonical module's main (not this __main__ copy's), so that the spec's classes
    # unpickle as the ones every other module uses
    from deepinfer.runtime.distributed.rank import main as _main

    _main()
