"""Test helper: the few-token MoE kernels (``kernels.moe_decode``: router in one launch, expert
GEMVs without the sort by expert, the combine fused into the down projection) against float64
references, and the decode forward of tiny Qwen3-MoE / Qwen2-MoE models with the few-token path
against the grouped one.

``python moe_decode_check.py DEVICE DTYPE [kernels|models|all]``: on CPU run it with
``TRITON_INTERPRET=1`` (Triton's interpreter); prints one line per case and exits non-zero on a
mismatch."""

from __future__ import annotations

import sys

import torch

# name: (tokens, top_k, experts, hidden, inter, residual, norm)
EXPERT_CASES = {
    "one_token": (1, 4, 16, 96, 80, True, False),
    "several_tokens": (5, 2, 8, 96, 80, False, False),
    "all_to_one_expert": (6, 1, 8, 64, 48, True, False),
    "repeated_expert_across_tokens": (4, 2, 6, 64, 40, True, True),
    "top_k_1": (3, 1, 8, 64, 48, False, True),
    "top_k_8": (2, 8, 16, 72, 56, True, True),
}


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * w rounded as fused_ops.add_rmsnorm rounds (in x's dtype), as the kernels' prologue."""
    xf = x.float()
    return (w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).float()).to(x.dtype)


def make_case(name: str, device: str, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    t, k, e, hidden, inter, has_res, has_norm = EXPERT_CASES[name]
    g = torch.Generator().manual_seed(len(name))
    x = torch.randn(t, hidden, generator=g)
    w13 = torch.randn(e, 2 * inter, hidden, generator=g) * hidden ** -0.5
    w2 = torch.randn(e, hidden, inter, generator=g) * inter ** -0.5
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    if name == "all_to_one_expert":
        ids[:] = 3
    if name == "repeated_expert_across_tokens":  # expert 2 in every token, at different slots
        ids = torch.tensor([[2, 0], [1, 2], [2, 5], [4, 2]])
    weights = torch.rand(t, k, generator=g)
    res = torch.randn(t, hidden, generator=g) if has_res else None
    norm = (torch.rand(hidden, generator=g) + 0.5, 1e-6) if has_norm else None
    to = lambda v: v.to(device=device, dtype=dtype)  # noqa: E731
    return (to(x), weights.to(device), ids.to(device), to(w13), to(w2), None if res is None else to(res),
            None if norm is None else (to(norm[0]), norm[1]))


def check_experts(device: str, dtype: torch.dtype) -> list[tuple[str, bool, float]]:
    from deepinfer.runtime.kernels import moe_decode
    from deepinfer.runtime.kernels.moe_decode import experts_small, route_small
    from fused_moe_check import reference

    # Triton's interpreter runs one program at a time: wider tiles there (still cutting every
    # case's rows or columns short somewhere), the default tiles on the GPU
    tiles = dict(gate_up_config=(16, 32, 4), down_config=(16, 32, 4)) if device == "cpu" else {}
    out = []
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name in EXPERT_CASES:
        x, w, ids, w13, w2, res, norm = make_case(name, device, dtype)
        xin = x if norm is None else rms(x, *norm)
        ref = reference(xin.cpu(), w.cpu(), ids.cpu(), w13.cpu(), w2.cpu())
        if res is not None:
            ref += res.cpu().double()
        got = experts_small(x, w, ids, w13, w2, residual=res, norm=norm, **tiles).double().cpu()
        err = float((got - ref).abs().max() / ref.abs().max())
        out.append((f"experts_small {name} residual={res is not None} norm={norm is not None}", err <= tol, err))
        # the other form of the loops over K: compiled for the shape (unrolled) or over a runtime K
        other = not moe_decode.static_k_loops(x.shape[0], x.shape[1], w2.shape[2])[0]
        loop = experts_small(x, w, ids, w13, w2, residual=res, norm=norm, static_k=other, **tiles).double().cpu()
        err = float((loop - ref).abs().max() / ref.abs().max())
        out.append((f"experts_small {name} with {'unrolled' if other else 'runtime'} K loops", err <= tol, err))
        # the down kernel with every slot's expert rows loaded before its PDL wait (one [k, rows, K] tile)
        pre_tiles = dict(tiles, down_config=(4, 32, 4)) if device == "cpu" else tiles
        pre = experts_small(x, w, ids, w13, w2, residual=res, norm=norm, preload=True, **pre_tiles).double().cpu()
        err = float((pre - ref).abs().max() / ref.abs().max())
        out.append((f"experts_small {name} with the down rows preloaded", err <= tol, err))
        # the down kernel's slots reduced once (DEEPINFER_MOE_DOWN_ONE_SUM), with both forms of its K loop
        for static in (False, True):
            one = experts_small(x, w, ids, w13, w2, residual=res, norm=norm, static_k=static, one_sum=True,
                                **tiles).double().cpu()
            err = float((one - ref).abs().max() / ref.abs().max())
            out.append((f"experts_small {name} with the slots reduced once ({'unrolled' if static else 'runtime'} "
                        "K loops)", err <= tol, err))
        if norm is not None:  # the router's stored normed rows: the same rows, the same experts' output bits
            normed = torch.empty_like(x)
            gw = torch.randn(w13.shape[0], x.shape[1], generator=torch.Generator().manual_seed(1)).to(x.device)
            route_small(x, gw, ids.shape[1], False, True, norm=norm, normed_out=normed,
                        **(dict(config=(16, 32, 4)) if device == "cpu" else {}))
            pre = experts_small(normed, w, ids, w13, w2, residual=res, **tiles).double().cpu()
            # relative to the rows' largest value: bf16 rows may differ from rms()'s rounding by an ulp or two
            rows_err = float((normed.double() - xin.double()).abs().max() / xin.double().abs().max())
            same = torch.equal(pre, got) and rows_err <= (1e-6 if dtype == torch.float32 else 2**-6)
            # K in one chunk (the GPU's tiles here): the gate/up kernel reuses the row it loaded for the norm
            one_tile = dict(tiles, gate_up_config=(16, 128, 4))
            one = experts_small(x, w, ids, w13, w2, residual=res, norm=norm, static_k=True, **one_tile)
            same = same and torch.equal(one, experts_small(normed, w, ids, w13, w2, residual=res, static_k=True,
                                                           **one_tile))
            out.append((f"experts_small {name} on route_small's normed rows: bitwise the in-kernel norm's "
                        f"output (rows' error {rows_err:.1e})", same, float((pre - got).abs().max())))
    return out


def check_router(device: str, dtype: torch.dtype) -> list[tuple[str, bool, float]]:
    """route_small == route_greedy over the float32 logits (norm in the prologue or not); "ties": a
    gate whose rows repeat (equal logits), so the lower expert index must come first (torch.topk on
    the CPU leaves tied indices unordered)."""
    from deepinfer.runtime.kernels.fused_moe import route_greedy
    from deepinfer.runtime.kernels.moe_decode import route_small

    out = []
    for t, e, hidden, k, sigmoid, norm_topk, use_norm, ties in [(1, 16, 96, 4, False, True, True, False),
                                                                (7, 60, 64, 6, False, False, False, False),
                                                                (3, 128, 128, 8, True, True, True, False),
                                                                (2, 8, 40, 1, False, True, False, False),
                                                                (3, 32, 64, 6, False, True, False, True)]:
        g = torch.Generator().manual_seed(t * e)
        x = torch.randn(t, hidden, generator=g).to(device, dtype)
        gw = torch.randn(e, hidden, generator=g) * hidden ** -0.5
        if ties:  # experts 2i and 2i+1 share a row, and so their logits, bit for bit
            gw = gw[torch.arange(e) // 2 * 2].contiguous()
        gw = gw.to(device)
        norm = ((torch.rand(hidden, generator=g) + 0.5).to(device, dtype), 1e-6) if use_norm else None
        xin = x if norm is None else rms(x, *norm)
        want_w, want_i = route_greedy(xin.float() @ gw.t(), k, sigmoid, norm_topk, 1.5)
        if ties:  # the independent expectation: a stable descending sort (lower index first on ties)
            order = torch.sort((xin.float() @ gw.t()).cpu(), dim=-1, descending=True, stable=True).indices[:, :k]
            assert torch.equal(want_i.cpu(), order)
        got_w, got_i = route_small(x, gw, k, sigmoid, norm_topk, 1.5, norm=norm,
                                   **(dict(config=(16, 32, 4)) if device == "cpu" else {}))
        err = float((got_w - want_w).abs().max())
        ok = torch.equal(got_i.cpu(), want_i.cpu()) and err <= 1e-5
        out.append((f"route_small T={t} E={e} k={k} sigmoid={sigmoid} norm={use_norm} ties={ties}", ok, err))
    return out


def check_top_ids(device: str) -> list[tuple[str, bool, float]]:
    """route_in_o's top-k over integer keys (``moe_decode._top_ids``) against a stable descending
    sort: signed zeros tie, negatives order by magnitude, infinities, tiny values, repeated
    values to the lower index, padding experts never chosen."""
    import triton
    import triton.language as tl
    from deepinfer.runtime.kernels import moe_decode

    globals()["_top_ids"] = moe_decode._top_ids  # the kernel below resolves it among this module's names

    @triton.jit
    def run(x_ptr, ids_ptr, n, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr):
        offs = tl.arange(0, E_PAD)
        ok = offs < n
        _top_ids(tl.load(x_ptr + offs, mask=ok, other=0.0), offs, ok, ids_ptr, TOP_K, K_PAD, E_PAD)  # noqa: F821

    x = torch.tensor([3.0, -0.0, 0.0, -1e30, 1e30, -2.5, -2.5, 7.0, float("inf"), float("-inf"), 1e-30, -1e-30, 0.5],
                     device=device)
    out = []
    for k in (1, 5, 13):
        ids = torch.full((k,), -7, dtype=torch.int64, device=device)
        run[(1,)](x, ids, x.numel(), TOP_K=k, K_PAD=triton.next_power_of_2(k), E_PAD=16)
        want = torch.sort(x.cpu(), descending=True, stable=True).indices[:k]
        out.append((f"route_in_o's top-k keys, k={k} of 13 (16 padded)", torch.equal(ids.cpu(), want), 0.0))
    return out


def check_route_in_o(device: str, dtype: torch.dtype) -> list[tuple[str, bool, float]]:
    """route_in_o (the router in the o projection's launch) against the separate kernels: h is
    bitwise gemv(a, W_o, residual=x); the ids equal route_greedy's over the float64 logits of
    RMSNorm(h) (a stable descending sort where gate rows repeat: ties to the lower index); the
    weights stored by the gate/up kernel and the block's output match the reference path."""
    from deepinfer.runtime.kernels.fused_moe import route_greedy
    from deepinfer.runtime.kernels.gemv import gemv
    from deepinfer.runtime.kernels.moe_decode import experts_small, route_in_o
    from fused_moe_check import reference

    out = []
    # (experts, top_k, hidden, attention width, inter, sigmoid, norm_topk, scaling, ties)
    for e, k, hidden, q, inter, sigmoid, norm_topk, scaling, ties in [(16, 4, 96, 128, 40, False, True, 1.0, False),
                                                                      (60, 6, 64, 96, 32, False, False, 1.0, False),
                                                                      (128, 8, 128, 64, 24, True, True, 2.5, False),
                                                                      (8, 1, 40, 72, 16, False, True, 1.0, False),
                                                                      (32, 6, 64, 64, 16, False, True, 1.0, True)]:
        g = torch.Generator().manual_seed(e * k + q)
        a = torch.randn(1, q, generator=g)
        wo = torch.randn(hidden, q, generator=g) * q ** -0.5
        x = torch.randn(1, hidden, generator=g)
        gw = torch.randn(e, hidden, generator=g) * hidden ** -0.5
        if ties:  # experts 2i and 2i+1 share a row, so their logits are equal bit for bit
            gw = gw[torch.arange(e) // 2 * 2].contiguous()
        gamma = torch.rand(hidden, generator=g) + 0.5
        w13 = torch.randn(e, 2 * inter, hidden, generator=g) * hidden ** -0.5
        w2 = torch.randn(e, hidden, inter, generator=g) * inter ** -0.5
        to = lambda v: v.to(device=device, dtype=dtype)  # noqa: E731
        a, wo, x, gamma, w13, w2 = map(to, (a, wo, x, gamma, w13, w2))
        wx = (gw * gamma.float().cpu()[None, :]).to(device)
        wa = (wx.double().cpu() @ wo.double().cpu()).float().to(device)
        tile = (4, 32, 4, 1)
        h, weights, ids, logits = route_in_o(a, wo, x, wx, wa, k, tile, route_config=(2, 32))
        want_h = gemv(a, wo, residual=x, config=tile, preload=False)  # the same loop over K (no whole-tile preload)
        norm = (gamma, 1e-6)
        hn = rms(h, *norm)
        ref_logits = hn.double().cpu() @ gw.double().t()
        want_i = route_greedy(ref_logits.float().to(device), k, sigmoid, norm_topk, scaling)[1].cpu()
        if ties:
            order = torch.sort(ref_logits, dim=-1, descending=True, stable=True).indices[:, :k]
            assert torch.equal(want_i, order)
        tiles = dict(gate_up_config=(16, 32, 4), down_config=(16, 32, 4)) if device == "cpu" else {}
        got = experts_small(h, weights, ids, w13, w2, residual=h, norm=norm,
                            route_logits=(logits, sigmoid, norm_topk, scaling), **tiles).double().cpu()
        got_i = ids.cpu()
        if dtype == torch.float32:  # the same experts
            ids_ok = torch.equal(got_i, want_i)
        else:  # bf16: the logits round differently from the reference's (normed rows in bf16): a
            # near-tie may pick another expert, whose reference logit is then within 2 % of the k-th
            kth = ref_logits.sort(dim=-1, descending=True).values[:, k - 1]
            ids_ok = bool((ref_logits.gather(1, got_i) >= kth - 0.02 * ref_logits.abs().max()).all())
        # the reference weights of the experts chosen, from the float64 scores
        scores = ref_logits.sigmoid() if sigmoid else ref_logits.softmax(dim=-1)
        want_w = scores.gather(1, got_i)
        if norm_topk:
            want_w = want_w / want_w.sum(dim=-1, keepdim=True)
        want_w = want_w * scaling
        ref = reference(hn.cpu(), want_w.float(), got_i, w13.cpu(), w2.cpu()) + h.cpu().double()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        w_err = float((weights.cpu().double() - want_w).abs().max())
        out_err = float((got - ref).abs().max() / ref.abs().max())
        ok = (torch.equal(h.cpu(), want_h.cpu()) and ids_ok
              and w_err <= (1e-5 if dtype == torch.float32 else 1e-2) and out_err <= tol)
        out.append((f"route_in_o E={e} k={k} sigmoid={sigmoid} norm_topk={norm_topk} ties={ties}: h bitwise gemv's, "
                    f"ids, weights (err {w_err:.1e}) and the block's output", ok, out_err))
    return out


def plain_linears(model: torch.nn.Module) -> None:
    """The CPU loader's CpuLinear projections back to plain nn.Linear with [out, in] rows, so the
    fused decode forward runs its one-row GEMVs (and at batch 1 the norm-fused MoE layer) as on CUDA."""
    from torch import nn

    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            lin = getattr(layer, name, None)
            if lin is None or type(lin) is nn.Linear:
                continue
            plain = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None)
            plain.weight = nn.Parameter(lin.weight.detach().contiguous())
            if lin.bias is not None:
                plain.bias = nn.Parameter(lin.bias.detach())
            setattr(layer, name, plain)


def check_model_switch(device: str, arch: str, batches: tuple[int, ...]) -> tuple[str, bool, float]:
    """The fused decode forward of a tiny float32 model, few-token path vs grouped path: the same
    logits (1e-5) for each batch size in ``batches``: 3 (two sequences and a padding row: the
    norm in front of the MoE kernels) and 1 (the norm fused into them where there is no shared
    expert)."""
    import os
    import tempfile

    from deepinfer.runtime.attention.triton_decode import DecodeWorkspace
    from deepinfer.runtime.kernels import moe_decode
    from deepinfer.runtime.loading.model_loader import load_model
    from deepinfer.runtime.models import moe
    from deepinfer.runtime.models.llama_fused_decode import fused_decode_forward
    from tiny_moe_models import save_tiny_moe

    dev = torch.device(device)
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_moe(tmp, arch)
        model = load_model(tmp, device=dev, dtype=torch.float32).model
    plain_linears(model)
    cfg = model.config
    bs, nblk = 4, 8
    caches = [torch.randn(2, nblk, bs, cfg.num_key_value_heads, cfg.head_dim, generator=torch.Generator().manual_seed(i))
              .to(dev) for i in range(cfg.num_hidden_layers)]
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    ids, pos, lens = i32([12, 300, 0]), i32([5, 9, 0]), i32([6, 10, 1])
    slots = torch.tensor([1 * bs + 1, 3 * bs + 1, -1], device=dev)
    tables = i32([[0, 1, 2], [4, 6, 3], [0, 0, 0]])
    logits: dict[tuple[str, int], torch.Tensor] = {}
    switch_names = ("DEEPINFER_MOE_SMALL_BATCH", "DEEPINFER_MOE_ROUTER_IN_O")
    saved = {v: os.environ.get(v) for v in switch_names}
    saved_cpu = moe.KERNELS_ON_CPU
    saved_tiles = moe_decode.GATE_UP_CONFIG, moe_decode.DOWN_CONFIG, moe_decode.ROUTER_CONFIG
    moe.KERNELS_ON_CPU = True
    if device == "cpu":  # wider tiles: fewer programs for Triton's interpreter to run one by one
        moe_decode.GATE_UP_CONFIG = moe_decode.DOWN_CONFIG = moe_decode.ROUTER_CONFIG = (16, 32, 4)
    try:
        # the few-token path (at one row also with the router in the o projection's launch), then the grouped one
        variants = ("40", "41", "00")
        for variant in variants:
            os.environ.update(zip(switch_names, variant))  # "41": SMALL_BATCH 4, ROUTER_IN_O 1
            ws = DecodeWorkspace(6, cfg.num_attention_heads, cfg.head_dim, dev)
            for b in batches:
                hidden = fused_decode_forward(model, ids[:b], pos[:b], [c.clone() for c in caches], slots[:b],
                                              tables[:b], lens[:b], ws, 2)
                logits[variant, b] = model.head_logits(hidden[:2]).float().cpu()
    finally:
        moe.KERNELS_ON_CPU = saved_cpu
        moe_decode.GATE_UP_CONFIG, moe_decode.DOWN_CONFIG, moe_decode.ROUTER_CONFIG = saved_tiles
        for v, old in saved.items():
            if old is None:
                os.environ.pop(v, None)
            else:
                os.environ[v] = old
    err = max(float((logits[few, b] - logits["00", b]).abs().max()) for b in batches for few in variants[:2])
    return (f"decode forward {arch} float32 batch {batches} few-token path (router in o's launch or not) vs grouped "
            f"path", err <= 1e-5, err)


def main(device: str, dtype_name: str, part: str = "all") -> int:
    dtype = getattr(torch, dtype_name)
    rows: list[tuple[str, bool, float]] = []
    if part in ("kernels", "all"):
        rows += check_experts(device, dtype) + check_router(device, dtype) + check_route_in_o(device, dtype)
        rows += check_top_ids(device)
    if part in ("models", "all") and dtype == torch.float32:
        rows += [check_model_switch(device, "qwen3_moe", (1, 3)), check_model_switch(device, "qwen2_moe", (3,))]
    bad = 0
    for name, ok, err in rows:
        bad += not ok
        print(f"{device} {dtype_name} {name}: error {err:.2e} ({'ok' if ok else 'FAIL'})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
