"""Achieved bandwidth of the GGUF GPU kernels on the Llama-3-8B projection shapes (H200).

    python bench/gguf_gemv_bench.py [--types Q4_0,Q8_0,Q4_K,Q6_K] [--rows 1,32]

For each type and projection (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336;
``--shapes`` also takes v 1024x4096 and lm_head 128256x4096, which a Q4_K_M file stores in Q6_K):
the one-row GEMV (``gguf_gemv``) and, for ``--rows`` above 1, the GEMM (``gguf_gemm``), timed as
200 back-to-back launches captured in one CUDA graph (launch overhead out, as in the decode
graphs); GB/s = bytes of the weight planes (+ activations) / time. The bf16 GEMV
(``kernels.gemv``) and cuBLAS (``F.linear``) on the same shape, and the device's copy bandwidth
(``torch`` copy of 2 GiB: read + write bytes / time), are printed for reference.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "runtime"))

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# the Llama-3-8B tensors a Q4_K_M file stores apart in Q6_K (``--shapes``): attn_v, the LM head
MORE_SHAPES = {"v": (1024, 4096), "lm_head": (128256, 4096)}
REPS = 200


def graph_time(fn) -> float:  # type: ignore[no-untyped-def]
    """Seconds per call of ``fn`` (REPS calls replayed from one CUDA graph, best of 3)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS):
            fn()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / REPS)
    return best


def decode_fusion(name: str, n: int, k: int, enabled: bool) -> tuple[int, dict]:
    """The activation width and the ``gguf_gemv`` fusion this projection takes in the one-row decode
    graph (``--fused``): RMSNorm prologue for qkv and gate_up, residual epilogue for o, SiLU·mul
    input for down (the GEMV then reads ``[1, 2K]``); plain without ``--fused``."""
    if not enabled:
        return k, {}
    dev, bf = "cuda", torch.bfloat16
    if name == "lm_head":
        return k, {}
    if name in ("qkv", "gate_up", "v"):
        return k, {"norm": (1 + 0.1 * torch.randn(k, device=dev)).to(bf), "eps": 1e-5}
    if name == "o":
        return k, {"residual": torch.randn(1, n, device=dev, dtype=bf)}
    return 2 * k, {"silu_mul": True}


def _fused(kwargs: dict) -> dict:
    out = dict(kwargs)
    if "norm" in out:
        out["norm"] = (out.pop("norm"), out.pop("eps"))
    return out


def copy_bandwidth() -> float:
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t = graph_time(lambda: b.copy_(a))
    return 2 * a.numel() / t / 1e9


def main() -> None:
    from deepinfer.runtime.kernels.gemv import gemv
    from deepinfer.runtime.kernels.gguf_gemv import gguf_gemm, gguf_gemv
    from deepinfer.runtime.kernels.gguf_layout import regroup
    from deepinfer.runtime.kernels.gguf_mmq import gguf_mmq, mmq_supports, quantize_rows
    from gguf_quantizer import quantize

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default="Q4_0,Q8_0,Q4_K,Q6_K,Q4_1,Q5_K")
    p.add_argument("--rows", default="1,32")
    p.add_argument("--shapes", default=",".join(SHAPES),
                   help=f"projections to time: of {', '.join([*SHAPES, *MORE_SHAPES])}")
    p.add_argument("--scales", default="tiled",
                   help="scale loads to time: gather (per column) and/or tiled (per group, broadcast)")
    p.add_argument("--gemv", default="words,bytes",
                   help="one-row GEMVs to time: words (int32 code words, group sums; the default), bytes, dp4a "
                        "(words with 8-bit activations, DEEPINFER_GGUF_DP4A=1); the first one's output is the reference")
    p.add_argument("--sweep", default="",
                   help="types whose one-row GEMV tiles (BLOCK_N, BLOCK_K, warps, stages) are swept on gate_up and down")
    p.add_argument("--sweep-variants", default="words,tiled", help="GEMVs the sweep times: words, dp4a, tiled (bytes)")
    p.add_argument("--mmq-sweep", default="",
                   help="types whose int8 tensor-core product (gguf_mmq) and bf16-decoding GEMM tiles are swept at 32 rows "
                        "on gate_up and down")
    p.add_argument("--swap-sweep", default="",
                   help="types whose GEMM is timed plain and swapped (weights as the MMA's left operand) over tiles")
    p.add_argument("--swap-rows", default="16,32,64,128", help="row counts of --swap-sweep")
    p.add_argument("--split-sweep", default="",
                   help="types whose GEMM is timed with K split 1, 2, 3, 4, 6 and 8 ways and as chosen (split_k=0)")
    p.add_argument("--split-rows", default="8,16,32,64", help="row counts of --split-sweep")
    p.add_argument("--tile-sweep", default="",
                   help="types whose gate_up and down GEMMs are timed over TILE_SWEEP's tiles, plain and swapped, "
                        "at several K splits")
    p.add_argument("--tile-rows", default="16,32", help="row counts of --tile-sweep")
    p.add_argument("--tile-sweep-set", default="default", choices=("default", "occupancy"),
                   help="the tiles --tile-sweep times: TILE_SWEEP, or TILE_SWEEP_OCCUPANCY (less shared memory)")
    p.add_argument("--fused", action="store_true",
                   help="one-row GEMVs with the decode graph's fusions (RMSNorm for qkv/gate_up, residual for o, "
                        "SiLU·mul for down)")
    args = p.parse_args()
    copy = copy_bandwidth()
    print(f"== {torch.cuda.get_device_name()}: copy bandwidth {copy:,.0f} GB/s (read + write)", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = {**SHAPES, **MORE_SHAPES}
    for name in args.shapes.split(","):
        if name not in shapes:
            p.error(f"--shapes: {name!r} is not one of {', '.join(shapes)}")
        n, k = shapes[name]
        w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
        x1 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        t = graph_time(lambda x1=x1, w=w: gemv(x1, w))
        print(f"{name:8s} bf16  gemv: {t * 1e6:7.1f} us {w.numel() * 2 / t / 1e9:6,.0f} GB/s", flush=True)
        for kind in filter(None, args.types.split(",")):
            planes = regroup(quantize(w, kind), kind)
            nbytes = planes.nbytes()
            outputs: dict[tuple[int, str], torch.Tensor] = {}
            for rows, scales in ((int(r), sc) for r in args.rows.split(",") for sc in args.scales.split(",")):
                os.environ["DEEPINFER_GGUF_TILED_SCALES"] = "1" if scales == "tiled" else "0"
                width, fusion = decode_fusion(name, n, k, args.fused and rows == 1)
                fz = _fused(fusion)
                x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16,
                                generator=torch.Generator(device="cuda").manual_seed(rows))
                os.environ["DEEPINFER_GGUF_WORDS"] = "0" if args.gemv.split(",")[0] == "bytes" else "1"
                os.environ["DEEPINFER_GGUF_DP4A"] = "1" if args.gemv.split(",")[0] == "dp4a" else "0"
                outputs[rows, scales] = (gguf_gemv(x, planes, **fz) if rows == 1 else gguf_gemm(x, planes)).float()
                if rows == 1:
                    for variant in args.gemv.split(",")[1:]:  # the others first; the first one's output is kept
                        os.environ["DEEPINFER_GGUF_WORDS"] = "0" if variant == "bytes" else "1"
                        os.environ["DEEPINFER_GGUF_DP4A"] = "1" if variant == "dp4a" else "0"
                        t = graph_time(lambda x=x, planes=planes, fz=fz: gguf_gemv(x, planes, **fz))
                        diff = float((gguf_gemv(x, planes, **fz).float() - outputs[rows, scales]).abs().max())
                        print(f"{name:8s} {kind:5s} gemv {variant} {scales}: {t * 1e6:7.1f} us "
                              f"{(nbytes + x.numel() * 2) / t / 1e9:6,.0f} GB/s; max |diff| to "
                              f"{args.gemv.split(',')[0]} {diff:.3g}", flush=True)
                    os.environ["DEEPINFER_GGUF_WORDS"] = "0" if args.gemv.split(",")[0] == "bytes" else "1"
                    os.environ["DEEPINFER_GGUF_DP4A"] = "1" if args.gemv.split(",")[0] == "dp4a" else "0"
                    t = graph_time(lambda x=x, planes=planes, fz=fz: gguf_gemv(x, planes, **fz))
                    what = f"gemv {args.gemv.split(',')[0]} {scales}"
                else:
                    t = graph_time(lambda x=x, planes=planes: gguf_gemm(x, planes))
                    tb = graph_time(lambda x=x, w=w: F.linear(x, w))
                    what = f"gemm {scales} {rows} rows (cuBLAS bf16 {tb * 1e6:.1f} us)"
                    if mmq_supports(planes):  # the int8 tensor-core product, activations quantized in the graph
                        tq = graph_time(lambda x=x, planes=planes: gguf_mmq(quantize_rows(x), planes))
                        dq = float((gguf_mmq(quantize_rows(x), planes).float() - outputs[rows, scales]).abs().max())
                        print(f"{name:8s} {kind:5s} mmq {rows} rows: {tq * 1e6:7.1f} us "
                              f"{(nbytes + x.numel() * 2) / tq / 1e9:6,.0f} GB/s, cuBLAS bf16 {tb * 1e6:.1f} us; "
                              f"max |diff| to the gemm {dq:.3g}", flush=True)
                gbs = (nbytes + x.numel() * 2) / t / 1e9
                same = outputs[rows, scales] - outputs[rows, args.scales.split(",")[0]]
                print(f"{name:8s} {kind:5s} {what}: {t * 1e6:7.1f} us {gbs:6,.0f} GB/s "
                      f"({100 * gbs / copy:.0f} % of copy) {8 * nbytes / (n * k):.2f} bits/weight; max |diff| to "
                      f"the first variant {float(same.abs().max()):.3g}", flush=True)
            del planes
        del w
        torch.cuda.empty_cache()
    for kind in filter(None, args.sweep.split(",")):
        sweep(kind, copy, args.fused, tuple(args.sweep_variants.split(",")))
    for kind in filter(None, args.mmq_sweep.split(",")):
        mmq_sweep(kind)
    for kind in filter(None, args.swap_sweep.split(",")):
        swap_sweep(kind, [int(r) for r in args.swap_rows.split(",")])
    for kind in filter(None, args.split_sweep.split(",")):
        split_sweep(kind, [int(r) for r in args.split_rows.split(",")])
    for kind in filter(None, args.tile_sweep.split(",")):
        tile_sweep(kind, [int(r) for r in args.tile_rows.split(",")],
                   TILE_SWEEP_OCCUPANCY if args.tile_sweep_set == "occupancy" else None)


TILES = [(4, 512, 4, 3), (2, 512, 4, 3), (8, 256, 4, 3), (4, 1024, 8, 2), (1, 1024, 4, 3), (8, 512, 8, 2)]
# the word GEMV's (ROWS, BLOCK_K bytes, warps, stages)
WORD_TILES = [(4, 2048, 4, 2), (4, 1024, 2, 2), (4, 512, 1, 2), (8, 2048, 4, 2), (8, 1024, 2, 2), (8, 512, 1, 2),
              (8, 512, 2, 2), (8, 1024, 4, 2), (8, 256, 1, 2), (2, 512, 1, 2)]


def sweep(kind: str, copy: float, fused: bool = False, sweep_variants: tuple[str, ...] = ("words", "tiled")) -> None:
    from deepinfer.runtime.kernels.gguf_gemv import gguf_gemv
    from deepinfer.runtime.kernels.gguf_layout import regroup
    from gguf_quantizer import quantize

    gen = torch.Generator(device="cuda").manual_seed(1)
    for name in ("gate_up", "down"):
        n, k = SHAPES[name]
        planes = regroup(quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.02, kind), kind)
        width, fusion = decode_fusion(name, n, k, fused)
        fz = _fused(fusion)
        x = torch.randn(1, width, device="cuda", dtype=torch.bfloat16)
        for scales in sweep_variants:  # the word GEMV (with dp4a); the byte GEMV with tiled scales
            os.environ["DEEPINFER_GGUF_WORDS"] = "0" if scales == "tiled" else "1"
            os.environ["DEEPINFER_GGUF_DP4A"] = "1" if scales == "dp4a" else "0"
            for tile in TILES if scales == "tiled" else WORD_TILES:
                t = graph_time(lambda tile=tile, x=x, planes=planes, fz=fz: gguf_gemv(x, planes, config=tile, **fz))
                gbs = planes.nbytes() / t / 1e9
                print(f"sweep {name:8s} {kind} {scales:6s} tile {tile}: {t * 1e6:7.1f} us {gbs:6,.0f} GB/s "
                      f"({100 * gbs / copy:.0f} % of copy)", flush=True)


# the GEMM's (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); BLOCK_M is cut to the rows
GEMM_TILES = [(64, 64, 64, 4, 3), (32, 128, 64, 4, 3), (32, 64, 128, 4, 3), (32, 128, 128, 8, 3), (32, 32, 128, 4, 4),
              (32, 64, 64, 4, 4), (32, 256, 64, 8, 3)]
MMQ_TILES = [(64, 4, 3), (32, 4, 3), (128, 4, 3), (128, 8, 3), (64, 4, 2), (64, 8, 4), (32, 2, 3), (16, 1, 3)]


def mmq_sweep(kind: str, rows: int = 32) -> None:
    from deepinfer.runtime.kernels.gguf_gemv import gguf_gemm
    from deepinfer.runtime.kernels.gguf_layout import regroup
    from deepinfer.runtime.kernels.gguf_mmq import gguf_mmq, quantize_rows
    from gguf_quantizer import quantize

    gen = torch.Generator(device="cuda").manual_seed(1)
    for name in ("gate_up", "down"):
        n, k = SHAPES[name]
        planes = regroup(quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.02, kind), kind)
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        xq = quantize_rows(x)
        tq = graph_time(lambda x=x: quantize_rows(x))
        for tile in MMQ_TILES:
            t = graph_time(lambda tile=tile, planes=planes, xq=xq: gguf_mmq(xq, planes, config=tile))
            print(f"mmq sweep {name:8s} {kind} {rows} rows tile {tile}: {t * 1e6:7.1f} us "
                  f"(+ {tq * 1e6:.1f} us quantize_rows)", flush=True)
        for gtile in GEMM_TILES:  # the bf16-decoding GEMM beside it
            t = graph_time(lambda gtile=gtile, planes=planes, x=x: gguf_gemm(x, planes, config=gtile))
            print(f"gemm sweep {name:8s} {kind} {rows} rows tile {gtile}: {t * 1e6:7.1f} us", flush=True)


# the swapped GEMM's (BLOCK_M activation rows, BLOCK_N weight rows = the MMA's M, BLOCK_K, warps, stages)
SWAP_TILES = [(32, 64, 128, 4, 3), (16, 64, 128, 4, 3), (32, 64, 64, 4, 4), (32, 64, 256, 4, 2), (32, 128, 128, 8, 3),
              (64, 64, 128, 4, 3), (64, 128, 64, 8, 3), (32, 128, 64, 4, 3), (128, 128, 64, 8, 3)]


def swap_sweep(kind: str, rows_list: list[int]) -> None:
    from deepinfer.runtime.kernels.gguf_gemv import gguf_gemm
    from deepinfer.runtime.kernels.gguf_layout import regroup
    from gguf_quantizer import quantize
    from triton.runtime.errors import OutOfResources

    gen = torch.Generator(device="cuda").manual_seed(1)
    for name in ("gate_up", "down", "qkv"):
        n, k = SHAPES[name]
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        planes = regroup(quantize(w, kind), kind)
        wb = w.to(torch.bfloat16)
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            ref = gguf_gemm(x, planes, swap=False).float()
            tb = graph_time(lambda x=x, wb=wb: F.linear(x, wb))
            tp = graph_time(lambda x=x, planes=planes: gguf_gemm(x, planes, swap=False))
            best = (tp, "plain default")
            print(f"swap sweep {name:8s} {kind} {rows:3d} rows: cuBLAS bf16 {tb * 1e6:7.1f} us, plain default "
                  f"{tp * 1e6:7.1f} us", flush=True)
            for tile in SWAP_TILES:
                if tile[0] > max(16, rows) * 2:
                    continue
                try:
                    t = graph_time(lambda tile=tile, planes=planes, x=x: gguf_gemm(x, planes, config=tile, swap=True))
                except OutOfResources as exc:  # a tile that needs too much shared memory is reported, not fatal
                    print(f"swap sweep {name:8s} {kind} {rows:3d} rows tile {tile}: failed ({type(exc).__name__})")
                    continue
                diff = float((gguf_gemm(x, planes, config=tile, swap=True).float() - ref).abs().max())
                best = min(best, (t, f"swapped {tile}"))
                print(f"swap sweep {name:8s} {kind} {rows:3d} rows tile {tile}: {t * 1e6:7.1f} us; max |diff| to "
                      f"plain {diff:.3g}", flush=True)
            print(f"swap sweep {name:8s} {kind} {rows:3d} rows BEST {best[1]} {best[0] * 1e6:.1f} us "
                  f"(cuBLAS bf16 {tb * 1e6:.1f})", flush=True)
        del planes, w, wb
        torch.cuda.empty_cache()


def split_sweep(kind: str, rows_list: list[int]) -> None:
    """The GEMM at its default tile with K split 1..8 ways and as ``choose_split_k`` picks, per
    projection and row count, beside cuBLAS bf16 (the split kernel's time includes the sum kernel)."""
    from deepinfer.runtime.kernels.gguf_gemv import gguf_gemm
    from deepinfer.runtime.kernels.gguf_layout import regroup
    from gguf_quantizer import quantize

    gen = torch.Generator(device="cuda").manual_seed(1)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        planes = regroup(quantize(w, kind), kind)
        wb = w.to(torch.bfloat16)
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            ref = gguf_gemm(x, planes, split_k=1).float()
            tb = graph_time(lambda x=x, wb=wb: F.linear(x, wb))
            cells = []
            for split in (1, 2, 3, 4, 6, 8, 0):
                t = graph_time(lambda x=x, planes=planes, split=split: gguf_gemm(x, planes, split_k=split))
                diff = float((gguf_gemm(x, planes, split_k=split).float() - ref).abs().max())
                cells.append(f"{'chosen' if split == 0 else split} {t * 1e6:.1f}" + (f" (|diff| {diff:.2g})" if diff > 0.05 else ""))
            print(f"split sweep {name:8s} {kind} {rows:3d} rows: cuBLAS bf16 {tb * 1e6:.1f} us; split -> us: "
                  + ", ".join(cells), flush=True)
        del planes, w, wb
        torch.cuda.empty_cache()


# (swap, (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)) of --tile-sweep, and its splits per projection
TILE_SWEEP = [(False, (32, 64, 128, 4, 3)), (False, (32, 128, 128, 8, 3)), (False, (32, 64, 256, 4, 2)),
              (False, (32, 128, 64, 4, 3)), (False, (16, 64, 128, 4, 3)), (True, (32, 64, 128, 4, 3)),
              (True, (32, 128, 128, 8, 3)), (True, (32, 128, 64, 4, 4)), (True, (16, 64, 256, 4, 2))]
# --tile-sweep-set occupancy: tiles with less shared memory a program than the defaults (ncu, H100, Q4_0 gate_up
# at 32 rows: 3 programs of 4 warps a multiprocessor, held by 66 KB of shared memory and 128 registers each;
# a scheduler issued an instruction every 2.2 cycles)
TILE_SWEEP_OCCUPANCY = [(True, (32, 64, 128, 4, 3)), (True, (32, 64, 128, 4, 2)), (True, (32, 64, 64, 4, 3)),
                        (True, (32, 64, 64, 4, 4)), (True, (32, 64, 128, 8, 3)), (True, (32, 128, 128, 8, 2)),
                        (True, (32, 128, 64, 8, 3)), (False, (32, 64, 128, 4, 3)), (False, (32, 64, 128, 4, 2)),
                        (False, (32, 64, 64, 4, 3)), (False, (32, 128, 64, 8, 3))]
TILE_SPLITS = {"gate_up": (1, 2, 3), "down": (2, 4, 6, 8)}


def tile_sweep(kind: str, rows_list: list[int], tiles: list | None = None) -> None:
    from deepinfer.runtime.kernels.gguf_gemv import gguf_gemm
    from deepinfer.runtime.kernels.gguf_layout import regroup
    from gguf_quantizer import quantize
    from triton.runtime.errors import OutOfResources

    gen = torch.Generator(device="cuda").manual_seed(1)
    for name, splits in TILE_SPLITS.items():
        n, k = SHAPES[name]
        planes = regroup(quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.02, kind), kind)
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            t0 = graph_time(lambda x=x, planes=planes: gguf_gemm(x, planes))
            best = (t0, "default")
            print(f"tile sweep {name:8s} {kind} {rows:3d} rows: default {t0 * 1e6:.1f} us", flush=True)
            for swap, tile in tiles or TILE_SWEEP:
                cells = []
                for split in splits:
                    try:
                        t = graph_time(lambda x=x, planes=planes, tile=tile, swap=swap, split=split:
                                       gguf_gemm(x, planes, config=tile, swap=swap, split_k=split))
                    except OutOfResources:
                        cells.append(f"{split} -")
                        continue
                    best = min(best, (t, f"{'swapped' if swap else 'plain'} {tile} split {split}"))
                    cells.append(f"{split} {t * 1e6:.1f}")
                print(f"tile sweep {name:8s} {kind} {rows:3d} rows {'swapped' if swap else 'plain  '} {tile}: "
                      + ", ".join(cells), flush=True)
            print(f"tile sweep {name:8s} {kind} {rows:3d} rows BEST {best[1]} {best[0] * 1e6:.1f} us", flush=True)
        del planes
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
