"""FP8 kernel sweep on the GPU (issue 28): one-row GEMV variants and several-row products, timed
the way a decode step runs them, in one run.

    python bench/fp8_sweep.py --part gemv|gemm|all

Timing: each kernel is called R times inside one CUDA graph, cycling through enough copies of the
weight that they do not fit in the L2 cache (so every call streams its weight from HBM, as in a
decode step); the figure is the graph's replay time / R (launch gaps inside a graph included,
as in the decode graphs). GB/s counts the weight bytes (+ scales) of one call.

1. gemv: at one row, on the Llama-3-8B shapes (qkv, o, gate_up, down, lm_head), the bf16 GEMV
   (kernels/gemv.py) next to ``fp8_gemv`` with each ``math`` ("f32", "f16", "f16bits", "mma") and tile
   (BLOCK_N, BLOCK_K, warps, stages); each variant's error vs float64 of the dequantized weight.
2. gemm: at M = 2, 8, 32, 128, 512 rows: cuBLAS bf16, the weight-only Triton ``fp8_gemm``,
   ``fp8_scaled_mm`` (row quantizer + ``torch._scaled_mm``; also each half alone) and the Triton
   fp8 x fp8 ``fp8_w8a8_gemm``; errors vs the float64 product of the bf16 weights (what fp8 adds).
"""

# ruff: noqa: B023 - every lambda is captured into a graph within its loop iteration
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch  # before any deepinfer native module

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
L2_DEFEAT_BYTES = 256 << 20
GEMV_VARIANTS: tuple[tuple[str, tuple[int, int, int, int]], ...] = (
    ("f32", (2, 2048, 4, 3)), ("f32", (4, 2048, 8, 2)), ("f32", (8, 1024, 8, 2)),
    ("f16", (2, 2048, 4, 3)), ("f16", (4, 2048, 8, 2)), ("f16", (8, 1024, 8, 2)),
    ("f16bits", (4, 2048, 8, 2)), ("f16bits", (8, 1024, 8, 2)),
    ("mma", (16, 512, 4, 3)), ("mma", (16, 1024, 4, 2)), ("mma", (32, 512, 4, 3)), ("mma", (64, 256, 4, 3)),
    ("mma", (64, 512, 8, 3)),
)


def graph_us(calls: list[Callable[[], object]], reps: int = 3) -> float:
    """Mean time of one call, the calls replayed in one CUDA graph (best of ``reps`` replays)."""
    for fn in calls[:2]:
        fn()  # compile / warm up outside the capture
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in calls[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in calls:
            fn()
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / len(calls))
    del g
    return best


def _safe(label: str, fn: Callable[[], float]) -> float:
    """fn(), or NaN with the error printed: one kernel that fails to build does not end the sweep."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        print(f"  {label}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        return float("nan")


def _copies(nbytes: int) -> int:
    return max(1, -(-L2_DEFEAT_BYTES // nbytes))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def copy_bandwidth() -> float:
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    out = torch.empty_like(big)
    us = graph_us([lambda: out.copy_(big)] * 4)
    print(f"device copy bandwidth (1 GiB copy, read+write): {2 * big.numel() / us / 1e3:,.0f} GB/s", flush=True)
    return 2 * big.numel() / us / 1e3


def gemv_sweep(copy_gbs: float, shapes: list[str]) -> None:
    from deepinfer.runtime.kernels.fp8_gemv import fp8_gemv
    from deepinfer.runtime.kernels.gemv import DEFAULT_CONFIG, gemv
    from deepinfer.runtime.models.fp8_linear import dequantize_fp8, quantize_fp8
    from deepinfer.runtime.models.llama_fused_decode import ONE_ROW_CONFIGS

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    best_by_shape = {}
    for name in shapes:
        n, k = SHAPES[name]
        w = torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
        q, s = quantize_fp8(w)
        x = torch.randn(1, k, device=dev, generator=g, dtype=torch.bfloat16)
        ref = x.double() @ dequantize_fp8(q, s, torch.float64).T
        c16, c8 = _copies(2 * n * k), _copies(n * k)
        ws = [w] + [w.clone() for _ in range(c16 - 1)]
        qs = [q] + [q.clone() for _ in range(c8 - 1)]
        reps = max(24, 2 * max(c16, c8))
        tile = ONE_ROW_CONFIGS.get(name, DEFAULT_CONFIG)  # the decode step's bf16 tile
        t_bf = graph_us([lambda w=ws[i % c16]: gemv(x, w, None, config=tile) for i in range(reps)])
        del ws
        bytes8 = n * k + 4 * n
        line = [f"GEMV {name} [{n}x{k}] bf16 GEMV {t_bf:.1f} us ({2 * n * k / t_bf / 1e3:,.0f} GB/s)"]
        results = []
        for math, cfg in GEMV_VARIANTS:
            try:
                err = _rel(fp8_gemv(x, q, s, config=cfg, math=math), ref)
                t = graph_us([lambda q=qs[i % c8], cfg=cfg, math=math: fp8_gemv(x, q, s, config=cfg, math=math)
                              for i in range(reps)])
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
                line.append(f"  {math} {cfg}: FAILED {type(e).__name__}: {str(e)[:120]}")
                continue
            results.append((t, math, cfg, err))
            line.append(f"  {math} {cfg}: {t:.1f} us {bytes8 / t / 1e3:,.0f} GB/s "
                        f"({100 * bytes8 / t / 1e3 / copy_gbs:.0f} % of copy), x{t_bf / t:.2f} vs bf16, "
                        f"rel. error {err:.1e}")
        print("\n".join(line), flush=True)
        for math in ("f32", "f16", "f16bits", "mma"):
            mine = [r for r in results if r[1] == math]
            if mine:
                t, _, cfg, err = min(mine)
                print(f"BEST {name} {math}: {cfg} {t:.1f} us {bytes8 / t / 1e3:,.0f} GB/s = "
                      f"{100 * bytes8 / t / 1e3 / copy_gbs:.0f} % of copy, x{t_bf / t:.2f} vs bf16 GEMV "
                      f"{t_bf:.1f} us, err {err:.1e}", flush=True)
        if results:
            best_by_shape[name] = min(results)
        del qs
        torch.cuda.empty_cache()
    print("GEMV best per shape: " + "; ".join(f"{k} {v[1]} {v[2]} {v[0]:.1f} us" for k, v in best_by_shape.items()),
          flush=True)


def gemm_sweep(rows_list: list[int], shapes: list[str]) -> None:
    import torch.nn.functional as F
    from deepinfer.runtime.kernels.fp8_act import fp8_scaled_mm, fp8_w8a8_gemm, quantize_rows_fp8
    from deepinfer.runtime.kernels.fp8_gemv import fp8_gemm
    from deepinfer.runtime.models.fp8_linear import quantize_fp8

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    worst: dict[str, float] = {}
    for name in shapes:
        n, k = SHAPES[name]
        w = torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
        q, s = quantize_fp8(w)
        c16, c8 = _copies(2 * n * k), _copies(n * k)
        ws = [w] + [w.clone() for _ in range(c16 - 1)]
        qs = [q] + [q.clone() for _ in range(c8 - 1)]
        for m in rows_list:
            x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
            ref = x.double() @ w.double().T  # the bf16 model's product: what fp8 changes
            xq, xs = quantize_rows_fp8(x)
            errs = {"bf16": _safe("bf16", lambda: _rel(F.linear(x, w), ref)),
                    "triton": _safe("triton", lambda: _rel(fp8_gemm(x, q, s), ref)),
                    "scaled_mm": _safe("scaled_mm", lambda: _rel(fp8_scaled_mm(x, q, s), ref)),
                    "w8a8": _safe("w8a8", lambda: _rel(fp8_w8a8_gemm(x, q, s), ref))}
            for key, e in errs.items():
                worst[key] = max(worst.get(key, 0.0), e)
            reps = max(12, 2 * max(c16, c8))
            t = {
                "bf16": _safe("bf16", lambda: graph_us([lambda w=ws[i % c16]: F.linear(x, w) for i in range(reps)])),
                "triton": _safe("triton", lambda: graph_us([lambda q=qs[i % c8]: fp8_gemm(x, q, s)
                                                            for i in range(reps)])),
                "scaled_mm": _safe("scaled_mm", lambda: graph_us([lambda q=qs[i % c8]: fp8_scaled_mm(x, q, s)
                                                                  for i in range(reps)])),
                "mm_only": _safe("mm_only", lambda: graph_us([lambda q=qs[i % c8]: torch._scaled_mm(
                    xq, q.t(), scale_a=xs, scale_b=s.view(1, -1), out_dtype=torch.bfloat16) for i in range(reps)])),
                "quant_only": _safe("quant_only", lambda: graph_us([lambda: quantize_rows_fp8(x)] * 12)),
                "w8a8": _safe("w8a8", lambda: graph_us([lambda q=qs[i % c8]: fp8_w8a8_gemm(x, q, s)
                                                        for i in range(reps)])),
            }
            best = min(("bf16", "triton", "scaled_mm", "w8a8"),
                       key=lambda key: t[key] if t[key] == t[key] else float("inf"))
            print(f"GEMM {name} [{n}x{k}] M={m}: " + ", ".join(f"{key} {v:.1f} us" for key, v in t.items())
                  + f" -> best {best}; rel. error vs bf16 weights: "
                  + ", ".join(f"{key} {e:.1e}" for key, e in errs.items()), flush=True)
    print("GEMM worst rel. error vs the float64 product of the bf16 weights: "
          + ", ".join(f"{key} {e:.2e}" for key, e in worst.items()), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("gemv", "gemm", "all"), default="all")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rows", default="2,8,32,128,512")
    args = p.parse_args()
    print(f"== fp8 sweep on {torch.cuda.get_device_name()} (torch {torch.__version__})", flush=True)
    shapes = args.shapes.split(",")
    if args.part in ("gemv", "all"):
        gemv_sweep(copy_bandwidth(), shapes)
    if args.part in ("gemm", "all"):
        gemm_sweep([int(r) for r in args.rows.split(",")], [s for s in shapes if s != "lm_head"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
