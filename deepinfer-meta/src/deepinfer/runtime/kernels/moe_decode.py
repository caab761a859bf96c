"""Mixture-of-experts for decode steps of a few tokens (Triton): no sort by expert.

With T*k small (a decode step of 1..4 sequences: DEEPINFER_MOE_SMALL_BATCH) the grouped GEMMs of ``kernels.fused_moe`` pay
for an alignment pass and for row blocks mostly padding; here each (token, slot) pair reads its
expert's weights as a GEMV, three launches a layer:

1. ``route_small``: the whole router in one launch. Programs split the experts' rows of the
   float32 gate GEMV (the token rows optionally RMS-normalised in the prologue, as the one-row
   GEMV of ``kernels.gemv`` does); the last program to finish (an integer arrival counter, as
   gemv's split-K) runs the top-k of every token (``fused_moe.route_row``).
2. ``_gate_up_kernel``: grid (pair, BLOCK_N columns of I); the program reads its pair's expert id
   and both the gate and the up rows, and stores ``silu(gate) * up`` (one read of ``w13``).
3. ``_down_kernel``: grid (token, BLOCK_N columns of H); the program loops over the token's k
   slots, adds weight * (w2 @ h) in float32 in slot order, adds the residual, rounds once:
   the combine is fused and deterministic (no atomics). With its rows preloaded before the PDL
   wait (``DEEPINFER_PDL_PREFETCH=1``) it adds the slots as a tree instead, as deterministic.

At one token the router can instead run inside the o projection's launch (``route_in_o``,
``DEEPINFER_MOE_ROUTER_IN_O``): its programs compute the logits from the o projection's inputs,
and the gate/up kernel, which normalises the row anyway, stores the routing weights; two
launches after the o projection instead of three.

Same numbers as ``fused_moe.fused_experts`` up to the float32 summation order. Shapes depend on
T only and nothing syncs the host, so the decode graphs capture it. Runs on CPU under Triton's
interpreter (``TRITON_INTERPRET=1``, the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.runtime import switches
from deepinfer.runtime.kernels.fused_moe import (
    check_expert_operands,
    renormalised,
    route_row,
    route_scores,
)
from deepinfer.runtime.kernels.gemv import (
    _activation_chunk,
    _activation_math,
    _gemv_epilogue,
    _gemv_rows,
)
from deepinfer.runtime.kernels.pdl import pdl_begin, pdl_launch, prefetch_fits

# (BLOCK_N, BLOCK_K, num_warps) of the gate/up and down kernels and (BLOCK_E, BLOCK_K, num_warps)
# of the router; None: by token count and loop form (the _*_tile functions), from
# bench/moe_small_bench.py's sweeps on the H200 (one Qwen3-30B-A3B layer from a graph). The
# 2026-12-02 sweep (runtime K): one token 37.4 us against the grouped path's 55.0, two 60.5 /
# 76.3, four 98.9 / 106.4; eight lost (184 / 152 us), hence DEEPINFER_MOE_SMALL_BATCH=4. The
# 2026-12-04 sweep with the K loops unrolled: gate/up (1, 2048, 4) (one chunk a row), the router
# (1, 2048, 4) and at one token the down kernel (2, 1024, 4) took the layer from 35.7 to 29.6 us
# at one token and from 56.2 to 48.9 at two. The 2026-12-05 sweep with fewer warps a program: the
# router at one token (1, 2048, 1), 28.6 against 29.7 us for the layer.
GATE_UP_CONFIG: tuple[int, int, int] | None = None
DOWN_CONFIG: tuple[int, int, int] | None = None
ROUTER_CONFIG: tuple[int, int, int] | None = None
# Up to this many tokens, and for a kernel whose K is at most STATIC_K_MAX_K, the expert kernels
# are compiled for their K, so the loops over K unroll and a program's weight loads are all in
# flight at once. On the H200 (bench/moe_small_bench.py, 2026-12-04), same tiles: Qwen3-30B-A3B
# (K 2048 and 768) 35.6 against 37.6 us at one token and 56.2 against 60.5 at two, but 100.5
# against 98.8 at four; DeepSeek-V2-Lite (2048, 1408) 42.0 / 43.1 and 71.1 / 77.4; Mixtral-8x7B
# (4096, 14336: its down kernel unrolled 28 chunks x 2 slots) lost, 242.5 against 186.5 at one.
# (BLOCK_N, num_warps) of the down kernel where it preloads its experts' rows before waiting for
# gate/up (kernels/pdl.py): the K_PAD x TOP_K_PAD x BLOCK_N tile spread over 8 warps.
DOWN_PRELOAD_TILE = (2, 8)
STATIC_K_MAX_TOKENS = 2
STATIC_K_MAX_K = 2048


def static_k_loops(tokens: int, hidden: int, inter: int) -> tuple[bool, bool]:
    """Whether the gate/up and the down kernels of a ``tokens``-token step unroll their K loops
    (K = ``hidden`` and ``inter``): up to STATIC_K_MAX_TOKENS tokens, for a K up to STATIC_K_MAX_K."""
    few = tokens <= STATIC_K_MAX_TOKENS
    return few and hidden <= STATIC_K_MAX_K, few and inter <= STATIC_K_MAX_K


def _switch_tile(kernel: str) -> tuple[int, int, int] | None:
    # DEEPINFER_MOE_TILES="gate_up=1,2048,4;down=...;router=..." overrides tiles (benchmarks)
    tile = switches.tiles("DEEPINFER_MOE_TILES", ("gate_up", "down", "router"), (3,)).get(kernel)
    return None if tile is None else (tile[0], tile[1], tile[2])


def _gate_up_tile(static: bool) -> tuple[int, int, int]:
    return GATE_UP_CONFIG or _switch_tile("gate_up") or ((1, 2048, 4) if static else (2, 512, 4))


def _router_tile(tokens: int) -> tuple[int, int, int]:
    # one token: one warp a program (its last program's top-k rounds reduce with shuffles alone);
    # H200 2026-12-05, Qwen3-30B-A3B batch 1: 366 -> 371 output tok/s (two rounds, same call)
    return ROUTER_CONFIG or _switch_tile("router") or (
        (1, 2048, 1) if tokens == 1 else (1, 2048, 4) if tokens == 2 else (2, 1024, 4))


def _down_tile(tokens: int) -> tuple[int, int, int]:
    return DOWN_CONFIG or _switch_tile("down") or (
        (2, 1024, 4) if tokens == 1 else (4, 256, 4) if tokens == 2 else (16, 128, 8))


@triton.jit
def _router_kernel(x_ptr, nw_ptr, gw_ptr, logits_ptr, weights_ptr, ids_ptr, count_ptr, xn_ptr, tokens, hidden,
                   num_experts, stride_x, eps, scaling,
                   BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, NORM_BLOCK: tl.constexpr,
                   TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, SIGMOID: tl.constexpr,
                   NORM_TOPK: tl.constexpr, WRITE_NORMED: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    rows = (pid * BLOCK_E + tl.arange(0, BLOCK_E)).to(tl.int64)
    row_ok = rows < num_experts
    cols = tl.arange(0, BLOCK_K)
    # The first weight tile is read before waiting for the previous kernel (the router's weight
    # is constant): with PDL its loads overlap that kernel's tail, as the one-row GEMV's do.
    w_first = tl.load(gw_ptr + rows[:, None] * hidden + cols[None, :], mask=row_ok[:, None] & (cols < hidden)[None, :],
                      other=0.0).to(tl.float32)
    pdl_begin(PDL)
    for t in range(tokens):
        x_row = x_ptr + t * stride_x
        rstd = 0.0
        if NORM:
            nc = tl.arange(0, NORM_BLOCK)
            xn = tl.load(x_row + nc, mask=nc < hidden, other=0.0).to(tl.float32)
            rstd = tl.math.rsqrt(tl.sum(xn * xn, axis=0) / hidden + eps)
        xv = _activation_chunk(x_row, nw_ptr, x_ptr, cols, cols < hidden, hidden, rstd, False, NORM)
        if WRITE_NORMED:  # program 0 keeps the normed rows (rounded as add_rmsnorm) for the experts
            if pid == 0:
                tl.store(xn_ptr + t * hidden + cols, xv.to(xn_ptr.dtype.element_ty), mask=cols < hidden)
        acc = w_first * xv[None, :]
        for k0 in range(BLOCK_K, hidden, BLOCK_K):
            c = k0 + cols
            c_ok = c < hidden
            xv = _activation_chunk(x_row, nw_ptr, x_ptr, c, c_ok, hidden, rstd, False, NORM)
            if WRITE_NORMED:
                if pid == 0:
                    tl.store(xn_ptr + t * hidden + c, xv.to(xn_ptr.dtype.element_ty), mask=c_ok)
            w = tl.load(gw_ptr + rows[:, None] * hidden + c[None, :], mask=row_ok[:, None] & c_ok[None, :], other=0.0)
            acc += w.to(tl.float32) * xv[None, :]
        tl.store(logits_ptr + t * num_experts + rows, tl.sum(acc, axis=1), mask=row_ok)
    # The last program to arrive routes every token (its logits are all stored by then) and sets
    # the counter back to 0 for the next call.
    tl.debug_barrier()
    if tl.atomic_add(count_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        tl.store(count_ptr, 0)
        offs = tl.arange(0, E_PAD)
        ok = offs < num_experts
        for t in range(tokens):
            x = tl.load(logits_ptr + t * num_experts + offs, mask=ok, other=0.0, cache_modifier=".cg")
            route_row(x, offs, ok, weights_ptr + t * TOP_K, ids_ptr + t * TOP_K, scaling, TOP_K, K_PAD, E_PAD,
                      SIGMOID, NORM_TOPK)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counter(device: torch.device) -> torch.Tensor:
    """The router's zeroed arrival counter on ``device`` (each call leaves it at 0; calls on one
    stream run one after another). Made on the first call, which must not be inside a capture
    (the decode graphs warm up first)."""
    have = _COUNTERS.get(device)
    if have is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("route_small: run it once before capturing it in a CUDA graph")
        have = _COUNTERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return have


def route_small(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, sigmoid: bool, norm_topk_prob: bool,
                routed_scaling_factor: float = 1.0, norm: tuple[torch.Tensor, float] | None = None,
                config: tuple[int, int, int] | None = None,
                normed_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, ids [T, k] int64) of the rows ``x`` [T, H] for a float32 router
    ``gate_weight`` [E, H], in one launch: ``route_greedy(x.float() @ gate_weight.T, ...)``.
    ``norm`` (weight [H], eps): the rows are RMSNorm(x) * weight first (rounded to x's dtype as
    ``fused_ops.add_rmsnorm`` rounds), computed in the kernel. ``normed_out`` (with ``norm``; a
    contiguous [T, H] of x's dtype): those normed rows are also stored there, so the experts read
    them instead of normalising again in every gate/up program."""
    t, hidden = x.shape
    e = gate_weight.shape[0]
    if gate_weight.dtype != torch.float32 or tuple(gate_weight.shape) != (e, hidden) or not gate_weight.is_contiguous():
        raise ValueError(f"route_small: gate_weight must be a contiguous float32 [E, {hidden}], got "
                         f"{gate_weight.dtype} {tuple(gate_weight.shape)}")
    if not 1 <= top_k <= e:
        raise ValueError(f"route_small: top_k must be in [1, {e}], got {top_k}")
    if x.stride(-1) != 1:
        raise ValueError("route_small: x must be contiguous in its last dimension")
    if norm is not None and (tuple(norm[0].shape) != (hidden,) or not norm[0].is_contiguous()):
        raise ValueError(f"route_small: the norm weight must be a contiguous [{hidden}] vector")
    if normed_out is not None and (norm is None or tuple(normed_out.shape) != (t, hidden)
                                   or normed_out.dtype != x.dtype or not normed_out.is_contiguous()
                                   or normed_out.device != x.device):
        raise ValueError(f"route_small: normed_out needs norm and must be a contiguous {x.dtype} [{t}, {hidden}] on "
                         f"{x.device}, got {normed_out.dtype} {tuple(normed_out.shape)} on {normed_out.device}"
                         + ("" if norm is not None else " (and no norm was given)"))
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
    if t == 0:
        return weights, ids
    logits = torch.empty(t, e, dtype=torch.float32, device=x.device)
    block_e, block_k, warps = config or _router_tile(t)
    _router_kernel[(triton.cdiv(e, block_e),)](
        x, norm[0] if norm is not None else x, gate_weight, logits, weights, ids, _counter(x.device),
        normed_out if normed_out is not None else x, t, hidden, e,
        x.stride(0), norm[1] if norm is not None else 0.0, float(routed_scaling_factor),
        BLOCK_E=block_e, BLOCK_K=min(block_k, triton.next_power_of_2(hidden)), NORM=norm is not None,
        NORM_BLOCK=triton.next_power_of_2(hidden) if norm is not None else 1, TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(e), SIGMOID=sigmoid,
        NORM_TOPK=norm_topk_prob, WRITE_NORMED=normed_out is not None, num_warps=warps,
        **pdl_launch(x.device))
    return weights, ids


@triton.jit
def _route_in_o_rows(a_ptr, x_ptr, wx_ptr, wa_ptr, logits_ptr, ids_ptr, count_ptr, pid, programs, hidden, q,
                     num_experts, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, TOP_K: tl.constexpr,
                     K_PAD: tl.constexpr, E_PAD: tl.constexpr, PDL: tl.constexpr):
    """Router programs of ``_o_route_kernel``: float32 logits of BLOCK_E experts before the norm's
    1/RMS, ``wx @ x + wa @ a``; the last of ``programs`` to finish takes the top-k of them."""
    rows = (pid * BLOCK_E + tl.arange(0, BLOCK_E)).to(tl.int64)
    row_ok = rows < num_experts
    # the GEMV's row loop over each part (its first wx tile loads before the wait, as the GEMV's does)
    logits = _gemv_rows(x_ptr, wx_ptr, x_ptr, x_ptr, rows, row_ok, hidden, 0, hidden, hidden, 0.0, BLOCK_K, False,
                        False, 1, PDL)
    logits += _gemv_rows(a_ptr, wa_ptr, a_ptr, a_ptr, rows, row_ok, q, 0, q, q, 0.0, BLOCK_K, False, False, 1, False)
    tl.store(logits_ptr + rows, logits, mask=row_ok)
    tl.debug_barrier()  # every thread's logits stored before the release below
    if tl.atomic_add(count_ptr, 1, sem="acq_rel") == programs - 1:
        tl.store(count_ptr, 0)
        offs = tl.arange(0, E_PAD)
        ok = offs < num_experts
        x = tl.load(logits_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg")
        # the order of the experts' scores is the order of these logits (1/RMS > 0 scales them,
        # softmax and sigmoid keep the order): the ids are final; the gate/up kernel stores the weights
        _top_ids(x, offs, ok, ids_ptr, TOP_K, K_PAD, E_PAD)


@triton.jit
def _top_ids(x, offs, ok, ids_ptr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr):
    """The ids of the TOP_K largest of ``x`` [E_PAD] (``ok``: real experts; E_PAD <= 1024), largest
    first, ties to the lower index (as ``fused_moe.route_row``): TOP_K rounds of one max over
    integer keys, the float's bits made to order as integers times 1024 plus E_PAD - 1 - index
    (one reduction a round instead of route_row's two)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)  # -0.0 ties with +0.0, as compared
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # a negative float's magnitude bits reversed
    key = (ordered.to(tl.int64) + 2147483648) * 1024 + (E_PAD - 1 - offs)  # in [0, 2**42)
    key = tl.where(ok, key, -1)
    k_offs = tl.arange(0, K_PAD)
    top = tl.zeros([K_PAD], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(key, axis=0)
        top = tl.where(k_offs == j, E_PAD - 1 - best % 1024, top)
        key = tl.where(key == best, -1, key)
    tl.store(ids_ptr + k_offs, top, mask=k_offs < TOP_K)


@triton.jit
def _o_route_kernel(a_ptr, wo_ptr, x_ptr, out_ptr, wx_ptr, wa_ptr, logits_ptr, ids_ptr, count_ptr, hidden, q,
                    num_experts, stride_wo, route_programs,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, ROUTE_BLOCK_K: tl.constexpr,
                    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, PDL: tl.constexpr):
    # The router's programs first (they are scheduled first, so their top-k tail runs while the
    # o programs still stream), then the o projection's, as gemv's with the residual add.
    pid = tl.program_id(0)
    if pid < route_programs:
        _route_in_o_rows(a_ptr, x_ptr, wx_ptr, wa_ptr, logits_ptr, ids_ptr, count_ptr, pid, route_programs, hidden,
                         q, num_experts, BLOCK_E, ROUTE_BLOCK_K, TOP_K, K_PAD, E_PAD, PDL)
    else:
        opid = pid - route_programs
        rows = (opid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        row_ok = rows < hidden
        y = _gemv_rows(a_ptr, wo_ptr, a_ptr, out_ptr, rows, row_ok, q, 0, q, stride_wo, 0.0, BLOCK_K, False, False, 1,
                       PDL)
        _gemv_epilogue(y, rows, row_ok, opid, hidden, a_ptr, x_ptr, out_ptr, out_ptr, out_ptr, False, True, False)


def route_in_o(a: torch.Tensor, o_weight: torch.Tensor, x: torch.Tensor, wx: torch.Tensor, wa: torch.Tensor,
               top_k: int, o_config: tuple[int, ...], route_config: tuple[int, int] = (1, 2048)
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The o projection and its residual add, ``h = x + a @ o_weight.T`` ([1, H], x's dtype, bitwise
    ``gemv(a, o_weight, residual=x, config=o_config)``), and in the same launch the router of the
    MoE block after it: (h, weights [1, k] float32, ids [1, k] int64, logits [1, E] float32), where
    ``weights`` is only allocated here: ``experts_small(..., route_logits=)`` writes it.

    The router reads RMSNorm(h) * g, which needs all of h. Its logits are ``rstd(h) * (W_r g) @ h``
    and ``(W_r g) @ h = wx @ x + wa @ a`` with ``wx = W_r diag(g)`` [E, H] and ``wa = wx @ W_o``
    [E, Q] (float32, made once at load: ``SparseMoe``), so programs beside the o projection's
    compute ``logits`` (without the factor rstd) from the o projection's inputs, and the last of
    them the ids of the top-k (the factor keeps their order). ``experts_small(...,
    route_logits=logits)`` computes the weights once h is known. ``o_config``: the GEMV tile
    (BLOCK_N, BLOCK_K, num_warps, num_stages); ``route_config``: (BLOCK_E, BLOCK_K) of the router."""
    if a.dim() != 2 or a.shape[0] != 1 or a.stride(1) != 1:
        raise ValueError(f"route_in_o: a must be one contiguous row [1, Q], got shape {tuple(a.shape)}")
    q = a.shape[1]
    if o_weight.dim() != 2 or o_weight.shape[1] != q or o_weight.stride(1) != 1 or o_weight.dtype != a.dtype:
        raise ValueError(f"route_in_o: o_weight must be [H, {q}] of {a.dtype} with contiguous rows, got "
                         f"{o_weight.dtype} {tuple(o_weight.shape)}")
    hidden = o_weight.shape[0]
    if tuple(x.shape) != (1, hidden) or x.stride(1) != 1 or x.dtype != a.dtype:
        raise ValueError(f"route_in_o: x (the residual) must be one contiguous {a.dtype} row [1, {hidden}], got "
                         f"{x.dtype} {tuple(x.shape)}")
    e = wx.shape[0]
    for name, w, k in (("wx", wx, hidden), ("wa", wa, q)):
        if w.dtype != torch.float32 or tuple(w.shape) != (e, k) or not w.is_contiguous():
            raise ValueError(f"route_in_o: {name} must be a contiguous float32 [{e}, {k}], got {w.dtype} "
                             f"{tuple(w.shape)}")
    if not 1 <= top_k <= e or e > 1024:
        raise ValueError(f"route_in_o: top_k must be in [1, {e}] and there at most 1024 experts, got top_k {top_k} "
                         f"of {e}")
    if len(o_config) not in (4, 5) or o_config[4:] not in ((), (1,)):
        raise ValueError(f"route_in_o: o_config must be (BLOCK_N, BLOCK_K, num_warps, num_stages) (no split-K), got "
                         f"{o_config!r}")
    block_n, block_k, warps, stages = o_config[:4]
    block_e, route_k = route_config
    h = torch.empty(1, hidden, dtype=a.dtype, device=a.device)
    weights = torch.empty(1, top_k, dtype=torch.float32, device=a.device)
    ids = torch.empty(1, top_k, dtype=torch.int64, device=a.device)
    logits = torch.empty(1, e, dtype=torch.float32, device=a.device)
    route_programs = triton.cdiv(e, block_e)
    _o_route_kernel[(route_programs + triton.cdiv(hidden, block_n),)](
        a, o_weight, x, h, wx, wa, logits, ids, _counter(a.device), hidden, q, e, o_weight.stride(0), route_programs,
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_E=block_e,
        ROUTE_BLOCK_K=min(route_k, triton.next_power_of_2(max(hidden, q))), TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(e), num_warps=warps, num_stages=stages,
        **pdl_launch(a.device))
    return h, weights, ids, logits


@triton.jit
def _weights_from_logits(logits_ptr, ids_ptr, weights_ptr, rstd, num_experts, scaling, TOP_K: tl.constexpr,
                         K_PAD: tl.constexpr, E_PAD: tl.constexpr, SIGMOID: tl.constexpr, NORM_TOPK: tl.constexpr):
    """One token's routing weights for its chosen ``ids`` from logits without the norm's factor
    ``rstd`` (``route_in_o``), as ``fused_moe.route_row`` computes them from the full logits."""
    offs = tl.arange(0, E_PAD)
    ok = offs < num_experts
    scores = route_scores(tl.load(logits_ptr + offs, mask=ok, other=0.0) * rstd, ok, SIGMOID)
    k_offs = tl.arange(0, K_PAD)
    k_ok = k_offs < TOP_K
    ids = tl.load(ids_ptr + k_offs, mask=k_ok, other=-1)
    w = tl.sum(tl.where(offs[None, :] == ids[:, None], scores[None, :], 0.0), axis=1)
    if NORM_TOPK:
        w = renormalised(w, SIGMOID)
    tl.store(weights_ptr + k_offs, w * scaling, mask=k_ok)


@triton.jit
def _gate_up_chunk(acc_g, acc_u, x_row, nw_ptr, x_ptr, w_gate, w_up, c, row_ok, hidden, rstd, NORM: tl.constexpr):
    c_ok = c < hidden
    xv = _activation_chunk(x_row, nw_ptr, x_ptr, c, c_ok, hidden, rstd, False, NORM)[None, :]
    m = row_ok[:, None] & c_ok[None, :]
    acc_g += tl.load(w_gate + c[None, :], mask=m, other=0.0).to(tl.float32) * xv
    acc_u += tl.load(w_up + c[None, :], mask=m, other=0.0).to(tl.float32) * xv
    return acc_g, acc_u


@triton.jit
def _gate_up_kernel(x_ptr, nw_ptr, w13_ptr, ids_ptr, h_ptr, logits_ptr, weights_ptr, hidden, inter, stride_x,
                    stride_we, stride_wn, eps, num_experts, scaling,
                    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
                    NORM_BLOCK: tl.constexpr, STATIC_K: tl.constexpr, PDL: tl.constexpr, WEIGHTS: tl.constexpr = False,
                    K_PAD: tl.constexpr = 1, E_PAD: tl.constexpr = 1, SIGMOID: tl.constexpr = False,
                    NORM_TOPK: tl.constexpr = False, ONE_CHUNK: tl.constexpr = False):
    pair = tl.program_id(0).to(tl.int64)
    rows = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < inter
    cols = tl.arange(0, BLOCK_K)
    pdl_begin(PDL)  # the expert ids come from the router, the kernel before
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // TOP_K) * stride_x
    rstd = 0.0
    if NORM:
        nc = tl.arange(0, NORM_BLOCK)
        xn = tl.load(x_row + nc, mask=nc < hidden, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xn * xn, axis=0) / hidden + eps)
        if WEIGHTS:  # route_in_o's logits: the first program of each token stores its routing weights
            if pair % TOP_K == 0 and tl.program_id(1) == 0:
                _weights_from_logits(logits_ptr + (pair // TOP_K) * num_experts, ids_ptr + pair, weights_ptr + pair,
                                     rstd, num_experts, scaling, TOP_K, K_PAD, E_PAD, SIGMOID, NORM_TOPK)
    w_gate = w13_ptr + expert * stride_we + rows[:, None] * stride_wn
    w_up = w_gate + inter * stride_wn
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if ONE_CHUNK:  # NORM, K in one chunk of NORM_BLOCK: the row loaded for the norm is the chunk (no second load)
        c_ok = cols < hidden
        nw = tl.load(nw_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)
        xv = _activation_math(xn, xn, nw, rstd, x_ptr.dtype.element_ty, False, True)[None, :]
        m = row_ok[:, None] & c_ok[None, :]
        acc_g += tl.load(w_gate + cols[None, :], mask=m, other=0.0).to(tl.float32) * xv
        acc_u += tl.load(w_up + cols[None, :], mask=m, other=0.0).to(tl.float32) * xv
    elif STATIC_K:  # K (= hidden) known at compile time: the chunks unroll, every load issued at once
        for k0 in tl.static_range(0, STATIC_K, BLOCK_K):
            acc_g, acc_u = _gate_up_chunk(acc_g, acc_u, x_row, nw_ptr, x_ptr, w_gate, w_up, k0 + cols, row_ok, hidden,
                                          rstd, NORM)
    else:
        for k0 in range(0, hidden, BLOCK_K):
            acc_g, acc_u = _gate_up_chunk(acc_g, acc_u, x_row, nw_ptr, x_ptr, w_gate, w_up, k0 + cols, row_ok, hidden,
                                          rstd, NORM)
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    h = g / (1.0 + tl.exp(-g)) * u  # silu(gate) * up in float32, rounded once as fused_experts does
    tl.store(h_ptr + pair * inter + rows, h.to(h_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _down_chunk(acc, h_ptr, w_rows, pair, c, row_ok, inter, gate):
    """``acc`` plus the expert rows' products with columns ``c`` of slot ``pair``'s activations, those
    scaled by ``gate`` (1.0: unscaled, the multiplication folded away)."""
    c_ok = c < inter
    a = tl.load(h_ptr + pair * inter + c, mask=c_ok, other=0.0).to(tl.float32) * gate
    return acc + tl.load(w_rows + c[None, :], mask=row_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32) \
        * a[None, :]


@triton.jit
def _down_one_sum(h_ptr, w2_ptr, ids_ptr, weights_ptr, t, rows, row_ok, inter, stride_we, stride_wn,
                  TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STATIC_K: tl.constexpr):
    """The rows' sums over every slot at once: each slot's routing weight scales its activations, and
    one accumulator takes every slot's products, reduced once (DEEPINFER_MOE_DOWN_ONE_SUM). No slot's
    loads wait for the previous slot's reduction and its barriers."""
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = t * TOP_K + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        gate = tl.load(weights_ptr + pair).to(tl.float32)
        w_rows = w2_ptr + expert * stride_we + rows[:, None] * stride_wn
        if STATIC_K:
            for k0 in tl.static_range(0, STATIC_K, BLOCK_K):
                acc = _down_chunk(acc, h_ptr, w_rows, pair, k0 + cols, row_ok, inter, gate)
        else:
            for k0 in range(0, inter, BLOCK_K):
                acc = _down_chunk(acc, h_ptr, w_rows, pair, k0 + cols, row_ok, inter, gate)
    return tl.sum(acc, axis=1)


@triton.jit
def _down_kernel(h_ptr, w2_ptr, ids_ptr, weights_ptr, res_ptr, out_ptr, hidden, inter, stride_we, stride_wn,
                 stride_res, stride_out, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 RESIDUAL: tl.constexpr, STATIC_K: tl.constexpr, PDL: tl.constexpr, PRELOAD_K: tl.constexpr = 0,
                 TOP_K_PAD: tl.constexpr = 1, ONE_SUM: tl.constexpr = False):
    t = tl.program_id(0).to(tl.int64)
    rows = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < hidden
    if PRELOAD_K:
        # The ids and weights come from the router, two launches back (finished by now, pdl.py):
        # every slot's expert rows [TOP_K_PAD, BLOCK_N, PRELOAD_K] load while gate/up still runs.
        s = tl.arange(0, TOP_K_PAD)
        s_ok = s < TOP_K
        pairs = t * TOP_K + s
        experts = tl.load(ids_ptr + pairs, mask=s_ok, other=0, cache_modifier=".cg").to(tl.int64)
        gates = tl.load(weights_ptr + pairs, mask=s_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        c = tl.arange(0, PRELOAD_K)
        c_ok = c < inter
        w = tl.load(w2_ptr + experts[:, None, None] * stride_we + rows[None, :, None] * stride_wn + c[None, None, :],
                    mask=s_ok[:, None, None] & row_ok[None, :, None] & c_ok[None, None, :], other=0.0)
        pdl_begin(PDL)
        hv = tl.load(h_ptr + pairs[:, None] * inter + c[None, :], mask=s_ok[:, None] & c_ok[None, :], other=0.0)
        per_slot = tl.sum(w.to(tl.float32) * hv.to(tl.float32)[:, None, :], axis=2)  # [TOP_K_PAD, BLOCK_N]
        total = tl.sum(gates[:, None] * per_slot, axis=0)
    elif ONE_SUM:
        pdl_begin(PDL)
        total = _down_one_sum(h_ptr, w2_ptr, ids_ptr, weights_ptr, t, rows, row_ok, inter, stride_we, stride_wn,
                              TOP_K, BLOCK_N, BLOCK_K, STATIC_K)
    else:
        cols = tl.arange(0, BLOCK_K)
        pdl_begin(PDL)
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(TOP_K):  # the token's slots in order: a fixed summation order
            pair = t * TOP_K + j
            expert = tl.load(ids_ptr + pair).to(tl.int64)
            w_rows = w2_ptr + expert * stride_we + rows[:, None] * stride_wn
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            if STATIC_K:  # K (= inter) known at compile time: with the slots' loop, the whole read unrolls
                for k0 in tl.static_range(0, STATIC_K, BLOCK_K):
                    acc = _down_chunk(acc, h_ptr, w_rows, pair, k0 + cols, row_ok, inter, 1.0)
            else:
                for k0 in range(0, inter, BLOCK_K):
                    acc = _down_chunk(acc, h_ptr, w_rows, pair, k0 + cols, row_ok, inter, 1.0)
            total += tl.load(weights_ptr + pair).to(tl.float32) * tl.sum(acc, axis=1)
    if RESIDUAL:
        total += tl.load(res_ptr + t * stride_res + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_out + rows, total.to(out_ptr.dtype.element_ty), mask=row_ok)


def experts_small(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  residual: torch.Tensor | None = None, norm: tuple[torch.Tensor, float] | None = None,
                  gate_up_config: tuple[int, int, int] | None = None,
                  down_config: tuple[int, int, int] | None = None, static_k: bool | None = None,
                  preload: bool | None = None,
                  route_logits: tuple[torch.Tensor, bool, bool, float] | None = None,
                  one_sum: bool | None = None) -> torch.Tensor:
    """``fused_experts(x, weights, ids, w13, w2, residual=residual)`` for a few tokens, without the
    sort by expert: [T, H] in ``x.dtype``. ``norm`` (weight [H], eps): the experts' input is
    RMSNorm(x) * weight (as ``route_small``'s ``norm``), computed inside the gate/up kernel.
    ``gate_up_config`` / ``down_config``: (BLOCK_N, BLOCK_K, num_warps), default the module's.
    ``weights`` [T, k] float32, ``ids`` [T, k] integer, both contiguous. ``static_k``: compile both
    kernels for their K (hidden, inter) so their loops over K unroll (default: up to
    ``STATIC_K_MAX_TOKENS`` tokens, each kernel whose K is at most ``STATIC_K_MAX_K``; one compile
    per model shape). ``preload``: the down kernel loads every slot's expert rows before waiting
    for the gate/up kernel, in the tile DOWN_PRELOAD_TILE unless a down tile is given
    (``down_config`` or DOWN_CONFIG); default: where they fit and no down tile is given
    (``kernels/pdl.py``). It then adds the slots as a tree (``tl.sum``), deterministic but not
    the slot order of the other form: the last bits can differ between the two.
    ``route_logits`` (logits [T, E] float32, sigmoid, norm_topk_prob, routed_scaling_factor), with
    ``norm``: ``route_in_o``'s logits before the norm's factor; the gate/up kernel, which computes
    that factor, stores the routing ``weights`` of the chosen ``ids`` from them (``weights`` is
    written, not read, until the down kernel).
    ``one_sum`` (default ``DEEPINFER_MOE_DOWN_ONE_SUM``; not with ``preload``): the down kernel scales
    each slot's activations by its routing weight and reduces every slot's products once, instead of
    one reduction a slot (the last bits can differ from the slot-by-slot sum)."""
    t, hidden, k, _, inter = check_expert_operands("experts_small", x, weights, ids, w13, w2)
    if x.stride(-1) != 1:
        raise ValueError("experts_small: x must be contiguous in its last dimension")
    if weights.dtype != torch.float32 or not weights.is_contiguous() or not ids.is_contiguous():
        raise ValueError("experts_small: weights must be contiguous float32 and ids contiguous")
    if residual is not None and (tuple(residual.shape) != (t, hidden) or residual.stride(-1) != 1):
        raise ValueError(f"experts_small: residual must be [{t}, {hidden}] with contiguous rows, "
                         f"got {tuple(residual.shape)}")
    if norm is not None and (tuple(norm[0].shape) != (hidden,) or not norm[0].is_contiguous()):
        raise ValueError(f"experts_small: the norm weight must be a contiguous [{hidden}] vector")
    if route_logits is not None and (norm is None or route_logits[0].dtype != torch.float32
                                     or route_logits[0].dim() != 2 or route_logits[0].shape[0] != t
                                     or not route_logits[0].is_contiguous()):
        raise ValueError(f"experts_small: route_logits needs norm and contiguous float32 logits [{t}, E], got "
                         f"{route_logits[0].dtype} {tuple(route_logits[0].shape)}"
                         + ("" if norm is not None else " (and no norm was given)"))
    if route_logits is not None and preload:
        raise ValueError("experts_small: preload=True reads the weights before the wait; with route_logits the "
                         "gate/up kernel just before writes them")
    if preload and one_sum:
        raise ValueError("experts_small: one_sum=True is a form of the down kernel that does not preload its rows; "
                         "pass preload=False (or leave it to the default) with one_sum=True")
    out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    pdl = pdl_launch(x.device)
    logits, sigmoid, norm_topk, scaling = route_logits if route_logits is not None else (weights, False, False, 1.0)
    num_experts = logits.shape[1]
    static_gate_up, static_down = static_k_loops(t, hidden, inter) if static_k is None else (static_k, static_k)
    h = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)
    bn, bk, warps = gate_up_config or _gate_up_tile(static_gate_up)
    _gate_up_kernel[(t * k, triton.cdiv(inter, bn))](
        x, norm[0] if norm is not None else x, w13, ids, h, logits, weights, hidden, inter, x.stride(0), w13.stride(0),
        w13.stride(1), norm[1] if norm is not None else 0.0, num_experts, float(scaling), TOP_K=k, BLOCK_N=bn,
        BLOCK_K=min(bk, triton.next_power_of_2(hidden)), NORM=norm is not None,
        NORM_BLOCK=triton.next_power_of_2(hidden) if norm is not None else 1, STATIC_K=hidden if static_gate_up else 0,
        WEIGHTS=route_logits is not None, K_PAD=triton.next_power_of_2(k), E_PAD=triton.next_power_of_2(num_experts),
        SIGMOID=sigmoid, NORM_TOPK=norm_topk, ONE_CHUNK=norm is not None and min(bk, triton.next_power_of_2(hidden))
        == triton.next_power_of_2(hidden), num_warps=warps, **pdl)
    asked = down_config or DOWN_CONFIG or _switch_tile("down")  # a tile asked for: kept as given
    bn, bk, warps = asked or _down_tile(t)
    inter_pad = triton.next_power_of_2(inter)
    tiled = asked is not None
    if route_logits is not None:  # the weights come from gate/up, the kernel just before: read after the wait
        preload = False
    if preload is None:
        preload = not tiled and prefetch_fits(
            triton.next_power_of_2(k) * DOWN_PRELOAD_TILE[0] * inter_pad * w2.element_size(), DOWN_PRELOAD_TILE[1])
    if preload and not tiled:
        bn, warps = DOWN_PRELOAD_TILE
    res = residual if residual is not None else out
    _down_kernel[(t, triton.cdiv(hidden, bn))](
        h, w2, ids, weights, res, out, hidden, inter, w2.stride(0), w2.stride(1), res.stride(0), out.stride(0),
        TOP_K=k, BLOCK_N=bn, BLOCK_K=min(bk, triton.next_power_of_2(inter)), RESIDUAL=residual is not None,
        STATIC_K=inter if static_down else 0, num_warps=warps, PRELOAD_K=inter_pad if preload else 0,
        TOP_K_PAD=triton.next_power_of_2(k), ONE_SUM=not preload and (
            switches.enabled("DEEPINFER_MOE_DOWN_ONE_SUM") if one_sum is None else one_sum), **pdl)
    return out
