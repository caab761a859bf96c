"""Products with GGUF-quantized weights read as stored (Triton): a one-row GEMV and a multi-row GEMM.

Both read the planes of ``gguf_layout`` (codes, scales and mins in separate row-major tensors) and
decode each weight in registers with gguf.quants' float32 operations; nothing dense is ever
written. A 4-bit plane's byte ``j`` holds columns ``j`` and ``j + K/2``, so each chunk of bytes
feeds two runs of activation columns.

* ``gguf_gemv`` (one row, decode of one sequence): float32 weights times float32 activations,
  float32 accumulation, one rounding at the end; the same neighbour fusions as ``kernels.gemv``
  (RMSNorm prologue, residual epilogue, SiLU·mul input; its ``_activation_chunk`` rounds the
  input where torch's ops round) and its PDL prologue (the first code tile is loaded before
  waiting for the previous kernel).
* ``gguf_gemm`` (several rows: prefill, batches): each program decodes a [BLOCK_N, BLOCK_K] weight
  tile to the activations' dtype in registers and multiplies it on the tensor cores (``tl.dot``),
  float32 accumulation. Weights rounded to bfloat16 there are the weights of the same file
  dequantized to bfloat16 at load (the path an explicit ``dtype`` takes).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer.runtime import switches
from deepinfer.runtime.kernels.gemv import _activation_chunk, check_one_row
from deepinfer.runtime.kernels.gguf_layout import KINDS, GGUFPlanes
from deepinfer.runtime.kernels.pdl import pdl_begin, pdl_launch

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# (BLOCK_N, BLOCK_K, num_warps, num_stages); BLOCK_K counts bytes of the code plane
GEMV_CONFIG = (4, 512, 4, 3)
GEMM_CONFIG = (64, 64, 64, 4, 3)  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)


@triton.jit
def _decode(q, rows, row_ok, c0, c, ok, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, R: tl.constexpr, BK: tl.constexpr,
            G: tl.constexpr, SB: tl.constexpr, HAS_MIN: tl.constexpr, BIAS: tl.constexpr, TILED: tl.constexpr):
    """Float32 weights of codes ``q`` [R, BK] at rows ``rows`` [R] and columns ``c = c0 + arange(BK)``
    (gguf's operations and order). TILED: the scales are loaded once per group ([R, BK/G]) and
    broadcast over its G columns (``c0`` a multiple of G); else gathered per column."""
    if TILED:
        gi = c0 // G + tl.arange(0, BK // G)
        gok = row_ok[:, None] & (gi < ng)[None, :]
        g2 = rows[:, None] * ng + gi[None, :]
        s = tl.load(s_ptr + g2, mask=gok, other=0).to(tl.float32)
        if SB > 0:
            sb2 = rows[:, None] * nsb + (gi * G // SB)[None, :]
            s = tl.load(d_ptr + sb2, mask=gok, other=0.0).to(tl.float32) * s
        w = s[:, :, None] * tl.reshape(q.to(tl.float32) - BIAS, (R, BK // G, G))
        if HAS_MIN:
            mn = tl.load(m_ptr + g2, mask=gok, other=0).to(tl.float32)
            if SB > 0:
                w = w - (tl.load(dm_ptr + sb2, mask=gok, other=0.0).to(tl.float32) * mn)[:, :, None]
            else:
                w = w + mn[:, :, None]
        return tl.reshape(w, (R, BK))
    g = rows[:, None] * ng + (c // G)[None, :]
    s = tl.load(s_ptr + g, mask=ok, other=0).to(tl.float32)
    if SB > 0:
        sb = rows[:, None] * nsb + (c // SB)[None, :]
        s = tl.load(d_ptr + sb, mask=ok, other=0.0).to(tl.float32) * s
    w = s * (q.to(tl.float32) - BIAS)
    if HAS_MIN:
        mn = tl.load(m_ptr + g, mask=ok, other=0).to(tl.float32)
        if SB > 0:
            w = w - tl.load(dm_ptr + sb, mask=ok, other=0.0).to(tl.float32) * mn
        else:
            w = w + mn
    return w


@triton.jit
def _gemv_chunk(acc, raw, rows, row_ok, k0, c, kc, k, rstd, x_ptr, nw_ptr, out_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, ng,
                nsb, R: tl.constexpr, BK: tl.constexpr, PACKED: tl.constexpr, G: tl.constexpr, SB: tl.constexpr,
                HAS_MIN: tl.constexpr, BIAS: tl.constexpr, SILU_MUL: tl.constexpr, NORM: tl.constexpr,
                TILED: tl.constexpr):
    """``acc`` plus the products of code bytes ``raw`` (columns ``c``; with PACKED also ``c + kc``)."""
    c_ok = c < kc
    ok = row_ok[:, None] & c_ok[None, :]
    if PACKED:
        lo = _decode(raw & 0x0F, rows, row_ok, k0, c, ok, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, R, BK, G, SB,
                     HAS_MIN, BIAS, TILED)
        acc += lo * _activation_chunk(x_ptr, nw_ptr, out_ptr, c, c_ok, k, rstd, SILU_MUL, NORM)[None, :]
        hi = _decode(raw >> 4, rows, row_ok, k0 + kc, c + kc, ok, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, R, BK, G,
                     SB, HAS_MIN, BIAS, TILED)
        acc += hi * _activation_chunk(x_ptr, nw_ptr, out_ptr, c + kc, c_ok, k, rstd, SILU_MUL, NORM)[None, :]
    else:
        w = _decode(raw, rows, row_ok, k0, c, ok, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, R, BK, G, SB, HAS_MIN,
                    BIAS, TILED)
        acc += w * _activation_chunk(x_ptr, nw_ptr, out_ptr, c, c_ok, k, rstd, SILU_MUL, NORM)[None, :]
    return acc


@triton.jit
def _gguf_gemv_kernel(x_ptr, q_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, b_ptr, nw_ptr, res_ptr, out_ptr, n, k, eps,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PACKED: tl.constexpr, G: tl.constexpr,
                      SB: tl.constexpr, HAS_MIN: tl.constexpr, BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
                      NORM: tl.constexpr, NORM_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
                      RESIDUAL: tl.constexpr, TILED: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    rows = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < n
    kc = k // 2 if PACKED else k  # bytes per row of the code plane
    ng = k // G
    nsb = k // SB if SB > 0 else 1
    cols = tl.arange(0, BLOCK_K)
    ok0 = row_ok[:, None] & (cols < kc)[None, :]
    first = tl.load(q_ptr + rows[:, None] * kc + cols[None, :], mask=ok0, other=0)  # before the wait (PDL)
    pdl_begin(PDL)
    rstd = 0.0
    if NORM:
        nc = tl.arange(0, NORM_BLOCK)
        xn = tl.load(x_ptr + nc, mask=nc < k, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xn * xn, axis=0) / k + eps)
    acc = _gemv_chunk(tl.zeros([BLOCK_N, BLOCK_K], tl.float32), first, rows, row_ok, 0, cols, kc, k, rstd, x_ptr,
                      nw_ptr, out_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, BLOCK_N, BLOCK_K, PACKED, G, SB, HAS_MIN,
                      BIAS, SILU_MUL, NORM, TILED)
    for k0 in range(BLOCK_K, kc, BLOCK_K):
        c = k0 + cols
        ok = row_ok[:, None] & (c < kc)[None, :]
        raw = tl.load(q_ptr + rows[:, None] * kc + c[None, :], mask=ok, other=0)
        acc = _gemv_chunk(acc, raw, rows, row_ok, k0, c, kc, k, rstd, x_ptr, nw_ptr, out_ptr, s_ptr, m_ptr, d_ptr,
                          dm_ptr, ng, nsb, BLOCK_N, BLOCK_K, PACKED, G, SB, HAS_MIN, BIAS, SILU_MUL, NORM, TILED)
    y = tl.sum(acc, axis=1)
    dt = out_ptr.dtype.element_ty
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if RESIDUAL:  # torch: the projection rounds, then the residual add rounds
        y = y.to(dt).to(tl.float32) + tl.load(res_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(dt), mask=row_ok)


@triton.jit
def _dot(x, w, acc, DOT_F32: tl.constexpr):
    """acc + x @ w.T; DOT_F32 (Triton's interpreter, whose bfloat16 dot returns garbage): the same
    rounded operands multiplied in float32 (exact products, as the tensor cores')."""
    if DOT_F32:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w), acc)


@triton.jit
def _gguf_gemm_kernel(x_ptr, q_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, b_ptr, out_ptr, mrows, n, k, stride_x, stride_o,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PACKED: tl.constexpr,
                      G: tl.constexpr, SB: tl.constexpr, HAS_MIN: tl.constexpr, BIAS: tl.constexpr,
                      HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, TILED: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_ok = rm < mrows
    n_ok = rn < n
    kc = k // 2 if PACKED else k
    ng = k // G
    nsb = k // SB if SB > 0 else 1
    cols = tl.arange(0, BLOCK_K)
    dt = x_ptr.dtype.element_ty
    pdl_begin(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, kc, BLOCK_K):
        c = k0 + cols
        c_ok = c < kc
        ok = n_ok[:, None] & c_ok[None, :]
        xm = m_ok[:, None] & c_ok[None, :]
        raw = tl.load(q_ptr + rn[:, None] * kc + c[None, :], mask=ok, other=0)
        if PACKED:
            lo = _decode(raw & 0x0F, rn, n_ok, k0, c, ok, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, BLOCK_N, BLOCK_K, G, SB,
                         HAS_MIN, BIAS, TILED).to(dt)
            xv = tl.load(x_ptr + rm[:, None] * stride_x + c[None, :], mask=xm, other=0.0)
            acc = _dot(xv, lo, acc, DOT_F32)
            hi = _decode(raw >> 4, rn, n_ok, k0 + kc, c + kc, ok, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, BLOCK_N, BLOCK_K,
                         G, SB, HAS_MIN, BIAS, TILED).to(dt)
            xv = tl.load(x_ptr + rm[:, None] * stride_x + (c + kc)[None, :], mask=xm, other=0.0)
            acc = _dot(xv, hi, acc, DOT_F32)
        else:
            w = _decode(raw, rn, n_ok, k0, c, ok, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, BLOCK_N, BLOCK_K, G, SB, HAS_MIN,
                        BIAS, TILED).to(dt)
            xv = tl.load(x_ptr + rm[:, None] * stride_x + c[None, :], mask=xm, other=0.0)
            acc = _dot(xv, w, acc, DOT_F32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_o + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _planes_args(w: GGUFPlanes) -> tuple[torch.Tensor, ...]:
    s = w.scale
    return (w.codes, s, w.minimum if w.minimum is not None else s, w.d if w.d is not None else s,
            w.dmin if w.dmin is not None else s)


def _kind_meta(w: GGUFPlanes) -> dict[str, object]:
    packed, g, sb, has_min, bias = KINDS[w.kind]
    return dict(PACKED=packed, G=g, SB=sb, HAS_MIN=has_min, BIAS=bias, TILED=tiled_scales())


def tiled_scales() -> bool:
    """Scales loaded once per group and broadcast over its columns (default), or gathered per column
    (``DEEPINFER_GGUF_TILED_SCALES=0``, the first version). Same weights; on the H200 the tiled
    loads ran the Llama-3-8B shapes 3-5x faster in the GEMV and 5-10x in the 32-row GEMM
    (bench/gguf_gemv_bench.py: Q4_K gate_up GEMV 320 -> 64 us, Q8_0 126 -> 44 us)."""
    return switches.enabled("DEEPINFER_GGUF_TILED_SCALES")


def gguf_gemv(x: torch.Tensor, w: GGUFPlanes, bias: torch.Tensor | None = None, *, silu_mul: bool = False,
              norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None,
              out: torch.Tensor | None = None, config: tuple[int, int, int, int] = GEMV_CONFIG) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for one row ``x`` [1, K] (``[1, 2K]`` gate/up with ``silu_mul``) and
    the quantized W; [1, N] in ``x``'s dtype. ``norm``/``residual``/``silu_mul`` as ``kernels.gemv.gemv``.
    ``out``: a contiguous [1, N] to write (a slice of a wider output)."""
    n, k = w.n, w.k
    check_one_row("gguf_gemv", x, n, k, f"the {w.kind} weight", silu_mul=silu_mul, bias=bias, norm=norm,
                  residual=residual)
    if x.device != w.codes.device:
        raise ValueError(f"gguf_gemv: x is on {x.device}, the weight on {w.codes.device}")
    out = torch.empty((1, n), dtype=x.dtype, device=x.device) if out is None else out
    block_n, block_k, warps, stages = config
    if _INTERPRET:  # Triton's interpreter runs programs one by one: fewer, wider ones (same products)
        block_n = max(block_n, 64)
    _gguf_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, *_planes_args(w), bias if bias is not None else out, norm[0] if norm is not None else out,
        residual if residual is not None else out, out, n, k, norm[1] if norm is not None else 0.0,
        BLOCK_N=block_n, BLOCK_K=block_k, **_kind_meta(w), SILU_MUL=silu_mul, NORM=norm is not None,
        NORM_BLOCK=triton.next_power_of_2(k) if norm is not None else 1, HAS_BIAS=bias is not None,
        RESIDUAL=residual is not None, num_warps=warps, num_stages=stages, **pdl_launch(x.device))
    return out


def gguf_gemm(x: torch.Tensor, w: GGUFPlanes, bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
              config: tuple[int, int, int, int, int] = GEMM_CONFIG) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for ``x`` [M, K] (rows contiguous) and the quantized W; [M, N] in
    ``x``'s dtype (weights decoded to that dtype in registers). ``out``: an [M, N] view with
    contiguous rows to write."""
    n, k = w.n, w.k
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"gguf_gemm: x must be [M, {k}] with contiguous rows, got shape {tuple(x.shape)}")
    if x.device != w.codes.device:
        raise ValueError(f"gguf_gemm: x is on {x.device}, the weight on {w.codes.device}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"gguf_gemm: bias must be a contiguous [{n}] vector, got shape {tuple(bias.shape)}")
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    if m == 0:
        return out
    block_m, block_n, block_k, warps, stages = config
    block_m = max(16, min(block_m, triton.next_power_of_2(m)))
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _gguf_gemm_kernel[grid](x, *_planes_args(w), bias if bias is not None else out, out, m, n, k, x.stride(0),
                            out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **_kind_meta(w),
                            HAS_BIAS=bias is not None, DOT_F32=_INTERPRET or x.dtype == torch.float32,
                            num_warps=warps, num_stages=stages, **pdl_launch(x.device))
    return out
