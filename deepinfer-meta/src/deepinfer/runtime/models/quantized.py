"""Linear layers and embeddings whose weights stay in a GGUF file's block quantization (CPU).

``Int4Linear`` runs torch's CPU int4 weight-only matmul (``aten._weight_int4pack_mm_for_cpu``,
group size 32, a bfloat16 scale and zero per group). Its fast kernel takes bfloat16 activations
(the float32 variant is 20-100x slower here), so inputs are rounded to bfloat16 and outputs come
back in bfloat16 and are widened to the caller's dtype. Q8_0 weights run as two int4 halves whose
outputs are summed in float32 (exact split of the weight: see ``gguf_blocks``). From
``DENSE_FROM_ROWS`` rows on (long prefills) the weight is decoded to bfloat16 for that call and
multiplied by a bfloat16 GEMM instead, which is faster there on CPUs where torch runs AVX-512
(``dense_from_rows``; on AVX2 machines the int4 kernel stays faster at every row count).

``Q8Embedding`` keeps a Q8_0 embedding table as int8 codes and scales and dequantizes only the
looked-up rows (bitwise what a dense float32 table would give).

The int4 kernel's packing needs the output rows in multiples of 16 (of its row block, 64 or 32
by the CPU's instruction set, for ``pack_int4``'s fast path); a weight of any other row count (a 32,002-token vocabulary: Llama-2/Mistral fine-tunes
with added tokens) is padded with zero rows up to a multiple of 64 and its output sliced back, so
every GGUF file loads on the int4 path (logged once per padded layer at DEBUG, once per model at
INFO by the loader).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.runtime.kernels.gguf_blocks import GROUP, Int4Groups

ROW_MULTIPLE = 64  # output rows are padded to a multiple of this (the packed layout's row block)

_int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu
_pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu
DENSE_FROM_ROWS = 128  # from this many rows, decode the weight once and run a bfloat16 GEMM (AVX-512)


@functools.cache
def dense_from_rows() -> int | None:
    """From how many rows a call decodes the weight to bfloat16 and runs a bfloat16 GEMM instead of
    the int4 kernel: ``DENSE_FROM_ROWS`` where torch's CPU kernels run AVX-512, None (never) below
    it. Without AVX-512 torch's bfloat16 arithmetic is slow: on a 2-core AVX2 machine decoding
    SmolLM2's gate/up to bfloat16 took ~95 ms and its 512-row bfloat16 GEMM path 287 ms against
    56 ms for the int4 kernel (2026-12-03)."""
    return DENSE_FROM_ROWS if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else None


def _pack_rows(q: torch.Tensor, block: int) -> torch.Tensor:
    """``q`` [N, K] codes in aten's packed layout for output-row blocks of ``block`` rows:
    [N/block, K, block/2] bytes, row j of a block in the low nibble and row block/2 + j in the high."""
    n, k = q.shape
    blocks = q.reshape(n // block, 2, block // 2, k)
    packed = blocks[:, 0] | (blocks[:, 1] << 4)  # [N/block, block/2, K]
    return packed.transpose(1, 2).contiguous().reshape(n, k // 2)


@functools.cache
def packed_row_block() -> int | None:
    """The output-row block of aten's packed int4 layout on this CPU, or None when it is not one
    ``_pack_rows`` builds. It depends on the instruction set aten's kernel dispatches to: 64 rows
    with AVX-512, 32 with AVX2 (an AVX2-only AMD EPYC). Read once from aten's own packing of a
    probe, so the layout is never assumed (an assumed 64 gave garbage on AVX2)."""
    probe = torch.randint(0, 16, (128, 64), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    ref = _pack(probe.to(torch.int32), 1)
    return next((b for b in (64, 32) if torch.equal(_pack_rows(probe, b), ref)), None)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``q`` [N, K] (uint8 codes 0..15) in the int4 kernel's packed layout (what
    ``aten._convert_weight_to_int4pack_for_cpu`` returns; tests check they agree), built with byte
    ops (~10x faster than the aten call) when the layout is one ``packed_row_block`` recognises and
    N is a multiple of its row block; else by the aten call."""
    block = packed_row_block()
    if block is None or q.shape[0] % block:
        return _pack(q.to(torch.int32), 1)
    return _pack_rows(q, block)


def int4_supported(in_features: int) -> bool:
    """Whether a weight with ``in_features`` inputs fits the int4 kernel's layout."""
    return in_features % GROUP == 0 and in_features % 2 == 0


class Int4Linear(nn.Module):
    """``y = x @ W.T (+ bias)`` with W held as packed int4 codes and per-32 bfloat16 scale/zero.

    ``parts`` (1 or 2) int4 tensors of the same [N, K] shape are stacked into one [parts*Np, K]
    weight, each part padded with zero rows to ``Np``, N rounded up to a multiple of
    ``ROW_MULTIPLE`` (``padded_rows`` per part; the padding's outputs are sliced off); with 2 the
    two output halves are summed (the Q8_0 split).
    """

    packed: torch.Tensor
    scales_zeros: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, parts: list[Int4Groups], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        n, k = parts[0].q.shape
        if not int4_supported(k):
            raise ValueError(f"Int4Linear: in_features={k} must be a multiple of {GROUP}")
        if len(parts) not in (1, 2) or any(p.q.shape != (n, k) for p in parts):
            raise ValueError("Int4Linear: one or two int4 tensors of the same shape")
        self.in_features, self.out_features, self.num_parts = k, n, len(parts)
        self.padded_rows = -(-n // ROW_MULTIPLE) * ROW_MULTIPLE
        pad = self.padded_rows - n

        def padded(t: torch.Tensor) -> torch.Tensor:
            return t if pad == 0 else torch.cat([t, t.new_zeros(pad, *t.shape[1:])])

        q = torch.cat([padded(p.q) for p in parts]).to(torch.uint8)
        scale = torch.cat([padded(p.scale) for p in parts]).t()  # [K/32, parts*Np]
        zero = torch.cat([padded(p.zero) for p in parts]).t()
        self.register_buffer("packed", pack_int4(q))
        self.register_buffer("scales_zeros", torch.stack((scale, zero), -1).to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.float().clone())

    @property
    def kernel_path(self) -> str:  # models/describe.py
        dense = dense_from_rows()
        return ("torch int4 weight-only matmul (bfloat16 activations"
                + (f"; bfloat16 GEMM from {dense} rows)" if dense is not None else ")"))

    @property
    def weight_type(self) -> str:  # models/describe.py
        return "int4 per-32" if self.num_parts == 1 else "Q8_0 as two int4 halves per-32"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xb = x.reshape(-1, self.in_features).to(torch.bfloat16)
        dense = dense_from_rows()
        if dense is not None and xb.shape[0] >= dense:
            # The int4 kernel's cost grows with the rows (it decodes the weight per row block);
            # for a long prefill, decoding once and a bfloat16 GEMM is 2x faster (measured on
            # SmolLM2's gate/up: 512 rows 19 ms vs 2.2 + 7.9 ms).
            y = F.linear(xb, self.bf16_weight())
        else:
            y = _int4_mm(xb, self.packed, GROUP, self.scales_zeros)
        n = self.out_features
        if self.num_parts == 2:
            y = y[:, :n].float() + y[:, self.padded_rows:self.padded_rows + n]
        elif n != self.padded_rows:
            y = y[:, :n]
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*lead, self.out_features)

    def bf16_weight(self) -> torch.Tensor:
        """The stacked [parts*Np, K] weight decoded to bfloat16 (padding rows included: zeros).
        Scale and zero broadcast over each group of 32 (no repeated [N, K] copies of them) and
        the arithmetic runs in place: the same values, 2-3x faster for SmolLM2's qkv and gate/up
        measured alone (one thread), ~2 % of a 1024-row quantized prefill step."""
        rows, k = self.packed.shape[0], self.in_features
        block = packed_row_block()
        if block is None:  # a layout we do not decode: let the kernel decode it (x = identity)
            eye = torch.eye(k, dtype=torch.bfloat16)
            return _int4_mm(eye, self.packed, GROUP, self.scales_zeros).t().contiguous()
        b = self.packed.reshape(rows // block, 1, k, block // 2)
        # [rows/block, 2, K, block/2] nibbles -> row order (low nibble: row j of a block, high: block/2 + j)
        q = torch.cat((b & 0x0F, b >> 4), dim=1).transpose(2, 3).reshape(rows, k // GROUP, GROUP)
        scale = self.scales_zeros[..., 0].t().unsqueeze(2).contiguous()  # [rows, K/32, 1]
        zero = self.scales_zeros[..., 1].t().unsqueeze(2).contiguous()
        return q.to(torch.bfloat16).sub_(8).mul_(scale).add_(zero).view(rows, k)


class Q8Embedding(nn.Module):
    """Embedding lookup over a Q8_0 table kept as int8 codes [V, H] and float32 scales [V, H/32]."""

    codes: torch.Tensor
    scales: torch.Tensor
    weight_type = "Q8_0 int8 per-32"  # models/describe.py
    kernel_path = "int8 rows dequantized on lookup"

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.float().contiguous())
        self.num_embeddings, self.embedding_dim = codes.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q = self.codes[ids].float().unflatten(-1, (-1, GROUP))
        return (q * self.scales[ids].unsqueeze(-1)).flatten(-2)
