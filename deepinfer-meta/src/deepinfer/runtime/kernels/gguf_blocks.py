"""Decode GGUF quantization blocks tensor by tensor, straight from the memory-mapped file.

Two views of a quantized tensor:

* ``dequantize`` — dense floats, computed with the same float32 operations in the same order as
  ``gguf.quants`` (so the result is bitwise what transformers' GGUF loader sees). Where the engine
  wheel has its CPU kernels, their native decoder (``_cpu_kernels.dequantize``: one pass over the
  blocks, outside the GIL) does it for Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K and Q6_K. On the 2-core
  VM it decoded every quantized tensor of the default model's Q4_K_M re-quantization (mostly Q5_0:
  SmolLM2's 576 columns are no multiple of the K-quants' 256) in 0.06 s on a quiet machine, and in
  0.10-0.19 s against 9-18 s for the torch decoders while a test suite ran beside it (torch's
  threaded byte ops suffer most from a busy machine). Otherwise the torch decoders (``dequantize_torch``:
  ~50x faster than the numpy version for Q4_0, Q4_1, Q8_0, Q4_K; Q5_0 and Q6_K ~2x), and
  ``gguf.quants`` for the other types.
* ``int4_groups`` — the tensor as 4-bit codes with a scale and a zero per group of 32 weights,
  ``w = (q - 8) * scale + zero``: the layout of torch's CPU int4 weight-only matmul. Q4_0, Q4_1 and
  Q4_K map onto it exactly (their scales are products of fp16 values); Q8_0 maps onto two such
  tensors (high and low nibble of ``q + 128``) whose sum is the weight.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

GROUP = 32  # weights per scale in Q4_0/Q4_1/Q8_0 and per sub-block in Q4_K
_QK_K = 256

# name -> bytes per block of GROUP (or 256 for K-quants) weights
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q8_0": 34, "Q4_K": 144, "Q6_K": 210}
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # one int4 tensor each
SPLIT_INT4_TYPES = ("Q8_0",)  # two int4 tensors (high + low nibble)


@dataclass
class Int4Groups:
    """4-bit codes ``q`` [N, K] (uint8, 0..15) and float32 ``scale``/``zero`` [N, K // 32]."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        s = self.scale.repeat_interleave(GROUP, 1)
        z = self.zero.repeat_interleave(GROUP, 1)
        return (self.q.float() - 8) * s + z

    def permute_rows(self, index: torch.Tensor) -> Int4Groups:
        return Int4Groups(self.q[index], self.scale[index], self.zero[index])


def raw_blocks(data: np.ndarray, rows: int) -> torch.Tensor:
    """The raw bytes of a quantized GGUF tensor as a uint8 tensor [rows, bytes per row] (no copy)."""
    with warnings.catch_warnings():  # the mmap is read-only; we only read from it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(data).reshape(rows, -1))


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Two bytes per entry (last dim) -> float32."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    """Low nibbles of each ``width``-byte run, then its high nibbles (gguf's order): uint8 0..15."""
    shape = qs.shape[:-1]
    qs = qs.reshape(*shape, -1, width)
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2).reshape(*shape, -1)


def _blocks(raw: torch.Tensor, kind: str) -> torch.Tensor:
    rows, nbytes = raw.shape
    size = _BLOCK_BYTES[kind]
    if nbytes % size:
        raise ValueError(f"{kind} tensor rows of {nbytes} bytes are not whole blocks of {size}")
    return raw.reshape(rows, nbytes // size, size)


def _q4k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # scales [..., 12] -> 6-bit sub-block scales and mins [..., 8] (gguf's get_scale_min)
    s = scales.reshape(*scales.shape[:-1], 3, 4)
    d, m, m_d = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _q4k_parts(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b = _blocks(raw, "Q4_K")  # [R, nb, 144]
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # [R, nb, 1]
    sc, mn = _q4k_scale_min(b[..., 4:16])
    scale = d * sc.float()  # [R, nb, 8]
    minimum = dmin * mn.float()
    q = _nibbles(b[..., 16:], 32).reshape(*b.shape[:2], 8, GROUP)
    return q, scale, minimum


def dequantize_torch(raw: torch.Tensor, kind: str) -> torch.Tensor | None:
    """Dense float32 [rows, K] of a quantized tensor's raw blocks, or None if ``kind`` has no torch decoder."""
    rows = raw.shape[0]
    if kind == "Q4_0":
        b = _blocks(raw, kind)
        q = _nibbles(b[..., 2:], 16).to(torch.int8) - 8
        return (_f16(b[..., :2]) * q.float()).reshape(rows, -1)
    if kind == "Q4_1":
        b = _blocks(raw, kind)
        q = _nibbles(b[..., 4:], 16).float()
        return (_f16(b[..., :2]) * q + _f16(b[..., 2:4])).reshape(rows, -1)
    if kind == "Q8_0":
        b = _blocks(raw, kind)
        q = b[..., 2:].contiguous().view(torch.int8).float()
        return (q * _f16(b[..., :2])).reshape(rows, -1)
    if kind == "Q4_K":
        q, scale, minimum = _q4k_parts(raw)
        return (scale[..., None] * q.float() - minimum[..., None]).reshape(rows, -1)
    if kind == "Q5_0":  # fp16 d, 32 fifth bits, nibbles: d * (q - 16)
        b = _blocks(raw, kind)
        # bit j of the 4 little-endian bytes: weight j -> 0x10 where set
        high = ((b[..., 2:6, None] >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(*b.shape[:2], 32) << 4
        q = (_nibbles(b[..., 6:], 16) | high).view(torch.int8) - 16
        return (_f16(b[..., :2]) * q.float()).reshape(rows, -1)
    if kind == "Q6_K":  # 128 low-nibble bytes, 64 high-pair bytes, 16 int8 scales, fp16 d
        b = _blocks(raw, kind)
        r, nb = b.shape[:2]
        scale = _f16(b[..., 208:210]) * b[..., 192:208].contiguous().view(torch.int8).float()  # [R, nb, 16]
        ql = b[..., :128].reshape(r, nb, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(2, 1)
        ql = (ql & 0x0F).reshape(r, nb, 8, 32)
        qh = b[..., 128:192].reshape(r, nb, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1)
        qh = (qh & 0x03).reshape(r, nb, 8, 32)
        q = (ql | qh << 4).to(torch.int8) - 32
        return (scale[..., None] * q.reshape(r, nb, 16, 16).float()).reshape(rows, -1)
    return None


def int4_groups(raw: torch.Tensor, kind: str) -> list[Int4Groups]:
    """The tensor as int4 groups (one entry; two for Q8_0, to be summed); ValueError for other types."""
    rows = raw.shape[0]
    if kind == "Q4_0":
        b = _blocks(raw, kind)
        d = _f16(b[..., :2])[..., 0]
        return [Int4Groups(_nibbles(b[..., 2:], 16).reshape(rows, -1), d, torch.zeros_like(d))]
    if kind == "Q4_1":
        b = _blocks(raw, kind)
        d, m = _f16(b[..., :2])[..., 0], _f16(b[..., 2:4])[..., 0]
        return [Int4Groups(_nibbles(b[..., 4:], 16).reshape(rows, -1), d, m + 8 * d)]
    if kind == "Q4_K":
        q, scale, minimum = _q4k_parts(raw)
        scale, minimum = scale.reshape(rows, -1), minimum.reshape(rows, -1)
        return [Int4Groups(q.reshape(rows, -1), scale, 8 * scale - minimum)]
    if kind == "Q8_0":
        b = _blocks(raw, kind)
        d = _f16(b[..., :2])[..., 0]
        u = (b[..., 2:].reshape(rows, -1) ^ 0x80)  # int8 q + 128 as uint8 (flip the sign bit) = 16 hi + lo
        # d*(16 hi + lo - 128) = [(hi - 8) * 16d + 8d] + [(lo - 8) * d + 0]
        return [Int4Groups(u >> 4, 16 * d, 8 * d), Int4Groups(u & 0x0F, d, torch.zeros_like(d))]
    raise ValueError(f"GGUF type {kind} has no int4 form (supported: {INT4_TYPES + SPLIT_INT4_TYPES})")


# the types the engine's native decoder takes (kernels.h, WeightKind)
NATIVE_DEQUANTIZE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def dequantize_native(raw: torch.Tensor, kind: str) -> torch.Tensor | None:
    """Dense float32 [rows, K] of a quantized tensor's raw blocks [rows, bytes] by the engine's
    native decoder (bitwise ``gguf.quants``), or None where the engine wheel has no CPU kernels."""
    try:
        from deepinfer_engine import _cpu_kernels
    except ImportError:
        return None
    return torch.from_numpy(_cpu_kernels.dequantize((kind, np.ascontiguousarray(raw.numpy()))))


def dequantize(tensor: Any) -> torch.Tensor:
    """Dense float32 weights of a ``gguf.ReaderTensor`` in GGUF's [rows, K] order (rows = outer dims)."""
    kind = tensor.tensor_type.name
    shape = [int(d) for d in reversed(list(tensor.shape))]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    if kind in ("F32", "F16", "BF16"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            raw = np.asarray(tensor.data)
            if kind == "BF16":
                t = torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)
            else:
                t = torch.from_numpy(raw.view(np.float32 if kind == "F32" else np.float16))
        return t.float().reshape(shape)
    out = None
    if kind in NATIVE_DEQUANTIZE_TYPES or kind in _BLOCK_BYTES:
        blocks = raw_blocks(tensor.data, rows)
        if kind in NATIVE_DEQUANTIZE_TYPES:
            out = dequantize_native(blocks, kind)
        if out is None and kind in _BLOCK_BYTES:
            out = dequantize_torch(blocks, kind)
    if out is None:
        from gguf.quants import dequantize as gguf_dequantize

        out = torch.from_numpy(np.ascontiguousarray(gguf_dequantize(tensor.data, tensor.tensor_type),
                                                    dtype=np.float32))
    return out.reshape(shape)
