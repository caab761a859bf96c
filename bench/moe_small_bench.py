"""One MoE layer of a decode step of T = 1..8 tokens on the GPU, replayed from a CUDA graph: the
few-token kernels (``kernels.moe_decode``: router in one launch, expert GEMVs, down + combine +
residual) against the grouped path (``add_rmsnorm``, router matmul, ``route_greedy``, sort by
expert, grouped GEMMs, combine), and a sweep of the new kernels' tiles. A script, not a test.

    python bench/moe_small_bench.py [--shape qwen3-30b-a3b] [--tokens 1,2,4,8] [--quick]

Random bf16 weights. Prints microseconds per layer and the GB/s of expert weights read (every
pair reads its expert's rows; "distinct" counts each used expert once), then the best tiles.
"""

from __future__ import annotations

import argparse

import torch
from moe_layer_bench import SHAPES, graph_ms, random_layer

# (BLOCK_N, BLOCK_K, num_warps) candidates of the gate/up and down kernels; (BLOCK_E, BLOCK_K, warps) of the router
# (2026-12-05: fewer warps a program added, not yet swept on a GPU: the router's last program runs
# the top-k as 8 rounds of cross-warp reductions, which one warp does with shuffles alone.)
GATE_UP_TILES = [(1, 1024, 4), (1, 2048, 4), (2, 512, 4), (2, 1024, 4), (2, 2048, 8), (4, 256, 4), (4, 512, 4),
                 (4, 1024, 8), (8, 256, 4), (8, 512, 8), (16, 256, 8), (1, 2048, 2), (1, 2048, 8), (2, 2048, 4)]
DOWN_TILES = [(1, 256, 2), (1, 256, 4), (2, 256, 4), (2, 512, 4), (2, 1024, 4), (4, 256, 4), (4, 128, 4), (8, 128, 4),
              (8, 256, 8), (16, 128, 8), (4, 512, 8), (1, 1024, 2), (2, 1024, 2), (4, 1024, 8)]
ROUTER_TILES = [(1, 1024, 4), (1, 2048, 4), (2, 1024, 4), (2, 2048, 8), (4, 512, 4), (8, 256, 4), (1, 2048, 1),
                (1, 2048, 2), (2, 2048, 2), (4, 2048, 4)]


def _us(fn) -> float:  # type: ignore[no-untyped-def]
    from triton.runtime.errors import OutOfResources

    try:
        return graph_ms(fn) * 1e3
    except (OutOfResources, RuntimeError) as exc:  # a tile the GPU refuses: say so, go on
        print(f"    refused: {type(exc).__name__}: {str(exc)[:80]}")
        return float("inf")


def main() -> None:
    from deepinfer.runtime.kernels import moe_decode as md
    from deepinfer.runtime.kernels.fused_moe import fused_experts, route_greedy
    from deepinfer.runtime.kernels.fused_ops import add_rmsnorm

    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--quick", action="store_true", help="no tile sweep: defaults against the grouped path")
    args = p.parse_args()
    hidden, inter, _, k = SHAPES[args.shape]
    g, w13, w2, gate = random_layer(args.shape)
    dev = g.device
    nw = torch.ones(hidden, device=dev, dtype=torch.bfloat16)
    norm = (nw, 1e-6)
    pair_bytes = 3 * inter * hidden * 2  # one expert's w13 + w2, bf16
    best: dict[str, dict[int, tuple[float, tuple[int, int, int]]]] = {"gate_up": {}, "down": {}, "router": {}}
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, hidden, device=dev, generator=g, dtype=torch.bfloat16)

        def grouped(x=x):  # type: ignore[no-untyped-def]
            h, _ = add_rmsnorm(x, None, nw, 1e-6)
            w, ids = route_greedy(h.float() @ gate.t(), k, False, True)
            return fused_experts(h, w, ids, w13, w2, residual=x)

        def small(x=x, gu=md.GATE_UP_CONFIG, dn=md.DOWN_CONFIG, rt=md.ROUTER_CONFIG, static=None):  # type: ignore[no-untyped-def]
            w, ids = md.route_small(x, gate, k, False, True, norm=norm, config=rt)
            return md.experts_small(x, w, ids, w13, w2, residual=x, norm=norm, gate_up_config=gu, down_config=dn,
                                    static_k=static)

        def small_prenormed(x=x):  # type: ignore[no-untyped-def]
            normed = torch.empty_like(x)  # the router stores the normed rows (DEEPINFER_MOE_PRENORM)
            w, ids = md.route_small(x, gate, k, False, True, norm=norm, normed_out=normed)
            return md.experts_small(normed, w, ids, w13, w2, residual=x)

        _, ids = md.route_small(x, gate, k, False, True, norm=norm)
        used = ids.unique().numel()
        pre_us = _us(small_prenormed)
        pre_diff = float((small_prenormed().float() - small().float()).abs().max())
        err = float((small().float() - grouped().float()).abs().max())
        g_us, s_us = _us(grouped), _us(small)
        r_us = _us(lambda x=x: md.route_small(x, gate, k, False, True, norm=norm))
        read = t * k * pair_bytes
        print(f"{args.shape} T={t}: grouped path {g_us:.1f} us, few-token path {s_us:.1f} us "
              f"(router {r_us:.1f} us; experts {read / (s_us - r_us) / 1e3:,.0f} GB/s of pair reads, "
              f"{used * pair_bytes / (s_us - r_us) / 1e3:,.0f} GB/s distinct; {used} experts); "
              f"ratio {g_us / s_us:.2f}x; max |diff| {err:.2e}; with the router's stored normed rows "
              f"{pre_us:.1f} us (|diff| {pre_diff:.1e})", flush=True)
        # the expert kernels' K loops unrolled (compiled for K) against a runtime K, alternated over 3
        # rounds so drift falls on each alike (moe_decode.STATIC_K_MAX_TOKENS from these)
        times: dict[bool, list[float]] = {}
        for _ in range(3):
            for static in (True, False):
                times.setdefault(static, []).append(_us(lambda x=x, static=static: small(x, static=static)))
        for static, us_list in times.items():
            print(f"  T={t} K loops {'unrolled' if static else 'runtime'}: layer {sorted(us_list)[1]:.1f} us "
                  f"(runs {', '.join(f'{v:.1f}' for v in us_list)})", flush=True)
        if args.quick:
            continue
        # one kernel's tiles at a time, the other two at their defaults
        for name, tiles in (("gate_up", GATE_UP_TILES), ("down", DOWN_TILES), ("router", ROUTER_TILES)):
            for tile in tiles:
                cfg = {"gate_up": dict(gu=tile), "down": dict(dn=tile), "router": dict(rt=tile)}[name]
                us = _us(lambda x=x, cfg=cfg: small(x, **cfg))
                print(f"  T={t} {name} tiles {tile}: layer {us:.1f} us", flush=True)
                if us < best[name].get(t, (float("inf"),))[0]:
                    best[name][t] = (us, tile)
        gu, dn, rt = (best[n][t][1] for n in ("gate_up", "down", "router"))
        us = _us(lambda x=x, gu=gu, dn=dn, rt=rt: small(x, gu, dn, rt))
        print(f"T={t} best tiles gate_up {gu} down {dn} router {rt}: layer {us:.1f} us "
              f"(grouped {g_us:.1f} us, ratio {g_us / us:.2f}x)", flush=True)
    if not args.quick:
        for name, per_t in best.items():
            print(f"best {name} tiles per T: " + ", ".join(f"T={t} {tile} {us:.1f} us" for t, (us, tile) in per_t.items()))


if __name__ == "__main__":
    main()
