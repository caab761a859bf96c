"""Fused Triton kernels for the elementwise work of a decode step.

Each replaces several torch launches (and their round trips through device memory) with one:

- ``add_rmsnorm``: the residual add followed by RMSNorm (two launches + a float32 copy in torch);
- ``rotary_kv_write``: rotary embedding of the q and k heads and the store of k and v into their
  KV-cache slots (torch: gather of the cos/sin rows, four elementwise ops, two index copies), with
  Qwen3's per-head RMSNorm of q and k first when given its weights;
- ``silu_mul``: SiLU of the gate times the up projection.

Rounding follows the torch ops of ``models/llama.py`` step by step (float32 math, a round to the
activation dtype where torch rounds), so bf16 results match torch to the last bit in most
elements and float32 to a few ulps (the reduction order of the norm differs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.runtime.kernels.pdl import pdl_begin, pdl_launch, prefetch_enabled


@triton.jit
def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                        stride_x, stride_r, stride_o, stride_ro,
                        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # torch rounds the sum
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    normed = (xf * tl.math.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual) for ``x`` [T, H]; residual None: RMSNorm(x), x."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"add_rmsnorm: x must be a 2-D tensor with contiguous rows, got shape {tuple(x.shape)}")
    t, h = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    r = residual if residual is not None else x
    if t:
        _add_rmsnorm_kernel[(t,)](x, r, weight, out, res_out, h, eps, x.stride(0), r.stride(0), out.stride(0),
                                  res_out.stride(0), HAS_RESIDUAL=residual is not None,
                                  BLOCK=triton.next_power_of_2(h), num_warps=4 if h <= 2048 else 8,
                                  **pdl_launch(x.device))
    return out, res_out


@triton.jit
def qk_normed(x, w, r, dt: tl.constexpr):
    """Qwen3's per-head RMSNorm of float32 values ``x`` with weight ``w`` and factor ``r``, rounded
    as models.llama.RMSNorm rounds (to ``dt`` after the scaling and after the weight); float32."""
    return (w * (x * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)


@triton.jit
def rope_rounded(x, rotated, c, s, dt: tl.constexpr):
    """x * cos + rotate_half(x) * sin (``rotated``: rotate_half's value at x's columns), each
    product and the sum rounded to ``dt`` as torch rounds; in ``dt``."""
    return ((x * c).to(dt).to(tl.float32) + (rotated * s).to(dt).to(tl.float32)).to(dt)


@triton.jit
def round_groups_to_bytes(x):
    """Each row of ``x`` [T, group] (float32) as integers in [-127, 127] (int32) times its scale
    ``amax / 127`` [T]: rounded to nearest, ties to even (an all-zero row: zeros, scale 0). The
    8-bit activations of the GGUF kernels (``gguf_gemv``'s dp4a GEMV, ``gguf_mmq``), wherever they
    are made (also by the decode attention for the o projection)."""
    amax = tl.max(tl.abs(x), axis=1)
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)[:, None]
    # (v + 1.5 * 2**23) - 1.5 * 2**23 rounds |v| <= 127 to the nearest integer (ties to even)
    return ((x * inv + 12582912.0) - 12582912.0).to(tl.int32), amax / 127.0


@triton.jit
def store_quantized_groups(xv, cols, ok, q_ptr, st_ptr, kt):
    """The 16-column groups ``xv`` [R, 16] (float32; flat columns ``cols``, stored where ``ok``; a
    group's columns all in or all out) as the dp4a GEMV's activations of ``kt`` groups: codes at
    ``q + cols``, and for group ``t`` the scale, integer sum and float sum at ``st + t``,
    ``st + kt + t`` and ``st + 2 * kt + t``."""
    q, scale = round_groups_to_bytes(xv)
    tl.store(q_ptr + cols, q.to(tl.int8), mask=ok)
    g_ok = tl.max(ok.to(tl.int32), axis=1) > 0
    t = tl.min(cols, axis=1) // 16
    tl.store(st_ptr + t, scale, mask=g_ok)
    tl.store(st_ptr + kt + t, tl.sum(q, axis=1).to(tl.float32), mask=g_ok)
    tl.store(st_ptr + 2 * kt + t, tl.sum(xv, axis=1), mask=g_ok)


@triton.jit
def _rotary_kv_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, q_out_ptr, cache_ptr, qn_ptr, kn_ptr, eps,
                      stride_qkv, stride_qo_t, stride_qo_h, stride_cos, plane, stride_slot, stride_kvh,
                      NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                      HALF_PAD: tl.constexpr, HEAD_BLOCK: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr,
                      PRELOAD: tl.constexpr = False):
    # one program: HEAD_BLOCK heads (q, k or v) of one token, as a [HEAD_BLOCK, HALF_PAD] tile of
    # first halves and one of second halves. PRELOAD: before the wait it loads what no kernel of the
    # step writes (positions, slots, the cos/sin tables, the norm weights; kernels/pdl.py), after it qkv.
    if not PRELOAD:
        pdl_begin(PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = (tl.program_id(1) * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK))[:, None]
    half: tl.constexpr = HEAD_DIM // 2
    i = tl.arange(0, HALF_PAD)[None, :]
    col_ok = i < half
    is_q = head < NUM_HEADS
    is_k = (head >= NUM_HEADS) & (head < NUM_HEADS + NUM_KV_HEADS)
    is_v = (head >= NUM_HEADS + NUM_KV_HEADS) & (head < NUM_HEADS + 2 * NUM_KV_HEADS)
    ok = (is_q | is_k | is_v) & col_ok
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    dt = qkv_ptr.dtype.element_ty
    # cos/sin rows are float32 tables; torch rounds them to the activation dtype first
    c1 = tl.load(cos_ptr + pos * stride_cos + i, mask=col_ok, other=0.0).to(dt).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * stride_cos + half + i, mask=col_ok, other=0.0).to(dt).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * stride_cos + i, mask=col_ok, other=0.0).to(dt).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * stride_cos + half + i, mask=col_ok, other=0.0).to(dt).to(tl.float32)
    slot = tl.load(slot_ptr + tok)
    w1 = c1
    w2 = c2
    if QK_NORM:
        w1 = tl.where(is_q, tl.load(qn_ptr + i, mask=col_ok, other=0.0).to(tl.float32),
                      tl.load(kn_ptr + i, mask=col_ok, other=0.0).to(tl.float32))
        w2 = tl.where(is_q, tl.load(qn_ptr + half + i, mask=col_ok, other=0.0).to(tl.float32),
                      tl.load(kn_ptr + half + i, mask=col_ok, other=0.0).to(tl.float32))
    if PRELOAD:
        pdl_begin(PDL)
    base = qkv_ptr + tok * stride_qkv + head * HEAD_DIM
    raw1 = tl.load(base + i, mask=ok, other=0.0)
    raw2 = tl.load(base + half + i, mask=ok, other=0.0)
    x1 = raw1.to(tl.float32)
    x2 = raw2.to(tl.float32)
    if QK_NORM:  # RMSNorm of each q/k head (as models.llama.RMSNorm rounds), then rotate
        r = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)[:, None]
        x1 = qk_normed(x1, w1, r, dt)
        x2 = qk_normed(x2, w2, r, dt)
    # torch: x * cos + rotate_half(x) * sin, each product and the sum rounded to dt
    o1 = rope_rounded(x1, -x2, c1, s1, dt)
    o2 = rope_rounded(x2, x1, c2, s2, dt)
    qo = q_out_ptr + tok * stride_qo_t + head * stride_qo_h
    tl.store(qo + i, o1, mask=is_q & col_ok)
    tl.store(qo + half + i, o2, mask=is_q & col_ok)
    if slot >= 0:  # padding rows (slot -1) write nothing; v heads are stored as they are
        k_dst = cache_ptr + slot * stride_slot + (head - NUM_HEADS) * stride_kvh
        tl.store(k_dst + i, o1, mask=is_k & col_ok)
        tl.store(k_dst + half + i, o2, mask=is_k & col_ok)
        v_dst = cache_ptr + plane + slot * stride_slot + (head - NUM_HEADS - NUM_KV_HEADS) * stride_kvh
        tl.store(v_dst + i, raw1, mask=is_v & col_ok)
        tl.store(v_dst + half + i, raw2, mask=is_v & col_ok)


# Tokens from which one program rotates all heads of a token (fewer, larger programs: at 256
# decode rows of the SmolLM2 shape 256 programs instead of 3,840); below it one head a program.
ROTARY_ALL_HEADS_FROM = 64


def rotary_kv_write(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    slot_mapping: torch.Tensor, kv_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                    preload: bool | None = None) -> torch.Tensor:
    """Rotate the q and k heads of ``qkv`` [T, (H + 2*KVH) * D] (NEOX layout) at ``positions``, store
    k and v at ``slot_mapping`` (rows with slot < 0 store nothing) in ``kv_cache``
    [2, blocks, block_size, KVH, D]; return the rotated q [T, H, D]. ``qk_norm`` (q weight [D],
    k weight [D], eps): RMSNorm each q and k head before rotating it (Qwen3). ``preload``: the
    positions, slots, cos/sin rows and norm weights are loaded before the PDL wait (default:
    ``DEEPINFER_PDL_PREFETCH``, ``kernels/pdl.py``)."""
    t = qkv.shape[0]
    d = kv_cache.shape[-1]
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d or qkv.stride(1) != 1:
        raise ValueError(f"rotary_kv_write: qkv of shape {tuple(qkv.shape)} does not hold {num_heads} q and "
                         f"2x{num_kv_heads} kv heads of {d}")
    if not kv_cache.is_contiguous() or cos.stride(1) != 1 or cos.stride() != sin.stride():
        raise ValueError("rotary_kv_write: kv_cache and the cos/sin tables must be contiguous")
    if qk_norm is not None and (qk_norm[0].shape != (d,) or qk_norm[1].shape != (d,)):
        raise ValueError(f"rotary_kv_write: the q/k norm weights must be [{d}], got {tuple(qk_norm[0].shape)} and "
                         f"{tuple(qk_norm[1].shape)}")
    qn, kn, eps = qk_norm if qk_norm is not None else (qkv, qkv, 0.0)
    q = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    heads = num_heads + 2 * num_kv_heads
    head_block = triton.next_power_of_2(heads) if t >= ROTARY_ALL_HEADS_FROM else 1
    half_pad = triton.next_power_of_2(d // 2)
    if t:
        _rotary_kv_kernel[(t, triton.cdiv(heads, head_block))](
            qkv, positions, cos, sin, slot_mapping, q, kv_cache, qn, kn, eps,
            qkv.stride(0), q.stride(0), q.stride(1), cos.stride(0), kv_cache.stride(0), kv_cache.stride(2),
            kv_cache.stride(3),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=d, HALF_PAD=half_pad, HEAD_BLOCK=head_block,
            QK_NORM=qk_norm is not None, num_warps=max(1, min(8, head_block * half_pad // 256)),
            PRELOAD=prefetch_enabled() if preload is None else preload, **pdl_launch(qkv.device))
    return q


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, stride_gu, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # torch rounds silu's result first
    tl.store(out_ptr + row * stride_o + cols, (act * u).to(dt), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for ``gate_up`` [T, 2*I] holding gate then up; returns [T, I]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_mul: gate_up must be [T, 2*I] with contiguous rows, got {tuple(gate_up.shape)}")
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n))
    if t:
        _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block,
                                                          **pdl_launch(gate_up.device))
    return out
