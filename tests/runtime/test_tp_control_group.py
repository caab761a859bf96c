"""Rank 0's side of the tensor-parallel control group (parallel/process_group.py): its operations
are bounded by the collective timeout, so one stuck on a rank that is gone ends, except the
agreement on KV blocks at start, which waits for the slowest rank to finish loading. Two real
gloo ranks in two processes."""

from __future__ import annotations

import multiprocessing
import socket
import time

import pytest
import torch

if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch was built without torch.distributed / gloo", allow_module_level=True)

TIMEOUT_S = 2.0  # the collective timeout the ranks are started with


def _rank(rank: int, port: int, load_s: float, results, ready) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist
    from deepinfer.runtime.parallel.process_group import agree_num_blocks, init_groups

    ready.wait(120)  # both processes imported: the short timeout is not spent on start-up
    group = init_groups(rank, 2, torch.device("cpu"), f"tcp://127.0.0.1:{port}", TIMEOUT_S)
    time.sleep(load_s)  # this rank's model load
    blocks = agree_num_blocks(group, 100 + rank)
    results.put(("agreed", rank, blocks))
    if rank == 0:
        # rank 1 never answers this one: rank 0's operation ends with the collective timeout
        start = time.monotonic()
        t = torch.zeros(1)
        try:
            dist.all_reduce(t, group=group.control_group)
            results.put(("stuck-op", "completed", 0.0))
        except RuntimeError:
            results.put(("stuck-op", "timed out", time.monotonic() - start))
    results.put(("done", rank, 0))
    time.sleep(TIMEOUT_S * 3)  # rank 1 stays alive (and silent) while rank 0 waits
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_start_waits_for_a_slow_rank_and_rank_0_ops_are_bounded():
    ctx = multiprocessing.get_context("spawn")
    results, ready = ctx.Queue(), ctx.Barrier(2)
    port = _free_port()
    # rank 1 loads for twice the collective timeout: the agreement still waits for it
    procs = [ctx.Process(target=_rank, args=(r, port, 0.0 if r == 0 else 2 * TIMEOUT_S, results, ready)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in range(5)]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, p.exitcode
    agreed = sorted(g[1:] for g in got if g[0] == "agreed")
    assert agreed == [(0, 100), (1, 100)]  # the fewest blocks of any rank, on both
    (stuck,) = [g for g in got if g[0] == "stuck-op"]
    assert stuck[1] == "timed out"
    assert stuck[2] < 10 * TIMEOUT_S  # the collective timeout, not the idle one
