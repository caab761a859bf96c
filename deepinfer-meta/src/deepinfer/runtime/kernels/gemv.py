"""Matrix-vector product for decode steps of one sequence (Triton), optionally with SiLU·mul fused in.

A decode step of a single sequence multiplies one activation row by every weight matrix, so it is
bound by how fast the weights stream from device memory. For that shape (M = 1, bf16) cuBLAS's
choice left a Llama-3-8B step well short of the memory roofline; this kernel has each program
stream ``BLOCK_N`` contiguous weight rows in ``BLOCK_K`` chunks with the loads software-pipelined
(``num_stages``), and accumulates in float32 (one rounding at the end, as cuBLAS does).

``silu_mul=True`` takes the gate/up activations [1, 2*K] and computes SiLU(gate) * up on the fly
(rounded to the activation dtype where ``fused_ops.silu_mul`` rounds), which saves the separate
SiLU·mul launch before the down projection.

``gemv_argmax`` is the LM head of a greedy step: each program also keeps the largest of its
(rounded) logits, and a one-program kernel reduces those to the argmax (first index on ties, as
``torch.argmax``), in place of torch's argmax pass over the logits (36 us per Llama-3-8B step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (BLOCK_N, BLOCK_K, num_warps, num_stages): picked on the H200 (bench/gemv_bench.py) for the
# Llama-3-8B projections; any values give the same results up to the float32 summation order.
DEFAULT_CONFIG = (8, 512, 4, 4)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, max_ptr, arg_ptr, n, k, stride_w,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr, HAS_BIAS: tl.constexpr,
                 ARGMAX: tl.constexpr):
    pid = tl.program_id(0)
    rows = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < n
    cols = tl.arange(0, BLOCK_K)
    dt = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        c = k0 + cols
        c_ok = c < k
        if SILU_MUL:
            g = tl.load(x_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
            u = tl.load(x_ptr + k + c, mask=c_ok, other=0.0).to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            xv = (act * u).to(dt).to(tl.float32)
        else:
            xv = tl.load(x_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None] * stride_w + c[None, :], mask=row_ok[:, None] & c_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * xv[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(dt), mask=row_ok)
    if ARGMAX:  # this program's largest logit (as rounded to dt) and its first index
        yr = tl.where(row_ok, y.to(dt).to(tl.float32), float("-inf"))
        best = tl.max(yr, axis=0)
        first = tl.min(tl.where(yr == best, rows, n), axis=0)
        tl.store(max_ptr + pid, best)
        tl.store(arg_ptr + pid, first)


@triton.jit
def _argmax_partials_kernel(max_ptr, arg_ptr, out_ptr, num, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_arg = tl.full([BLOCK], 2**62, tl.int64)
    for start in range(0, num, BLOCK):  # lane-wise running best; later chunks hold larger indices
        ok = start + i < num
        v = tl.load(max_ptr + start + i, mask=ok, other=float("-inf"))
        a = tl.load(arg_ptr + start + i, mask=ok, other=2**62)
        better = v > best
        best = tl.where(better, v, best)
        best_arg = tl.where(better, a, best_arg)
    top = tl.max(best, axis=0)
    tl.store(out_ptr, tl.min(tl.where(best == top, best_arg, 2**62), axis=0))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, silu_mul: bool = False,
         config: tuple[int, int, int, int] = DEFAULT_CONFIG, out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for one row ``x`` [1, K] and ``weight`` [N, K] with contiguous
    rows; with ``silu_mul`` ``x`` is [1, 2*K] (gate then up) and the product uses SiLU(gate) * up.
    Returns [1, N] in ``x``'s dtype."""
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(1) != 1:
        raise ValueError(f"gemv: x must be one contiguous row [1, K], got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"gemv: weight must be [N, K] with contiguous rows, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if x.shape[1] != (2 * k if silu_mul else k):
        raise ValueError(f"gemv: x has {x.shape[1]} columns, weight [{n}, {k}] needs {2 * k if silu_mul else k}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"gemv: bias must be a contiguous [{n}] vector, got shape {tuple(bias.shape)}")
    out = torch.empty((1, n), dtype=x.dtype, device=x.device) if out is None else out
    block_n, block_k, warps, stages = config
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, out, out, n, k, weight.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, SILU_MUL=silu_mul, HAS_BIAS=bias is not None, ARGMAX=False,
        num_warps=warps, num_stages=stages)
    return out


def gemv_argmax(x: torch.Tensor, weight: torch.Tensor, config: tuple[int, int, int, int] = DEFAULT_CONFIG
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(``F.linear(x, weight)`` [1, N], its argmax as int64 [1]) for one row ``x`` [1, K]: the
    logits and the greedy token of an LM head, without a separate argmax pass over the logits."""
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(1) != 1:
        raise ValueError(f"gemv_argmax: x must be one contiguous row [1, K], got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.stride(1) != 1 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"gemv_argmax: weight must be [N, {x.shape[1]}] with contiguous rows, got "
                         f"{tuple(weight.shape)}")
    n, k = weight.shape
    block_n, block_k, warps, stages = config
    programs = triton.cdiv(n, block_n)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    maxes = torch.empty(programs, dtype=torch.float32, device=x.device)
    args = torch.empty(programs, dtype=torch.int64, device=x.device)
    greedy = torch.empty(1, dtype=torch.int64, device=x.device)
    _gemv_kernel[(programs,)](x, weight, weight, out, maxes, args, n, k, weight.stride(0),
                              BLOCK_N=block_n, BLOCK_K=block_k, SILU_MUL=False, HAS_BIAS=False, ARGMAX=True,
                              num_warps=warps, num_stages=stages)
    # wide: with 1024 lanes the 32k partials of a 128k vocabulary took 29 us of serial loads
    _argmax_partials_kernel[(1,)](maxes, args, greedy, programs, BLOCK=min(8192, triton.next_power_of_2(programs)),
                                  num_warps=16)
    return out, greedy
