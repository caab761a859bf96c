"""One-row (decode, batch 1) projections of the Llama-3-8B shape in bf16: cuBLAS (torch's default
and cuBLASLt) against the Triton GEMV (``runtime/kernels/gemv.py``) over a few tile configs.

    python bench/gemv_bench.py [--configs all]

Each contender runs inside a CUDA graph over enough weight copies (> 512 MiB) that no weight is
still in L2 when it is read again, so the figure is the weight-streaming rate a decode step gets.
Prints microseconds per call and GB/s of weights read.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from deepinfer.runtime.kernels.gemv import DEFAULT_CONFIG, gemv

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
CONFIGS = [(bn, bk, w, s) for bn in (4, 8, 16) for bk in (256, 512) for w in (4, 8) for s in (3, 4)]


def time_graph(fn, copies: int, reps: int = 5) -> float:  # type: ignore[no-untyped-def]
    """Microseconds per call of fn(i) for i over the weight copies, replayed from one graph."""
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / copies)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="default", help="'default' or 'all' (sweep the tile configs)")
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; bf16, one activation row")
    configs = CONFIGS if args.configs == "all" else [DEFAULT_CONFIG]
    for name, (n, k) in SHAPES.items():
        bench_shape(name, n, k, configs)


def bench_shape(name: str, n: int, k: int, configs: list[tuple[int, int, int, int]]) -> None:
    dev = torch.device("cuda")
    nbytes = n * k * 2
    copies = max(2, -(-(512 << 20) // nbytes))
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(1, 2 * k if name == "down" else k, device=dev, dtype=torch.bfloat16)
    xs = x[:, :k].contiguous()
    row = {}
    torch.backends.cuda.preferred_blas_library("cublas")
    row["cublas"] = time_graph(lambda i: F.linear(xs, ws[i]), copies)
    torch.backends.cuda.preferred_blas_library("cublaslt")
    row["cublaslt"] = time_graph(lambda i: F.linear(xs, ws[i]), copies)
    torch.backends.cuda.preferred_blas_library("cublas")
    for cfg in configs:
        row[f"triton{cfg}"] = time_graph(lambda i, c=cfg: gemv(xs, ws[i], config=c), copies)
    if name == "down":
        row["triton+silu"] = time_graph(lambda i: gemv(x, ws[i], silu_mul=True), copies)
    best = min(row, key=row.__getitem__)
    cells = "  ".join(f"{c} {us:.1f}us {nbytes / us / 1e3:.0f}GB/s" for c, us in
                      sorted(row.items(), key=lambda kv: kv[1])[:6])
    print(f"{name} [{n}x{k}] best {best}: {cells}  | cublas {row['cublas']:.1f}us", flush=True)

if __name__ == "__main__":
    main()
