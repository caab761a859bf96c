"""MLA decode attention over the latent paged cache (Triton): one query token per sequence.

The queries come absorbed (``attention.mla``): per head, ``q_lat = q_nope @ W_uk`` ([C] values,
C = kv_lora_rank) next to the rotated ``q_pe`` ([R]), so every head attends over the same
"key head", the cache rows ``[c | k_pe]`` of ``[1, blocks, block_size, 1, C + R]``, and reads the
latent ``c`` back as its value: a multi-query decode. One program takes BLOCK_H heads of one
sequence over one split of its context, so each cache tile is read once for all those heads; a
split writes its normalised partial output and log-sum-exp, and the splits are merged after.

``mla_decode`` takes device tensors only and allocates fixed shapes: CUDA-graph capturable.
Runs on CUDA, and on CPU under Triton's interpreter (``TRITON_INTERPRET=1``, the tests).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _mla_decode_kernel(q_ptr, cache_ptr, bt_ptr, lens_ptr, o_ptr, lse_ptr, num_heads, scale,
                       stride_qb, stride_qh, stride_cs, stride_btb, stride_ob, stride_oh, stride_os,
                       stride_lb, stride_lh, num_splits,
                       C: tl.constexpr, R: tl.constexpr, C_PAD: tl.constexpr, R_PAD: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       IEEE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    per = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per
    end = tl.minimum(start + per, seq_len)
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    offs_c = tl.arange(0, C_PAD)
    offs_r = tl.arange(0, R_PAD)
    c_ok, r_ok = offs_c < C, offs_r < R
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_c = tl.load(q_rows + offs_c[None, :], mask=h_ok[:, None] & c_ok[None, :], other=0.0)
    q_r = tl.load(q_rows + C + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    m = tl.full([BLOCK_H], -float("inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, C_PAD], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        block = tl.load(bt_ptr + b * stride_btb + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        rows = cache_ptr + (block * BLOCK_SIZE + offs_n % BLOCK_SIZE) * stride_cs
        k_c = tl.load(rows[:, None] + offs_c[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0.0)
        k_r = tl.load(rows[:, None] + C + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        if IEEE:  # float32 caches: full-precision products (not TF32)
            s = tl.dot(q_c, tl.trans(k_c), input_precision="ieee") + tl.dot(q_r, tl.trans(k_r),
                                                                             input_precision="ieee")
        else:
            s = tl.dot(q_c, tl.trans(k_c)) + tl.dot(q_r, tl.trans(k_r))
        s = tl.where(n_ok[None, :], s * scale, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, k_c.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(k_c.dtype), k_c)
        m = m_new
    empty = denom == 0.0  # a split past the end of this sequence's context
    out = acc / tl.where(empty, 1.0, denom)[:, None]
    lse = tl.where(empty, -float("inf"), m + tl.log(tl.where(empty, 1.0, denom)))
    o_rows = o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os
    tl.store(o_rows + offs_c[None, :], out, mask=h_ok[:, None] & c_ok[None, :])
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=h_ok)


def mla_decode(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               kv_lora_rank: int, scale: float, num_splits: int = 1) -> torch.Tensor:
    """Latent attention output [B, H, C] (float32) of one absorbed query per sequence.

    ``q`` [B, H, C + R] (``[q_nope @ W_uk | q_pe]``), ``cache`` the layer's latent cache
    ``[1, blocks, block_size, 1, C + R]``, ``block_tables`` [B, max_blocks] and ``seq_lens`` [B]
    (every length >= 1) integer device tensors. ``num_splits`` programs share each sequence's
    context (more parallelism for small batches)."""
    b, heads, d = q.shape
    if cache.dim() != 5 or cache.shape[0] != 1 or cache.shape[3] != 1 or cache.shape[4] != d:
        raise ValueError(f"mla_decode: cache must be [1, blocks, block_size, 1, {d}], got {tuple(cache.shape)}")
    if not 0 < kv_lora_rank < d:
        raise ValueError(f"mla_decode: kv_lora_rank must be in (0, {d}), got {kv_lora_rank}")
    if block_tables.shape[0] != b or seq_lens.shape[0] != b:
        raise ValueError(f"mla_decode: {b} queries but block_tables {tuple(block_tables.shape)}, "
                         f"seq_lens {tuple(seq_lens.shape)}")
    if num_splits < 1:
        raise ValueError(f"mla_decode: num_splits must be >= 1, got {num_splits}")
    q = q.contiguous()
    block_size = cache.shape[2]
    flat = cache.view(-1, d)
    c, r = kv_lora_rank, d - kv_lora_rank
    parts = torch.empty(b, heads, num_splits, c, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, heads, num_splits, dtype=torch.float32, device=q.device)
    block_h = 16
    block_n = 32 if c <= 256 else 16
    _mla_decode_kernel[(b, triton.cdiv(heads, block_h), num_splits)](
        q, flat, block_tables, seq_lens, parts, lse, heads, float(scale),
        q.stride(0), q.stride(1), flat.stride(0), block_tables.stride(0),
        parts.stride(0), parts.stride(1), parts.stride(2), lse.stride(0), lse.stride(1), num_splits,
        # (tl.dot needs every dimension >= 16 on the GPU: small ranks are padded, masked)
        C=c, R=r, C_PAD=max(16, triton.next_power_of_2(c)), R_PAD=max(16, triton.next_power_of_2(r)),
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_SIZE=block_size, IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2)
    if num_splits == 1:
        return parts[:, :, 0]
    weights = torch.softmax(lse, dim=-1)  # empty splits: lse -inf, weight 0
    return (parts * weights[..., None]).sum(dim=2)


def choose_mla_splits(batch: int, heads: int, max_len: int, num_sms: int) -> int:
    """Splits per sequence so that batch x head-blocks x splits fills the GPU about once, each
    split keeping at least 256 context tokens of ``max_len``."""
    programs = batch * triton.cdiv(heads, 16)
    want = max(1, num_sms // max(1, programs))
    return max(1, min(want, triton.cdiv(max_len, 256), 32))


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (asked once per device)."""
    return torch.cuda.get_device_properties(device).multi_processor_count
