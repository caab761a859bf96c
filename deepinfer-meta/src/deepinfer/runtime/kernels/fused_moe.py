"""Fused mixture-of-experts on the GPU (Triton): token sort by expert, grouped GEMMs with SiLU·mul
fused, weighted combine.

``fused_experts(x, weights, ids, w13, w2)`` computes, for every token t, ``sum_j weights[t, j] *
expert_{ids[t, j]}(x[t])`` with SwiGLU experts ``w13`` [E, 2I, H] (gate rows, then up rows) and
``w2`` [E, H, I]:

1. ``align_by_expert`` (torch, no host synchronisation, fixed output sizes): the T*k (token, slot)
   pairs sorted by expert, each expert's run padded to a multiple of ``BLOCK_M`` with the
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


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [P] int32, block_expert [P // block_m] int32) for ``ids`` [T, k].

    ``P = T*k + E*(block_m - 1)`` rounded up to a multiple of block_m: an upper bound of the padded
    length that depends only on the shapes (graph-capturable). ``sorted_pairs`` holds pair indices
    (t*k + j) grouped by expert, each group padded with T*k; ``block_expert`` the expert of each
    block, -1 past the last group."""
    flat = ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    size = triton.cdiv(n + num_experts * (block_m - 1), block_m) * block_m
    counts = torch.bincount(flat, minlength=num_experts)
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


def fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  block_m: int = 16, block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """Weighted sum over each token's routed SwiGLU experts, [T, H] in ``x.dtype``.

    ``x`` [T, H], ``weights`` [T, k] (any float dtype), ``ids`` [T, k] integer expert indices,
    ``w13`` [E, 2I, H], ``w2`` [E, H, I], all on one device, weights contiguous in their last dim."""
    t, hidden = x.shape
    k = ids.shape[1]
    e, two_i, h2 = w13.shape
    inter = two_i // 2
    if h2 != hidden or tuple(w2.shape) != (e, hidden, inter) or weights.shape != ids.shape or ids.shape[0] != t:
        raise ValueError(f"fused_experts: shapes disagree: x {tuple(x.shape)}, weights {tuple(weights.shape)}, "
                         f"ids {tuple(ids.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if not (x.device == w13.device == w2.device == ids.device == weights.device):
        raise ValueError("fused_experts: every tensor must be on one device")
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("fused_experts: w13 and w2 must be contiguous in their last dimension")
    x = x.contiguous()
    pairs, block_expert = align_by_expert(ids, e, block_m)
    num_pairs = t * k
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)  # summed in float32
    flat_w = weights.reshape(-1).float().contiguous()
    blocks = block_expert.numel()
    ieee = x.dtype == torch.float32  # float32 models get float32 products; bf16/fp16 use tensor cores
    _gate_up_kernel[(blocks, triton.cdiv(inter, block_n))](
        x, w13, h, pairs, block_expert, num_pairs, k, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee)
    _down_kernel[(blocks, triton.cdiv(hidden, block_n))](
        h, w2, y, flat_w, pairs, block_expert, num_pairs, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee)
    return y.view(t, k, hidden).sum(dim=1).to(x.dtype)  # combine: each token's k weighted expert rows
