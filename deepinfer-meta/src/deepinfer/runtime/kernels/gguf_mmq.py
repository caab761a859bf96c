"""GGUF-quantized weights times a few activation rows on the int8 tensor cores (Triton), for
decode batches: llama.cpp's MMQ idea.

``gguf_gemm`` decodes every weight of a tile to bf16 in registers (a conversion and a scale per
weight) before ``tl.dot``; with a batch of a few rows that decode work, not memory, bounds it
(H200, Llama-3-8B at 32 rows: 0.3-0.5x cuBLAS bf16). Here the weights stay integers:

* ``quantize_rows``: each activation row rounded to signed bytes, one scale ``amax / 127`` per
  32 columns (ties to even), with each group's float sum (for the types' mins);
* ``gguf_mmq``: per 32-column group, the codes (their bias subtracted: Q4_0 ``q - 8``, Q6_K
  ``q - 32``, all within int8) times the activation bytes on the tensor cores (``tl.dot``, int32
  sums, exact), then ``acc += (x scale * weight scale) * dot`` in float32, plus the group's min
  times the activation sum (Q4_1 ``+ m``, Q4_K/Q5_K ``- dmin * m``). Q6_K's 16-column groups take
  two dots, each over the codes of one half (the other half zero).

Each output therefore differs from the product with the exact activations by at most
``(amax_g / 254) * |W|`` summed over the groups (the activation rounding; the integer sums are
exact), the bound ``tests/runtime/gguf_gpu_check.py`` checks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.runtime import switches
from deepinfer.runtime.kernels.fused_ops import round_groups_to_bytes
from deepinfer.runtime.kernels.gguf_gemv import _packed_codes, _planes_args, _scales, gemm_tile
from deepinfer.runtime.kernels.gguf_layout import KINDS, GGUFPlanes
from deepinfer.runtime.kernels.pdl import pdl_begin, pdl_launch

# (BLOCK_N, num_warps, num_stages); BLOCK_M is the batch's rows rounded up to a power of two >= 16
MMQ_CONFIG = (64, 4, 3)
QUANTIZE_BLOCK = 1024  # columns a program of quantize_rows


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, sx_ptr, xs_ptr, k, stride_x, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Row ``program_id(0)``, columns ``program_id(1) * BLOCK ..``: signed bytes ``q`` [M, K], per 32
    columns the scale ``sx`` [M, K/32] and the float sum ``xs`` [M, K/32]."""
    T: tl.constexpr = BLOCK // 32
    row = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * T + tl.arange(0, T)
    c = t[:, None] * 32 + tl.arange(0, 32)[None, :]
    ok = c < k
    pdl_begin(PDL)
    x = tl.load(x_ptr + row * stride_x + c, mask=ok, other=0.0).to(tl.float32)
    q, scale = round_groups_to_bytes(x)
    tl.store(q_ptr + row * k + c, q.to(tl.int8), mask=ok)
    kg = k // 32
    t_ok = t < kg
    tl.store(sx_ptr + row * kg + t, scale, mask=t_ok)
    tl.store(xs_ptr + row * kg + t, tl.sum(x, axis=1), mask=t_ok)


@triton.jit
def _mmq_group(acc, codes, c0, rm, m_ok, rn, n_ok, k, xq_ptr, sx_ptr, xs_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb,
               G: tl.constexpr, SB: tl.constexpr, HAS_MIN: tl.constexpr):
    """``acc`` [BM, BN] plus the products of columns ``c0 .. c0 + 31`` (one activation group): int8
    ``codes`` [BN, 32] (bias subtracted) times the rows' activation bytes, scaled per group."""
    c32 = tl.arange(0, 32)
    kg = k // 32
    xa = tl.load(xq_ptr + rm[:, None] * k + (c0 + c32)[None, :], mask=m_ok[:, None], other=0)
    gx = c0 // 32
    sx = tl.load(sx_ptr + rm * kg + gx, mask=m_ok, other=0.0)
    if G == 32:
        dot = tl.dot(xa, tl.trans(codes), out_dtype=tl.int32)
        ws, mn = _scales(rn, c0 // 32, n_ok, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, G, SB, HAS_MIN)
        acc += (sx[:, None] * ws[None, :]) * dot.to(tl.float32)
    else:  # Q6_K: two 16-column groups, one dot each over its half of the codes
        lo = (c32 < 16)[None, :]
        d0 = tl.dot(xa, tl.trans(tl.where(lo, codes, 0).to(tl.int8)), out_dtype=tl.int32)
        d1 = tl.dot(xa, tl.trans(tl.where(lo, 0, codes).to(tl.int8)), out_dtype=tl.int32)
        w0, mn = _scales(rn, c0 // 16, n_ok, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, G, SB, HAS_MIN)
        w1, _ = _scales(rn, c0 // 16 + 1, n_ok, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, G, SB, HAS_MIN)
        acc += sx[:, None] * (w0[None, :] * d0.to(tl.float32) + w1[None, :] * d1.to(tl.float32))
    if HAS_MIN:  # (G == 32: the group's min term came with its scale)
        xs = tl.load(xs_ptr + rm * kg + gx, mask=m_ok, other=0.0)
        if SB > 0:
            mn = -mn
        acc += xs[:, None] * mn[None, :]
    return acc


@triton.jit
def _gguf_mmq_kernel(xq_ptr, sx_ptr, xs_ptr, q_ptr, h_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, b_ptr, out_ptr, mrows, n,
                     k, stride_o, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PACKED: tl.constexpr,
                     G: tl.constexpr, SB: tl.constexpr, HAS_MIN: tl.constexpr, BIAS: tl.constexpr,
                     HAS_BIAS: tl.constexpr, PDL: tl.constexpr, SIX: tl.constexpr):
    rm, rn, m_ok, n_ok = gemm_tile(mrows, n, BLOCK_M, BLOCK_N)
    kc = k // 2 if PACKED else k  # bytes per row of the code plane
    ng = k // G
    nsb = k // SB if SB > 0 else 1
    c32 = tl.arange(0, 32)
    pdl_begin(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, kc, 32):
        raw = tl.load(q_ptr + rn[:, None] * kc + (k0 + c32)[None, :], mask=n_ok[:, None], other=0)
        if PACKED:  # byte j: column j (low nibble) and column j + K/2 (high nibble)
            q_lo, q_hi = _packed_codes(raw, h_ptr, rn, n_ok[:, None], k0 + c32, kc, SIX)
            lo = (q_lo.to(tl.int32) - BIAS).to(tl.int8)
            acc = _mmq_group(acc, lo, k0, rm, m_ok, rn, n_ok, k, xq_ptr, sx_ptr, xs_ptr, s_ptr, m_ptr, d_ptr, dm_ptr,
                             ng, nsb, G, SB, HAS_MIN)
            hi = (q_hi.to(tl.int32) - BIAS).to(tl.int8)
            acc = _mmq_group(acc, hi, kc + k0, rm, m_ok, rn, n_ok, k, xq_ptr, sx_ptr, xs_ptr, s_ptr, m_ptr, d_ptr,
                             dm_ptr, ng, nsb, G, SB, HAS_MIN)
        else:
            codes = (raw.to(tl.int32) - BIAS).to(tl.int8)
            acc = _mmq_group(acc, codes, k0, rm, m_ok, rn, n_ok, k, xq_ptr, sx_ptr, xs_ptr, s_ptr, m_ptr, d_ptr,
                             dm_ptr, ng, nsb, G, SB, HAS_MIN)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_o + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


QuantizedRows = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def mmq_rows() -> int:
    """Rows up to which a GGUF layer on a GPU takes ``gguf_mmq`` (``DEEPINFER_GGUF_MMQ_ROWS``; 0 or 1:
    never, every several-row product then decodes its weights to bf16 in ``gguf_gemm``)."""
    return switches.integer("DEEPINFER_GGUF_MMQ_ROWS")


def mmq_supports(w: GGUFPlanes) -> bool:
    """Whether ``gguf_mmq`` takes this weight: every type, with K a multiple of 64 for the 4-bit ones."""
    return w.k % (64 if w.packed else 32) == 0


def quantize_rows(x: torch.Tensor) -> QuantizedRows:
    """``x`` [M, K] (rows contiguous, K a multiple of 32) as ``gguf_mmq``'s input: (int8 [M, K],
    float32 scales [M, K/32], float32 group sums [M, K/32])."""
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] % 32:
        raise ValueError(f"quantize_rows: x must be [M, K] with contiguous rows and K a multiple of 32, got shape "
                         f"{tuple(x.shape)}")
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    sx = torch.empty((m, k // 32), dtype=torch.float32, device=x.device)
    xs = torch.empty_like(sx)
    if m:
        _quantize_rows_kernel[(m, triton.cdiv(k, QUANTIZE_BLOCK))](x, q, sx, xs, k, x.stride(0), BLOCK=QUANTIZE_BLOCK,
                                                                   num_warps=4, **pdl_launch(x.device))
    return q, sx, xs


def gguf_mmq(xq: QuantizedRows, w: GGUFPlanes, bias: torch.Tensor | None = None, *,
             out: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16,
             config: tuple[int, int, int] = MMQ_CONFIG) -> torch.Tensor:
    """``F.linear`` of the rows ``quantize_rows`` made and the quantized W: [M, N] in ``dtype`` (or
    written to ``out``, an [M, N] view with contiguous rows)."""
    q, sx, xs = xq
    m, k = q.shape
    n = w.n
    if k != w.k:
        raise ValueError(f"gguf_mmq: the activations have {k} columns, the {w.kind} weight {w.k}")
    if not mmq_supports(w):
        raise ValueError(f"gguf_mmq: a {w.kind} weight needs K a multiple of 64 (its byte j holds columns j and "
                         f"j + K/2, and each 32 bytes must feed whole 32-column groups), got K={w.k}")
    if q.device != w.codes.device:
        raise ValueError(f"gguf_mmq: the activations are on {q.device}, the weight on {w.codes.device}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"gguf_mmq: bias must be a contiguous [{n}] vector, got shape {tuple(bias.shape)}")
    if out is None:
        out = torch.empty((m, n), dtype=dtype, device=q.device)
    elif out.shape != (m, n) or out.stride(1) != 1:
        raise ValueError(f"gguf_mmq: out must be [{m}, {n}] with contiguous rows, got shape {tuple(out.shape)}")
    if m == 0:
        return out
    block_n, warps, stages = config
    block_m = max(16, min(64, triton.next_power_of_2(m)))
    _, g, sb, has_min, code_bias = KINDS[w.kind]
    packed = w.packed
    _gguf_mmq_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        q, sx, xs, *_planes_args(w), bias if bias is not None else out, out, m, n, k, out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, PACKED=packed, G=g, SB=sb, HAS_MIN=has_min, BIAS=code_bias,
        HAS_BIAS=bias is not None, SIX=w.high is not None, num_warps=warps, num_stages=stages,
        **pdl_launch(q.device))
    return out
