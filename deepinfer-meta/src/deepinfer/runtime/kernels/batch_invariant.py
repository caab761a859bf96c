"""Batch-invariant matmul and RMSNorm (Triton) for ``LLM(deterministic=True)`` on CUDA.

Why: a row's result must not depend on which other rows share its step. cuBLAS picks its
algorithm, tile shape and split-K by the row count M, and torch's row reductions split a row
over several blocks when there are few rows; either changes the order in which a row's sum is
accumulated, so the same request rounds differently alone and under load. Here:

- ``invariant_linear``: every program owns a ``BLOCK_M x BLOCK_N`` tile of the output and
  reduces K in ``BLOCK_K`` chunks, in one fixed order, with no split over K. The tile
  configuration is one constant for every M (M is not specialised on), so row i of the output
  is computed by the same instructions in the same order whatever the other rows are;
- ``invariant_rms_norm``: one program per row, the row's sum of squares in one fixed order.

Both accumulate in float32 and round once, as cuBLAS and the torch RMSNorm do; the rounding
points follow ``models.llama.RMSNorm``. They are slower than cuBLAS on large batches (no
autotuned tiles, no split-K for tall-skinny shapes): the cost is measured in guide 05.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.runtime.kernels.shared_linear import SharedLinear

# One configuration for every row count (changing it changes results, not their invariance).
BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 32, 128, 64, 4, 3


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, stride_xm, stride_wn, stride_ym, K: tl.constexpr,
                   HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k0 + rk)[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose every output row depends on its input row only.

    ``x`` [..., K] and ``weight`` [N, K] (``bias`` [N]) of one floating dtype on one CUDA device
    (or the CPU under ``TRITON_INTERPRET=1``); the last dimension of each must be contiguous."""
    if x.dtype != weight.dtype:
        raise ValueError(f"invariant_linear: x is {x.dtype} but weight is {weight.dtype}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"invariant_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"invariant_linear: bias {tuple(bias.shape)} does not match weight {tuple(weight.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    m, k = x2.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m > 0:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        _linear_kernel[grid](x2, w, bias if bias is not None else w, y, m, n, x2.stride(0), w.stride(0),
                             y.stride(0), K=k, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
                             BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                             num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return y.reshape(*lead, n)


@triton.jit(do_not_specialize=["rows"])
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, rows, H, stride_x, stride_y, eps, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_H)
    ok = c < H
    xv = tl.load(x_ptr + row * stride_x + c, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xv * xv, 0) / H + eps)
    dt = y_ptr.dtype.element_ty
    wv = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
    # RMSNorm: (x * rstd) rounded to the input dtype, then times the weight (rounded again)
    y = (wv * (xv * rstd).to(dt).to(tl.float32)).to(dt)
    tl.store(y_ptr + row * stride_y + c, y, mask=ok)


def invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``models.llama.RMSNorm`` over the last dimension, one program per row (any row count)."""
    h = x.shape[-1]
    if tuple(weight.shape) != (h,):
        raise ValueError(f"invariant_rms_norm: weight {tuple(weight.shape)} does not match rows of {h}")
    x2 = x.reshape(-1, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty((x2.shape[0], h), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, x2.shape[0], h, x2.stride(0), y.stride(0), eps,
                                         BLOCK_H=triton.next_power_of_2(h))
    return y.reshape(x.shape)


class InvariantLinear(SharedLinear):
    """``nn.Linear`` whose forward is ``invariant_linear`` (build it with ``sharing``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)
