"""Time of one MoE layer's routed part (router, routing, sort by expert, grouped GEMMs, combine)
on the GPU, replayed from a CUDA graph (no launch overhead), for a few tile shapes: the data for
``kernels.fused_moe``'s tile choice. A script, not a test.

    python bench/moe_layer_bench.py [--shape qwen3-30b-a3b] [--tokens 1,8,64,256]

Random bf16 weights; prints ms per layer, the distinct expert weights read per second, and the
torch routing + align path against the Triton one at each T.
"""

from __future__ import annotations

import argparse

import torch

SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "deepseek-v2-lite": (2048, 1408, 64, 6),
          "mixtral-8x7b": (4096, 14336, 8, 2)}
TILES = [(16, 64, 64), (16, 32, 64), (16, 32, 128), (16, 64, 128), (16, 32, 256), (16, 128, 64), (32, 64, 64),
         (64, 128, 64)]
# Prefill-sized steps (T*k above fused_experts' SMALL_STEP_PAIRS) also sweep warps and stages: a
# 128-token prefill reads every expert's weights (the whole layer): 3.5 TB/s at the defaults on the H200 (2026-12-03).
PREFILL_TILES = [(16, 64, 128), (16, 128, 64), (16, 128, 128), (32, 64, 128), (32, 128, 64), (32, 128, 128),
                 (64, 128, 64), (64, 64, 128)]
LAUNCHES = [(4, 3), (4, 4), (8, 3), (8, 4)]


def random_layer(shape: str) -> tuple[torch.Generator, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the CUDA generator, w13 [E, 2I, H] bf16, w2 [E, H, I] bf16, router [E, H] float32) of one
    random MoE layer of ``shape``, scale 0.02 (the generator goes on to draw the inputs)."""
    hidden, inter, e, _ = SHAPES[shape]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(e, 2 * inter, hidden, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(e, hidden, inter, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
    gate = torch.randn(e, hidden, device=dev, generator=g) * 0.02
    return g, w13, w2, gate


def graph_ms(fn, reps: int = 50) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 10


def bench_tokens(shape: str, x: torch.Tensor, gate: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 spec) -> None:  # type: ignore[no-untyped-def]
    from deepinfer.runtime.kernels import fused_moe as fm
    from deepinfer.runtime.models.moe import route
    from triton.runtime.errors import OutOfResources

    t, (e, k) = x.shape[0], (spec.num_experts, spec.top_k)
    inter, hidden = w2.shape[2], w2.shape[1]
    w, ids = fm.route_greedy(x.float() @ gate.t(), k, False, True)
    used = ids.unique().numel()
    weight_bytes = used * 3 * inter * hidden * 2
    r_torch = graph_ms(lambda: route(x.float() @ gate.t(), spec))
    r_triton = graph_ms(lambda: fm.route_greedy(x.float() @ gate.t(), k, False, True))
    try:
        a_torch = graph_ms(lambda: fm.align_by_expert(ids, e, 16))
    except RuntimeError as exc:  # (torch's sort refusing a capture: report, go on)
        print(f"  torch align_by_expert in a graph: {exc}")
        a_torch = float("nan")
    a_triton = graph_ms(lambda: fm.align_by_expert_triton(ids, e, 16))
    print(f"{shape} T={t}: router+routing torch {r_torch * 1e3:.1f} us, triton {r_triton * 1e3:.1f} us; "
          f"align torch {a_torch * 1e3:.1f} us, triton {a_triton * 1e3:.1f} us; {used} experts used", flush=True)
    for bm, bn, bk in TILES:
        try:
            ms = graph_ms(lambda bm=bm, bn=bn, bk=bk: fm.fused_experts(x, w, ids, w13, w2, bm, bn, bk))
        except (OutOfResources, RuntimeError) as exc:  # a tile the GPU refuses: say so, go on
            print(f"  tiles {bm},{bn},{bk}: {type(exc).__name__}: {str(exc)[:80]}")
            continue
        print(f"  tiles (M,N,K)={bm},{bn},{bk}: experts {ms * 1e3:.1f} us, {weight_bytes / ms / 1e6:,.0f} GB/s "
              f"of distinct expert weights", flush=True)
    if t * k <= fm.SMALL_STEP_PAIRS:
        return
    for (bm, bn, bk), (warps, stages) in ((tile, launch) for tile in PREFILL_TILES for launch in LAUNCHES):
        try:
            ms = graph_ms(lambda bm=bm, bn=bn, bk=bk, w_=warps, s_=stages: fm.fused_experts(
                x, w, ids, w13, w2, bm, bn, bk, num_warps=w_, num_stages=s_), reps=10)
        except (OutOfResources, RuntimeError) as exc:
            print(f"  tiles {bm},{bn},{bk} warps {warps} stages {stages}: {type(exc).__name__}: {str(exc)[:60]}")
            continue
        print(f"  tiles (M,N,K)={bm},{bn},{bk} warps {warps} stages {stages}: experts {ms * 1e3:.1f} us, "
              f"{weight_bytes / ms / 1e6:,.0f} GB/s", flush=True)


def main() -> None:
    from deepinfer.runtime.models.config import MoeSpec

    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", default="1,8,64,256")
    args = p.parse_args()
    hidden, inter, e, k = SHAPES[args.shape]
    g, w13, w2, gate = random_layer(args.shape)
    dev = g.device
    spec = MoeSpec(num_experts=e, top_k=k, expert_intermediate_size=inter, moe_layers=(0,), norm_topk_prob=True)
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, hidden, device=dev, generator=g, dtype=torch.bfloat16)
        bench_tokens(args.shape, x, gate, w13, w2, spec)


if __name__ == "__main__":
    main()
