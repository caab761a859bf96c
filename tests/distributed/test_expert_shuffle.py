"""MoE expert shuffle across processes through CUDA IPC (one GPU is enough).

Each of WORLD ranks holds EXPERTS_PER_RANK experts (d x d weight shards) in one buffer.
A fixed permutation says which experts every rank must own afterwards; each rank exports
its buffer through CudaIPCWrapper, imports every other rank's buffer and copies the
experts it needs. Every element is checked against the expert's defining formula.
"""

from __future__ import annotations

import pytest

try:
    from deepinfer_cuda._probe import probe

    _PROBE = probe()
    SKIP = None if _PROBE["available"] else f"needs an NVIDIA GPU and driver ({_PROBE['reason']})"
except ImportError:  # the backend wheel is not installed
    SKIP = "needs the deepinfer-cuda wheel"

WORLD = 3
EXPERTS_PER_RANK = 4
D = 64
NUM_EXPERTS = WORLD * EXPERTS_PER_RANK
PERMUTATION = [7, 2, 11, 0, 5, 9, 3, 10, 1, 6, 8, 4]  # new slot -> expert id


def expert_weights(expert: int, device: str = "cpu"):
    """Expert `expert`'s d x d weights: distinct in every element and every expert."""
    import torch

    i = torch.arange(D * D, dtype=torch.float32, device=device).reshape(D, D)
    return i * 0.001 + expert


class CudaIPCWrapper:
    """A CUDA tensor shared by reference: pickle it to another process, call to_tensor()."""

    def __init__(self, tensor):
        from deepinfer._C.cuda_utils import export_ipc_tensor

        self.handle = export_ipc_tensor(tensor)

    def to_tensor(self):
        from deepinfer._C.cuda_utils import import_ipc_tensor

        return import_ipc_tensor(self.handle)


def _rank_main(rank, world, exchange, barrier, results):
    import torch

    try:
        from deepinfer._C.cuda_utils import alloc_tensor

        # Ranks 0, 2 use driver memory, rank 1 torch's caching allocator: both must share.
        if rank == 1:
            local = torch.empty(EXPERTS_PER_RANK, D, D, device="cuda")
        else:
            local = alloc_tensor((EXPERTS_PER_RANK, D, D), torch.float32, 0)
        for j in range(EXPERTS_PER_RANK):
            local[j].copy_(expert_weights(rank * EXPERTS_PER_RANK + j, "cuda"))
        torch.cuda.synchronize()
        # One wrapper per expert: sub-tensors at non-zero byte offsets of the buffer.
        exchange[rank] = [CudaIPCWrapper(local[j]) for j in range(EXPERTS_PER_RANK)]
        barrier.wait()
        mine = PERMUTATION[rank * EXPERTS_PER_RANK : (rank + 1) * EXPERTS_PER_RANK]
        shuffled = torch.empty(EXPERTS_PER_RANK, D, D, device="cuda")
        for slot, expert in enumerate(mine):
            owner, index = divmod(expert, EXPERTS_PER_RANK)
            src = exchange[owner][index].to_tensor()
            shuffled[slot].copy_(src)
            del src
        torch.cuda.synchronize()
        expected = torch.stack([expert_weights(e) for e in mine])
        mismatches = int((shuffled.cpu() != expected).sum())
        results.put((rank, mismatches, mine))
        barrier.wait()  # exporters outlive every importer
    except Exception as exc:
        results.put((rank, repr(exc), None))
        barrier.abort()


@pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
def test_expert_shuffle_through_ipc():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    exchange = manager.dict()
    barrier = ctx.Barrier(WORLD)
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, WORLD, exchange, barrier, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    outcome = sorted(results.get(timeout=180) for _ in range(WORLD))
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0] * WORLD
    for rank, mismatches, mine in outcome:
        assert mismatches == 0, (rank, mismatches)
        assert mine == PERMUTATION[rank * EXPERTS_PER_RANK : (rank + 1) * EXPERTS_PER_RANK]
    assert sorted(e for _, _, mine in outcome for e in mine) == list(range(NUM_EXPERTS))
