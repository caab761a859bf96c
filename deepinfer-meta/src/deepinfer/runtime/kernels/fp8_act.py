"""FP8 activations for the several-row products of fp8 layers (vLLM's w8a8 "fp8 dynamic" path).

- ``quantize_rows_fp8``: dynamic per-token quantization, one Triton program per row: the row's
  amax, scale = amax / 448 (an all-zero row keeps scale 1, as the weights do), codes =
  x / scale saturated to +-448 and rounded to nearest even. No host sync, only the two outputs
  are allocated: it runs inside CUDA graphs. ``quantize_rows_fp8_torch`` is its torch twin (the
  CPU path and the tests' reference).
- ``fp8_scaled_mm``: ``torch._scaled_mm`` (FP8 tensor cores) on those codes with row-wise scales:
  scale_a [M, 1] and scale_b [1, N] float32, bfloat16 out.
- ``fp8_w8a8_gemm``: the same product as a Triton ``tl.dot`` of fp8 tiles (no widening of the
  weights), scales applied to the float32 accumulator; bench/fp8_sweep.py compares the two.

Activation quantization adds error on top of the weights': each code is within 2^-4 of its value
(E4M3's half step), so a product moves by at most ~2^-4 of sum |x_i w_i| and in practice by
about 2^-4 / sqrt(3) of its rms (random rounding); bench/fp8_check.py measures it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0  # largest finite float8_e4m3fn
QUANT_BLOCK = 1024  # columns per step of the row quantizer


@triton.jit
def e4m3_grid(v):
    """``v`` (float32, |v| <= 448) rounded to nearest even on the E4M3 grid, still float32, so that
    the cast to fp8 after it is exact (Triton's interpreter does not round that cast to nearest even;
    the GPU's cvt does, and gives the same codes). Normal range: round the float32 mantissa to 3 bits;
    below 2^-6 (E4M3 subnormals, steps of 2^-9): round v * 2^9 to an integer (1.5 * 2^23 trick)."""
    b = v.to(tl.int32, bitcast=True)
    b = (b + 0x7FFFF + ((b >> 20) & 1)) & -1048576  # -1048576 = 0xFFF00000: sign, exponent, 3 mantissa bits
    normal = b.to(tl.float32, bitcast=True)
    sub = ((v * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
    return tl.where(tl.abs(v) < 0.015625, sub, normal)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, k, stride_x, stride_q, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, k, BLOCK):
        c = k0 + cols
        v = tl.load(x_ptr + row * stride_x + c, mask=c < k, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    a = tl.max(amax, axis=0)
    scale = tl.where(a > 0, tl.math.div_rn(a, 448.0), 1.0)  # IEEE division: torch's codes
    tl.store(s_ptr + row, scale)
    for k0 in range(0, k, BLOCK):  # the row again (from L1/L2): codes
        c = k0 + cols
        v = tl.load(x_ptr + row * stride_x + c, mask=c < k, other=0.0).to(tl.float32)
        code = e4m3_grid(tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -448.0), 448.0))
        tl.store(q_ptr + row * stride_q + c, code.to(q_ptr.dtype.element_ty), mask=c < k)


def _check_rows(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{name}: x must be 2-D [M, K] with contiguous rows, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name}: x must be bfloat16, float16 or float32, got {x.dtype}")


def quantize_rows_fp8_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 codes [M, K], float32 scales [M, 1]) of ``x`` [M, K], each row scaled by its amax / 448
    (an all-zero row: scale 1). ``codes.float() * scales`` approximates ``x``."""
    _check_rows("quantize_rows_fp8", x)
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows_fp8_torch`` in one Triton kernel on CUDA (its twin elsewhere)."""
    if x.device.type != "cuda" and not _interpreting():
        return quantize_rows_fp8_torch(x)
    _check_rows("quantize_rows_fp8", x)
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0),
                                    BLOCK=min(QUANT_BLOCK, triton.next_power_of_2(max(k, 1))), num_warps=4)
    return q, s


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def fp8_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(q(x) @ weight.T) * xs * scale (+ bias)``: ``x`` [M, K] quantized per row, then
    ``torch._scaled_mm`` with row-wise scales (bfloat16 out, cast to ``x``'s dtype)."""
    if weight.shape[0] % 16 or weight.shape[1] % 16:
        raise ValueError(f"fp8_scaled_mm: torch._scaled_mm needs N and K divisible by 16, got weight shape "
                         f"{tuple(weight.shape)} (fp8_w8a8_gemm takes any shape)")
    xq, xs = quantize_rows_fp8(x)
    y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=torch.bfloat16)
    y = y if x.dtype == torch.bfloat16 else y.to(x.dtype)
    return y if bias is None else y + bias


@triton.jit
def _w8a8_gemm_kernel(xq_ptr, xs_ptr, w_ptr, s_ptr, b_ptr, out_ptr, m, n, k, stride_x, stride_w, stride_o,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(0)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < m
    n_ok = rn < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        c = k0 + rk
        c_ok = c < k
        a = tl.load(xq_ptr + rm[:, None] * stride_x + c[None, :], mask=m_ok[:, None] & c_ok[None, :], other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_w + c[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)  # fp8 x fp8 -> float32 on the tensor cores
    y = acc * tl.load(xs_ptr + rm, mask=m_ok, other=0.0)[:, None] * tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_o + rn[None, :], y.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def w8a8_config(m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of ``fp8_w8a8_gemm`` for ``m`` rows."""
    if m <= 16:
        return 16, 64, 256, 4, 4
    if m <= 64:
        return 64, 64, 256, 4, 4
    return 128, 128, 128, 8, 3


def fp8_w8a8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                  config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``fp8_scaled_mm``'s product as one Triton GEMM (after the row quantizer)."""
    n, k = weight.shape
    if weight.dtype != torch.float8_e4m3fn or weight.stride(1) != 1 or scale.shape != (n,):
        raise ValueError(f"fp8_w8a8_gemm: weight must be float8_e4m3fn [N, K] with float32 scales [N], got "
                         f"{weight.dtype} shape {tuple(weight.shape)}, scales {tuple(scale.shape)}")
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"fp8_w8a8_gemm: x must be [M, {k}], got shape {tuple(x.shape)}")
    xq, xs = quantize_rows_fp8(x)
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bm, bn, bk, warps, stages = config or w8a8_config(m)
    _w8a8_gemm_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm))](
        xq, xs, weight, scale, bias if bias is not None else scale, out, m, n, k, xq.stride(0), weight.stride(0),
        out.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, HAS_BIAS=bias is not None, num_warps=warps,
        num_stages=stages)
    return out
