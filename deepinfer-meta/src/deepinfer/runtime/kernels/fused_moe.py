"""Fused mixture-of-experts on the GPU (Triton): token sort by expert, grouped GEMMs with SiLU·mul
fused, weighted combine.

``fused_experts(x, weights, ids, w13, w2)`` computes, for every token t, ``sum_j weights[t, j] *
expert_{ids[t, j]}(x[t])`` with SwiGLU experts ``w13`` [E, 2I, H] (gate rows, then up rows) and
``w2`` [E, H, I]:

1. ``align_by_expert_triton`` (one Triton program; ``align_by_expert`` in torch for many pairs;
   no host synchronisation, fixed output sizes): the T*k (token, slot) pairs sorted by expert, each expert's run padded to a multiple of ``BLOCK_M`` with the
   sentinel T*k, and the expert of every BLOCK_M block (-1 for blocks past the end).
2. ``_gate_up_kernel``: one program per (block of BLOCK_M pairs, BLOCK_N columns of I) loads the
   pairs' token rows and the expert's gate and up rows, accumulates both products in float32 and
   stores ``silu(gate) * up`` for each pair (the [T*k, I] intermediate, never the [T*k, 2I] one).
3. ``_down_kernel``: the intermediate rows times the expert's ``w2``, scaled by the pair's routing
   weight, stored per pair; the k rows of a token are then summed (``combine``).

Blocks of an expert with no tokens do not exist; padding rows are masked. Runs on CUDA, and on
CPU under Triton's interpreter (``TRITON_INTERPRET=1``, the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _padded_size(n: int, num_experts: int, block_m: int) -> int:
    return triton.cdiv(n + num_experts * (block_m - 1), block_m) * block_m


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [P] int32, block_expert [P // block_m] int32) for ``ids`` [T, k], in torch.

    ``P = T*k + E*(block_m - 1)`` rounded up to a multiple of block_m: an upper bound of the padded
    length that depends only on the shapes (graph-capturable). ``sorted_pairs`` holds pair indices
    (t*k + j) grouped by expert (in pair order within an expert), each group padded with T*k;
    ``block_expert`` the expert of each block, -1 past the last group. ``align_by_expert_triton``
    computes the same in one kernel."""
    flat = ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    size = _padded_size(n, num_experts, block_m)
    # a scatter-add, not bincount: CUDA's bincount reads the largest id on the host (a sync)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts  # where each expert's run starts in `order`
    rank = torch.arange(n, device=ids.device) - first_of_expert[sorted_experts]
    sorted_pairs = torch.full((size,), n, dtype=torch.int32, device=ids.device)
    sorted_pairs[starts[sorted_experts] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, size, block_m, device=ids.device)
    block_expert = torch.searchsorted(ends, block_starts, right=True).to(torch.int32)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


@triton.jit
def _align_kernel(ids_ptr, pairs_ptr, block_expert_ptr, cursor_ptr, n, num_experts, size,
                  BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr, FILL: tl.constexpr):
    # One program: (1) per-expert counts, (2) padded run starts by a prefix sum, the sentinel
    # fill and each block's expert, (3) every pair scattered to its expert's run at its rank
    # (the pairs of the same expert before it: earlier chunks through `cursor`, this chunk by
    # an all-pairs comparison), so pairs keep their order within an expert, as a stable sort.
    e_offs = tl.arange(0, E_PAD)
    e_ok = e_offs < num_experts
    lane = tl.arange(0, CHUNK)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, n, CHUNK):
        ex = tl.load(ids_ptr + c0 + lane, mask=c0 + lane < n, other=-1).to(tl.int32)
        counts += tl.sum((ex[:, None] == e_offs[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    cursor = ends - padded
    tl.store(cursor_ptr + e_offs, cursor, mask=e_ok)
    ends = tl.where(e_ok, ends, 2147483647)
    fill = tl.arange(0, FILL)
    for p0 in range(0, size, FILL):
        tl.store(pairs_ptr + p0 + fill, tl.full([FILL], 0, tl.int32) + n, mask=p0 + fill < size)
    for b0 in range(0, size // BLOCK_M, FILL):
        start = (b0 + fill) * BLOCK_M
        expert = tl.sum((ends[None, :] <= start[:, None]).to(tl.int32), axis=1)  # searchsorted(right)
        expert = tl.where(expert < num_experts, expert, -1)
        tl.store(block_expert_ptr + b0 + fill, expert, mask=b0 + fill < size // BLOCK_M)
    tl.debug_barrier()  # the sentinel fill and the cursors land before the scatter
    for c0 in range(0, n, CHUNK):
        ok = c0 + lane < n
        ex = tl.load(ids_ptr + c0 + lane, mask=ok, other=-1).to(tl.int32)
        earlier = (ex[:, None] == ex[None, :]) & (lane[None, :] < lane[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        base = tl.load(cursor_ptr + ex, mask=ok, other=0)
        tl.store(pairs_ptr + base + rank, (c0 + lane).to(tl.int32), mask=ok)
        cursor += tl.sum((ex[:, None] == e_offs[None, :]).to(tl.int32), axis=0)
        tl.debug_barrier()  # every load of this chunk's cursors before they move
        tl.store(cursor_ptr + e_offs, cursor, mask=e_ok)
        tl.debug_barrier()


def align_by_expert_triton(ids: torch.Tensor, num_experts: int, block_m: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``align_by_expert`` in one Triton launch (the torch version is about a dozen): the same
    outputs, bit for bit. One program walks the pairs in chunks, which suits decode steps
    (T*k up to a few thousand); ``fused_experts`` takes the torch version for more pairs."""
    flat = ids.reshape(-1)
    if flat.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"align_by_expert_triton: expert ids must be int32 or int64, got {flat.dtype}")
    flat = flat.contiguous()
    n = flat.numel()
    size = _padded_size(n, num_experts, block_m)
    pairs = torch.empty(size, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(size // block_m, dtype=torch.int32, device=ids.device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    e_pad = triton.next_power_of_2(num_experts)
    chunk = max(16, min(128, 16384 // e_pad))
    _align_kernel[(1,)](flat, pairs, block_expert, cursor, n, num_experts, size,
                        BLOCK_M=block_m, CHUNK=chunk, E_PAD=e_pad, FILL=256, num_warps=4)
    return pairs, block_expert


# Pairs up to which fused_experts aligns with the one-program kernel (decode steps); above, torch.
TRITON_ALIGN_MAX_PAIRS = 4096
# Pairs up to which fused_experts takes the decode tiles (BLOCK_N 32, BLOCK_K 128).
SMALL_STEP_PAIRS = 64


@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, h_ptr, pairs_ptr, block_expert_ptr, num_pairs, top_k, hidden, inter,
                    stride_xt, stride_we, stride_wn, stride_ht,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m).to(tl.int64)
    valid = pairs < num_pairs
    tokens = pairs // top_k
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w13_ptr + expert * stride_we
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < hidden
        a = tl.load(x_ptr + tokens[:, None] * stride_xt + offs_k[None, :], mask=valid[:, None] & k_ok[None, :],
                    other=0.0)
        wg = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=n_ok[None, :] & k_ok[:, None],
                     other=0.0)
        wu = tl.load(w_base + (offs_n[None, :] + inter) * stride_wn + offs_k[:, None],
                     mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if IEEE:  # float32 weights: full-precision products (not TF32)
            acc_g += tl.dot(a, wg, input_precision="ieee")
            acc_u += tl.dot(a, wu, input_precision="ieee")
        else:
            acc_g += tl.dot(a, wg)
            acc_u += tl.dot(a, wu)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) * up, in float32
    tl.store(h_ptr + pairs[:, None] * stride_ht + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, w2_ptr, y_ptr, weights_ptr, pairs_ptr, block_expert_ptr, num_pairs, hidden, inter,
                 stride_ht, stride_we, stride_wn, stride_yt,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m).to(tl.int64)
    valid = pairs < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w2_ptr + expert * stride_we
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < inter
        a = tl.load(h_ptr + pairs[:, None] * stride_ht + offs_k[None, :], mask=valid[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=n_ok[None, :] & k_ok[:, None],
                    other=0.0)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    wt = tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    acc = acc * wt[:, None]
    tl.store(y_ptr + pairs[:, None] * stride_yt + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _combine_kernel(y_ptr, res_ptr, out_ptr, hidden, stride_res, stride_out,
                    TOP_K: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    # out[t] = (residual[t] +) sum_j y[t*k + j], summed in float32, rounded once
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + j) * hidden + offs, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        acc += tl.load(res_ptr + t * stride_res + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def check_expert_operands(name: str, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                          w13: torch.Tensor, w2: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(T, H, k, E, I) of an experts call's operands (``fused_experts``, ``moe_decode.experts_small``):
    ValueError, named ``name``, unless their shapes agree, they share a device and the expert
    weights are contiguous in their last dimension."""
    t, hidden = x.shape
    k = ids.shape[1]
    e, two_i, h2 = w13.shape
    inter = two_i // 2
    if h2 != hidden or tuple(w2.shape) != (e, hidden, inter) or weights.shape != ids.shape or ids.shape[0] != t:
        raise ValueError(f"{name}: shapes disagree: x {tuple(x.shape)}, weights {tuple(weights.shape)}, "
                         f"ids {tuple(ids.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if not (x.device == w13.device == w2.device == ids.device == weights.device):
        raise ValueError(f"{name}: every tensor must be on one device")
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError(f"{name}: w13 and w2 must be contiguous in their last dimension")
    return t, hidden, k, e, inter


def fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  block_m: int = 16, block_n: int | None = None, block_k: int | None = None,
                  residual: torch.Tensor | None = None, num_warps: int = 4, num_stages: int | None = None
                  ) -> torch.Tensor:
    """Weighted sum over each token's routed SwiGLU experts, [T, H] in ``x.dtype``.

    ``x`` [T, H], ``weights`` [T, k] (any float dtype), ``ids`` [T, k] integer expert indices,
    ``w13`` [E, 2I, H], ``w2`` [E, H, I], all on one device, weights contiguous in their last dim.
    ``residual`` [T, H]: returned ``residual + sum`` instead, added in the combine kernel in
    float32 (the decode graphs' residual stream: one rounding, no separate add). ``num_warps`` and
    ``num_stages`` (Triton's default when None) apply to both grouped GEMMs (the tile sweep of
    ``bench/moe_layer_bench.py``)."""
    t, hidden, k, e, inter = check_expert_operands("fused_experts", x, weights, ids, w13, w2)
    launch = {"num_warps": num_warps} | ({} if num_stages is None else {"num_stages": num_stages})
    if block_n is None or block_k is None:
        # H200, Qwen3-30B-A3B layer from a graph (bench/moe_layer_bench.py): one token's 8 pairs
        # 37.6 us with (32, 128) against 43.1 us with (64, 64); 64 tokens alike (314 / 317 us)
        small = t * k <= SMALL_STEP_PAIRS
        block_n = block_n or (32 if small else 64)
        block_k = block_k or (128 if small else 64)
    x = x.contiguous()
    align = align_by_expert_triton if t * k <= TRITON_ALIGN_MAX_PAIRS else align_by_expert
    pairs, block_expert = align(ids, e, block_m)
    num_pairs = t * k
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)  # summed in float32
    flat_w = weights.reshape(-1).float().contiguous()
    # Experts' runs are packed from the start, each ceil(count / block_m) blocks, so at most
    # cdiv(T*k, block_m) + min(T*k, E) blocks hold pairs: the rest (-1) get no program (a
    # decode step of 8 pairs over 128 experts launches 9 row blocks, not 129).
    blocks = min(block_expert.numel(), triton.cdiv(num_pairs, block_m) + min(num_pairs, e))
    ieee = x.dtype == torch.float32  # float32 models get float32 products; bf16/fp16 use tensor cores
    _gate_up_kernel[(blocks, triton.cdiv(inter, block_n))](
        x, w13, h, pairs, block_expert, num_pairs, k, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee, **launch)
    _down_kernel[(blocks, triton.cdiv(hidden, block_n))](
        h, w2, y, flat_w, pairs, block_expert, num_pairs, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee, **launch)
    # combine: each token's k weighted expert rows (+ the residual), one launch
    out = torch.empty_like(x)
    if residual is not None and (tuple(residual.shape) != (t, hidden) or residual.stride(-1) != 1):
        raise ValueError(f"fused_experts: residual must be [{t}, {hidden}] with contiguous rows, "
                         f"got {tuple(residual.shape)}")
    if t:
        block = min(1024, triton.next_power_of_2(hidden))
        res = residual if residual is not None else out
        _combine_kernel[(t, triton.cdiv(hidden, block))](y, res, out, hidden, res.stride(0), out.stride(0),
                                                         TOP_K=k, BLOCK=block, HAS_RESIDUAL=residual is not None)
    return out


@triton.jit
def route_scores(x, ok, SIGMOID: tl.constexpr):
    """Each expert's score from float32 logits ``x`` (``ok``: real experts, the others score 0):
    softmax over the experts, or DeepSeek-V3's per-expert sigmoid."""
    x = tl.where(ok, x, -float("inf"))
    if SIGMOID:
        return 1.0 / (1.0 + tl.exp(-x))
    e = tl.exp(x - tl.max(x, axis=0))
    return e / tl.sum(e, axis=0)


@triton.jit
def renormalised(w, SIGMOID: tl.constexpr):
    """The chosen experts' weights ``w`` divided by their sum (norm_topk_prob; sigmoid scores add
    1e-20 to it, as DeepSeek-V3 does)."""
    total = tl.sum(w, axis=0)
    if SIGMOID:
        total += 1e-20
    return w / total


@triton.jit
def route_row(x, offs, ok, weights_ptr, ids_ptr, scaling, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
              E_PAD: tl.constexpr, SIGMOID: tl.constexpr, NORM: tl.constexpr):
    """One token's routing from its float32 logits ``x`` [E_PAD] (``ok``: real experts): scores,
    top-k (ties: the lower expert index first, as a stable sort orders them; torch.topk on the CPU
    leaves tied indices unordered), renormalisation and scaling, stored at ``weights_ptr`` /
    ``ids_ptr`` [TOP_K]. The top-k is TOP_K rounds of argmax (a top-k by ranks, one [E_PAD, E_PAD]
    comparison instead of the serial rounds, was slower on the H200 for 128 experts: the
    few-token router 6.2 against 5.7 us at one token, 12.3 against 8.9 at two)."""
    scores = tl.where(ok, route_scores(x, ok, SIGMOID), -1.0)  # below every real score (softmax and sigmoid are >= 0)
    k_offs = tl.arange(0, K_PAD)
    top_w = tl.zeros([K_PAD], dtype=tl.float32)
    top_i = tl.zeros([K_PAD], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        w = tl.max(scores, axis=0)
        best = tl.min(tl.where(scores == w, offs, E_PAD), axis=0)  # the lowest index of the maximum
        top_w = tl.where(k_offs == j, w, top_w)
        top_i = tl.where(k_offs == j, best.to(tl.int64), top_i)
        scores = tl.where(offs == best, -2.0, scores)
    if NORM:
        top_w = renormalised(top_w, SIGMOID)
    top_w = top_w * scaling
    k_ok = k_offs < TOP_K
    tl.store(weights_ptr + k_offs, top_w, mask=k_ok)
    tl.store(ids_ptr + k_offs, top_i, mask=k_ok)


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l, scaling,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, SIGMOID: tl.constexpr,
                  NORM: tl.constexpr):
    # One program per token
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_PAD)
    ok = offs < num_experts
    x = tl.load(logits_ptr + t * stride_l + offs, mask=ok, other=-float("inf")).to(tl.float32)
    route_row(x, offs, ok, weights_ptr + t * TOP_K, ids_ptr + t * TOP_K, scaling, TOP_K, K_PAD, E_PAD, SIGMOID, NORM)


def route_greedy(logits: torch.Tensor, top_k: int, sigmoid: bool, norm_topk_prob: bool,
                 routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain top-k routing in one launch: (weights [T, k] float32, ids [T, k] int64), as
    ``models.moe.route`` computes them for ``topk_method="greedy"`` without a correction bias
    (softmax or sigmoid scores, ``norm_topk_prob``, ``routed_scaling_factor``); ids in
    descending score order, ties to the lower expert index."""
    t, e = logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"route_greedy: top_k must be in [1, {e}], got {top_k}")
    if logits.stride(-1) != 1:
        raise ValueError("route_greedy: logits must be contiguous in their last dimension")
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t:
        _route_kernel[(t,)](logits, weights, ids, e, logits.stride(0), float(routed_scaling_factor),
                            TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(e),
                            SIGMOID=sigmoid, NORM=norm_topk_prob, num_warps=1 if e <= 128 else 2)
    return weights, ids
