"""GGUF quantized blocks regrouped at load into the planes the GPU kernels (``gguf_gemv``) read.

A GGUF block interleaves its scales with its codes (Q4_K: 4 bytes of fp16, 12 of packed 6-bit
scales, 128 of nibbles), so a warp reading one row would load a mix of both. The planes separate
them, one 2-D tensor per field, each row-major over the output rows:

* ``codes``: 4-bit types (Q4_0, Q4_1, Q4_K) as one byte per two weights, ``[N, K/2]`` uint8: byte
  ``j`` holds column ``j`` in its low nibble and column ``j + K/2`` in its high one (so one load of
  consecutive bytes feeds two runs of consecutive columns: coalesced, no shuffles). Other types as
  one byte per weight, ``[N, K]`` (Q8_0: int8; Q5_K 0..31 and Q6_K 0..63: uint8 — wider than their
  5/6 bits, a bandwidth cost on the layers a Q4_K_M file stores that way).
* ``scale`` ``[N, K/G]`` per group of G weights (32; 16 for Q6_K): fp16 ``d`` for Q4_0/Q4_1/Q8_0,
  the 6-bit (uint8) or int8 sub-block scales for the K-quants.
* ``minimum`` ``[N, K/G]`` or None: fp16 ``m`` (Q4_1) or the 6-bit sub-block mins (Q4_K, Q5_K).
* ``d``/``dmin`` ``[N, K/256]`` fp16: the K-quants' super-block scales (None for the others).

The kernels compute each weight with gguf.quants' float32 operations in its order:
``d*(q-8)`` (Q4_0), ``d*q + m`` (Q4_1), ``d*q`` (Q8_0), ``(d*sc)*q - dmin*mn`` (Q4_K, Q5_K),
``(d*sc)*(q-32)`` (Q6_K).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from deepinfer.runtime.kernels.gguf_blocks import _nibbles, _q4k_scale_min

# type -> (packed nibbles, group size, super-block size or 0, has a minimum, code bias)
KINDS: dict[str, tuple[bool, int, int, bool, int]] = {
    "Q4_0": (True, 32, 0, False, 8),
    "Q4_1": (True, 32, 0, True, 0),
    "Q8_0": (False, 32, 0, False, 0),
    "Q4_K": (True, 32, 256, True, 0),
    "Q5_K": (False, 32, 256, True, 0),
    "Q6_K": (False, 16, 256, False, 32),
}
GPU_TYPES = tuple(KINDS)
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


@dataclass
class GGUFPlanes:
    """One quantized weight [N, K] as the kernels' planes (see the module docstring)."""

    kind: str
    n: int
    k: int
    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None = None
    d: torch.Tensor | None = None
    dmin: torch.Tensor | None = None
    # Q4_K's scales packed for the one-row GEMV (``kpack``): int32 [N, ng/2] and int32 [N, K/256]
    kpack_sm: torch.Tensor | None = None
    kpack_dd: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}

    def with_tensors(self, tensors: dict[str, torch.Tensor], n: int | None = None) -> GGUFPlanes:
        """These planes with the named tensors replaced (and ``n`` rows where given)."""
        changes: dict[str, Any] = dict(tensors)
        if n is not None:
            changes["n"] = n
        return replace(self, **changes)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> GGUFPlanes:
        """The same planes with ``fn`` applied to each tensor (device moves, row selections)."""
        return self.with_tensors({name: fn(t) for name, t in self.tensors().items()})

    def permute_rows(self, index: torch.Tensor) -> GGUFPlanes:
        return self.map(lambda t: t[index].contiguous())

    def rows(self, start: int, stop: int) -> GGUFPlanes:
        """Output rows [start, stop) (a tensor-parallel column shard)."""
        return self.with_tensors({name: t[start:stop].contiguous() for name, t in self.tensors().items()},
                                 n=stop - start)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def dequantize(self) -> torch.Tensor:
        """Dense float32 [N, K] with the kernels' operations (torch, any device)."""
        packed, g, sb, has_min, bias = KINDS[self.kind]
        q = self.codes
        if packed:
            q = torch.cat((q & 0x0F, q >> 4), dim=1)
        q = q.float() - bias
        s = self.scale.float().repeat_interleave(g, 1)
        if sb:
            assert self.d is not None
            s = self.d.float().repeat_interleave(sb, 1) * s
        w = s * q
        if has_min:
            assert self.minimum is not None
            mn = self.minimum.float().repeat_interleave(g, 1)
            if sb:
                assert self.dmin is not None
                w = w - self.dmin.float().repeat_interleave(sb, 1) * mn
            else:
                w = w + mn
        return w


def cat_rows(parts: list[GGUFPlanes]) -> GGUFPlanes:
    """Planes of the same type and K stacked along the output rows (a fused qkv or gate/up)."""
    first = parts[0]
    if any(p.kind != first.kind or p.k != first.k for p in parts):
        raise ValueError(f"cat_rows: parts of different types or widths: {[(p.kind, p.k) for p in parts]}")
    cat = {name: torch.cat([p.tensors()[name] for p in parts]) for name in first.tensors()}
    return first.with_tensors(cat, n=sum(p.n for p in parts))


def _pack_halves(q: torch.Tensor) -> torch.Tensor:
    half = q.shape[1] // 2
    return (q[:, :half] | (q[:, half:] << 4)).contiguous()


def regroup(raw: torch.Tensor, kind: str) -> GGUFPlanes:
    """The planes of a quantized tensor's raw GGUF bytes ``raw`` [rows, bytes per row] (uint8, CPU)."""
    if kind not in KINDS:
        raise ValueError(f"GGUF type {kind} has no GPU kernel (supported: {', '.join(GPU_TYPES)})")
    rows, nbytes = raw.shape
    per = BLOCK_BYTES[kind]
    if nbytes % per:
        raise ValueError(f"{kind} tensor rows of {nbytes} bytes are not whole blocks of {per}")
    block = 256 if kind.endswith("_K") else 32
    k = nbytes // per * block
    if kind != "Q8_0" and k % 64:
        raise ValueError(f"{kind} rows of {k} weights: the GPU layout needs a multiple of 64")
    if kind in ("Q4_0", "Q4_1", "Q8_0"):
        b = raw.reshape(rows, -1, per)
        d = b[..., 0:2].contiguous().view(torch.float16).reshape(rows, -1)
        if kind == "Q8_0":
            codes = b[..., 2:].contiguous().view(torch.int8).reshape(rows, k)
            return GGUFPlanes(kind, rows, k, codes, d)
        off = 2 if kind == "Q4_0" else 4
        q = _nibbles(b[..., off:], 16).reshape(rows, k)
        m = b[..., 2:4].contiguous().view(torch.float16).reshape(rows, -1) if kind == "Q4_1" else None
        return GGUFPlanes(kind, rows, k, _pack_halves(q), d, m)
    b = raw.reshape(rows, -1, per)
    nb = b.shape[1]

    def shifts(*v: int) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.uint8, device=raw.device).reshape(len(v), 1)

    if kind == "Q6_K":
        ql = b[..., :128].reshape(rows, nb, 2, 1, 64) >> shifts(0, 4)
        ql = (ql & 0x0F).reshape(rows, nb, 8, 32)
        qh = b[..., 128:192].reshape(rows, nb, 2, 1, 32) >> shifts(0, 2, 4, 6)
        qh = (qh & 0x03).reshape(rows, nb, 8, 32)
        q = (ql | qh << 4).reshape(rows, k)
        sc = b[..., 192:208].contiguous().view(torch.int8).reshape(rows, -1)
        d = b[..., 208:210].contiguous().view(torch.float16).reshape(rows, nb)
        return GGUFPlanes(kind, rows, k, q.contiguous(), sc, d=d)
    d = b[..., 0:2].contiguous().view(torch.float16).reshape(rows, nb)
    dmin = b[..., 2:4].contiguous().view(torch.float16).reshape(rows, nb)
    sc, mn = _q4k_scale_min(b[..., 4:16])
    sc, mn = sc.reshape(rows, -1).contiguous(), mn.reshape(rows, -1).contiguous()
    if kind == "Q4_K":
        q = _nibbles(b[..., 16:], 32).reshape(rows, k)
        return kpack(GGUFPlanes(kind, rows, k, _pack_halves(q), sc, mn, d, dmin))
    # Q5_K: 32 bytes of fifth bits (bit i of byte l: weight 32 i + l), then 128 bytes of nibbles
    qh = b[..., 16:48].reshape(rows, nb, 1, 32) >> shifts(*range(8))
    ql = b[..., 48:176].reshape(rows, nb, 4, 1, 32) >> shifts(0, 4)
    q = ((ql & 0x0F).reshape(rows, nb, 8, 32) | ((qh & 1) << 4)).reshape(rows, k)
    return GGUFPlanes(kind, rows, k, q.contiguous(), sc, mn, d, dmin)



def kpack(w: GGUFPlanes) -> GGUFPlanes:
    """Q4_K planes plus their scales packed as the one-row GEMV reads them (``DEEPINFER_GGUF_KPACK``):
    a tile row of codes holds columns ``c`` (low nibbles) and ``c + K/2`` (high), whose groups
    ``g`` and ``g + ng/2`` then need a scale, a min, ``d`` and ``dmin`` each: eight loads. Packed,
    ``kpack_sm[r, g]`` holds bytes (scale g, min g, scale g + ng/2, min g + ng/2) and ``kpack_dd[r, b]``
    the float16 bits of ``d`` (low half) and ``dmin`` (high half): three loads. Other types, and
    planes already packed, are returned as they are."""
    if w.kind != "Q4_K" or w.kpack_sm is not None:
        return w
    assert w.minimum is not None and w.d is not None and w.dmin is not None
    half = w.scale.shape[1] // 2
    sm = torch.stack((w.scale[:, :half], w.minimum[:, :half], w.scale[:, half:], w.minimum[:, half:]), dim=2)
    dd = torch.stack((w.d, w.dmin), dim=2)
    return replace(w, kpack_sm=sm.contiguous().view(torch.int32).reshape(w.n, half),
                   kpack_dd=dd.contiguous().view(torch.int32).reshape(w.n, -1))
