"""alloc_tensor (cuMemAlloc/cuMemFree, outside torch's cache) vs torch.empty latency.

Each iteration allocates a tensor and drops it; the figure includes the free. torch.empty
is served from torch's caching allocator after the first call, so it measures a cache hit.
The bare-capsule column allocates and frees through the native module alone (no torch,
no DLPack import): the driver's cuMemAlloc + cuMemFree.

    python bench/cuda_alloc_bench.py [--iters 2000]
"""

from __future__ import annotations

import argparse
import time


def per_call_us(fn, iters: int) -> float:
    import torch

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args()

    import torch
    from deepinfer._C.cuda_utils import alloc_tensor
    from deepinfer_cuda._native import cuda_utils as native

    torch.empty(1, device="cuda")
    for numel in (1 << 10, 1 << 20, 1 << 26):
        mib = numel * 2 / (1 << 20)
        a = per_call_us(lambda n=numel: alloc_tensor((n,), torch.float16, 0), args.iters)
        b = per_call_us(lambda n=numel: torch.empty((n,), dtype=torch.float16, device="cuda"), args.iters)
        c = per_call_us(lambda n=numel: native.alloc_bytes(2 * n, 0), args.iters)  # no torch
        print(
            f"{mib:10.3f} MiB  alloc_tensor {a:8.1f} us   torch.empty {b:6.1f} us   "
            f"bare capsule, no torch {c:8.1f} us"
        )


if __name__ == "__main__":
    main()
