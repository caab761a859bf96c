"""One-row (decode, batch 1) projections in bf16: cuBLAS with the separate kernels around it
against the Triton GEMV (``runtime/kernels/gemv.py``) with those kernels fused in, over tile configs.

    python bench/gemv_bench.py [--shape llama3-8b|smollm2-135m|qwen3-30b-a3b] [--configs default|sweep|splitk]

Per projection of a layer, what the one-row decode graph runs in each form:

- qkv, gate_up: ``add_rmsnorm`` + cuBLAS  against  the GEMV with the RMSNorm in its prologue;
- o: cuBLAS (its residual add lands in the next add_rmsnorm)  against  the GEMV with the add in
  its epilogue;
- down: ``silu_mul`` + cuBLAS  against  the GEMV with SiLU·mul in and the add in its epilogue;
- lm_head: cuBLAS against the plain GEMV.

Each contender runs inside a CUDA graph over enough weight copies (> 512 MiB) that no weight is
still in L2 when it is read again, so the figure is the weight-streaming rate a decode step gets;
the Triton kernels launch with programmatic dependent launch where the device has it (as in the
decode graphs) and, for the best tile, without (``pdl off``). Prints microseconds per call and
GB/s of weights read; the last line (``TILES ...``) is the best tile of each projection as
``DEEPINFER_ONE_ROW_TILES`` takes it (``bench/decode_profile.py --variants``).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from deepinfer.runtime.kernels.fused_ops import add_rmsnorm, silu_mul
from deepinfer.runtime.kernels.gemv import gemv

SHAPES = {
    "llama3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                  "lm_head": (128256, 4096)},
    # the attention half of a Qwen3-30B-A3B layer (its MLP is the MoE's: bench/moe_small_bench.py)
    "qwen3-30b-a3b": {"qkv": (5120, 2048), "o": (2048, 4096), "lm_head": (151936, 2048)},
    "smollm2-135m": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                     "lm_head": (49152, 576)},
}
DEFAULT_CONFIGS = [(2, 1024, 4, 3), (4, 2048, 8, 1)]
SPLIT_K = [(2, 1024, 4, 3), (4, 2048, 8, 1), (2, 1024, 4, 3, 2), (4, 1024, 4, 2, 2), (4, 1024, 4, 1, 4),
           (8, 1024, 8, 1, 4), (4, 2048, 8, 1, 2), (8, 2048, 8, 1, 2), (2, 2048, 4, 1, 2), (8, 1024, 8, 1, 2)]
SWEEP = [(4, 512, 4, 3), (8, 512, 4, 4), (8, 512, 8, 4), (16, 512, 8, 3), (16, 256, 4, 4), (4, 256, 4, 4),
         (4, 1024, 4, 2), (8, 1024, 8, 2), (2, 1024, 4, 3), (4, 2048, 8, 1), (2, 2048, 4, 1), (2, 256, 4, 3)]


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
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--configs", default="default", choices=("default", "sweep", "splitk"))
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; bf16, one activation row, {args.shape}")
    configs = {"default": DEFAULT_CONFIGS, "sweep": SWEEP, "splitk": SPLIT_K}[args.configs]
    best = {name: bench_shape(name, n, k, configs) for name, (n, k) in SHAPES[args.shape].items()}
    # the fastest tile of each decode-layer projection, as DEEPINFER_ONE_ROW_TILES takes it
    print("TILES " + ";".join(f"{name}={','.join(map(str, cfg))}" for name, cfg in best.items() if name != "lm_head"))


def bench_shape(name: str, n: int, k: int, configs: list[tuple[int, ...]]) -> tuple[int, ...]:
    dev = torch.device("cuda")
    nbytes = n * k * 2
    copies = max(2, -(-(512 << 20) // nbytes))
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(1, 2 * k if name == "down" else k, device=dev, dtype=torch.bfloat16)
    xs = x[:, :k].contiguous()
    r_in = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    r_out = torch.randn(1, n, device=dev, dtype=torch.bfloat16)
    nw = torch.rand(k, device=dev, dtype=torch.bfloat16) + 0.5
    torch.backends.cuda.preferred_blas_library("cublas")

    def baseline(i: int) -> torch.Tensor:
        if name in ("qkv", "gate_up"):
            return F.linear(add_rmsnorm(xs, r_in, nw, 1e-5)[0], ws[i])
        if name == "down":
            return F.linear(silu_mul(x), ws[i])
        return F.linear(xs, ws[i])

    def fused(i: int, cfg: tuple[int, ...]) -> torch.Tensor:
        if name in ("qkv", "gate_up"):
            return gemv(xs, ws[i], norm=(nw, 1e-5), config=cfg)
        if name == "down":
            return gemv(x, ws[i], silu_mul=True, residual=r_out, config=cfg)
        if name == "o":
            return gemv(xs, ws[i], residual=r_out, config=cfg)
        return gemv(xs, ws[i], config=cfg)

    base = time_graph(baseline, copies)
    row = {cfg: time_graph(lambda i, c=cfg: fused(i, c), copies) for cfg in configs}
    best = min(row, key=row.__getitem__)
    os.environ["DEEPINFER_PDL"] = "0"
    no_pdl = time_graph(lambda i: fused(i, best), copies)
    base_no_pdl = time_graph(baseline, copies)
    del os.environ["DEEPINFER_PDL"]
    cells = "  ".join(f"{c} {us:.2f}us {nbytes / us / 1e3:.0f}GB/s" for c, us in
                      sorted(row.items(), key=lambda kv: kv[1])[:5])
    print(f"{name} [{n}x{k}] cublas+kernels {base:.2f}us ({base_no_pdl:.2f} pdl off) {nbytes / base / 1e3:.0f}GB/s | "
          f"gemv best {best} {row[best]:.2f}us ({no_pdl:.2f} pdl off) | {cells}", flush=True)
    return best


if __name__ == "__main__":
    main()
