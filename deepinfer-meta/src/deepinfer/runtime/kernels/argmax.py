"""The greedy token of each logits row, in two short launches (Triton).

A decode graph whose LM head is not ``gemv_argmax`` (a GGUF or tensor-parallel head, or a batch of
rows) picks its tokens from the logits with ``argmax``. torch's ``argmax`` of one 128k-vocabulary
row took 36-39 us inside the Llama-3-8B batch-1 graph on the H200 (guide 08: the GGUF Q4_0 step's
regions), about 2 % of a quantized step. Here programs of ``BLOCK`` columns each reduce their
chunk of a row (rows x chunks programs), and one program a row reduces the chunks' winners.

The result equals ``torch.argmax(logits, dim=-1)``: the first index on ties, and NaN counts as
larger than everything (the first NaN wins), as torch's CUDA and CPU kernels do. Values are
compared as order-preserving integer keys of their float32 bits (NaN made positive and canonical,
-0.0 made +0.0), so these rules need no special cases in the loops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.runtime.kernels.pdl import pdl_begin, pdl_launch

#: columns per program of the first pass (a 128k vocabulary: 32 programs a row)
BLOCK = 4096


@triton.jit
def _key(v):
    """Integer keys of float32 values ordered as torch.argmax orders them (NaN above +inf)."""
    v = tl.where(v == 0.0, 0.0, v)  # -0.0 ties with +0.0
    bits = v.to(tl.int32, bitcast=True)
    bits = tl.where(v != v, 0x7FC00000, bits)  # every NaN: the canonical positive one, above +inf
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negatives: flip the magnitude so larger is larger


@triton.jit
def _argmax_chunks_kernel(x_ptr, stride_x, key_ptr, arg_ptr, n, chunks, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    v = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=ok, other=float("-inf")).to(tl.float32)
    keys = tl.where(ok, _key(v), -2147483647 - 1)
    top = tl.max(keys, axis=0)
    tl.store(key_ptr + row * chunks + chunk, top)
    tl.store(arg_ptr + row * chunks + chunk, tl.min(tl.where(keys == top, cols, 2147483647), axis=0))


@triton.jit
def _argmax_rows_kernel(key_ptr, arg_ptr, out_ptr, chunks, CHUNKS: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    row = tl.program_id(0)
    i = tl.arange(0, CHUNKS)
    ok = i < chunks
    keys = tl.load(key_ptr + row * chunks + i, mask=ok, other=-2147483647 - 1)
    args = tl.load(arg_ptr + row * chunks + i, mask=ok, other=2147483647)
    top = tl.max(keys, axis=0)
    # chunks hold increasing columns: the smallest index among the winners is the first one
    tl.store(out_ptr + row, tl.min(tl.where(keys == top, args, 2147483647), axis=0).to(tl.int64))


def argmax_rows(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` (int64 [rows]) of a [rows, vocab] float tensor whose rows
    are contiguous, in two launches (PDL inside decode graphs). ``out``: an int64 [rows] to write."""
    if logits.dim() != 2 or logits.stride(1) != 1 or not logits.dtype.is_floating_point:
        raise ValueError(f"argmax_rows: logits must be a float [rows, vocab] tensor with contiguous rows, got "
                         f"{logits.dtype} {tuple(logits.shape)} with strides {logits.stride()}")
    rows, n = logits.shape
    if n == 0 or n >= 2**31:
        raise ValueError(f"argmax_rows: the vocabulary must have 1 to 2**31 - 1 columns, got {n}")
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    elif out.shape != (rows,) or out.dtype != torch.int64 or out.device != logits.device:
        raise ValueError(f"argmax_rows: out must be an int64 [{rows}] tensor on {logits.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if rows == 0:
        return out
    chunks = triton.cdiv(n, BLOCK)
    keys = torch.empty(rows * chunks, dtype=torch.int32, device=logits.device)
    args = torch.empty(rows * chunks, dtype=torch.int32, device=logits.device)
    pdl = pdl_launch(logits.device)
    _argmax_chunks_kernel[(rows, chunks)](logits, logits.stride(0), keys, args, n, chunks, BLOCK=BLOCK,
                                          num_warps=8, **pdl)
    _argmax_rows_kernel[(rows,)](keys, args, out, chunks, CHUNKS=triton.next_power_of_2(chunks), num_warps=1,
                                 **pdl)
    return out

