"""GGUF quantized blocks regrouped at load into the planes the GPU kernels (``gguf_gemv``) read.

A GGUF block interleaves its scales with its codes (Q4_K: 4 bytes of fp16, 12 of packed 6-bit
scales, 128 of nibbles), so a warp reading one row would load a mix of both. The planes separate
them, one 2-D tensor per field, each row-major over the output rows:

* ``codes``: 4-bit types (Q4_0, Q4_1, Q4_K) as one byte per two weights, ``[N, K/2]`` uint8: byte
  ``j`` holds column ``j`` in its low nibble and column ``j + K/2`` in its high one (so one load of
  consecutive bytes feeds two runs of consecutive columns: coalesced, no shuffles). Q8_0 (int8),
  Q5_K (0..31) and Q6_K (0..63, uint8: wider than their 5/6 bits) as one byte per weight, ``[N, K]``;
  with ``DEEPINFER_GGUF_Q6K_6BIT=1`` at load (experimental: faster at one row, slower at 32; guide
  08) Q6_K as the 4-bit types with its codes' low 4 bits, their high 2 bits in ``high`` (below).
* ``high`` ``[N, K/4]`` uint8 (Q6_K at 6 bits only): the high 2 bits of each code.
  Each 16 bytes ``16 t .. 16 t + 15`` of ``codes`` (a tile row of the one-row GEMV) take the 8
  bytes ``8 t .. 8 t + 7``: byte ``8 t + i`` holds the columns of code bytes ``16 t + i`` (bits
  0-1) and ``16 t + 8 + i`` (bits 2-3), and their partners at ``K/2`` (bits 4-5 and 6-7). One
  8-byte load gives a tile row's 32 high parts, and each 32-bit half, shifted, lines its bytes up
  with a code word's (``gguf_gemv._six_bit_words``); elsewhere byte ``j`` of ``codes`` finds its
  high parts in byte ``8 (j // 16) + j % 8`` at bit ``2 ((j // 8) % 2)`` (+ 4 for the high
  nibble's column), ``gguf_gemv._packed_codes``.
* ``scale`` ``[N, K/G]`` per group of G weights (32; 16 for Q6_K): fp16 ``d`` for Q4_0/Q4_1/Q8_0,
  the int8 sub-block scales for Q6_K.
* ``minimum`` ``[N, K/G]`` or None: fp16 ``m`` (Q4_1).
* ``d`` ``[N, K/256]`` fp16: Q6_K's super-block scales (None for the others).
* Q4_K and Q5_K (``PACKED_SCALE_KINDS``: 6-bit scales and mins per 32, fp16 ``d`` and ``dmin``
  per 256) pack theirs: ``scale`` is int32 ``[N, K/64]``, word ``j`` the bytes (scale j, min j,
  scale j + K/64, min j + K/64), the two groups a 4-bit tile row's low and high nibbles need
  (columns c and c + K/2); ``d`` is int32 ``[N, K/256]``, the float16 bits of ``d`` (low half) and
  ``dmin`` (high half); ``minimum`` and ``dmin`` are None. Three loads give a Q4_K tile row's
  eight values (``gguf_gemv._kpack_update``), in the bytes of the four planes they replace.

The kernels compute each weight with gguf.quants' float32 operations in its order:
``d*(q-8)`` (Q4_0), ``d*q + m`` (Q4_1), ``d*q`` (Q8_0), ``(d*sc)*q - dmin*mn`` (Q4_K, Q5_K),
``(d*sc)*(q-32)`` (Q6_K).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from deepinfer.runtime import switches
from deepinfer.runtime.kernels.gguf_blocks import _nibbles, _q4k_scale_min

# type -> (packed nibbles, group size, super-block size or 0, has a minimum, code bias)
KINDS: dict[str, tuple[bool, int, int, bool, int]] = {
    "Q4_0": (True, 32, 0, False, 8),
    "Q4_1": (True, 32, 0, True, 0),
    "Q8_0": (False, 32, 0, False, 0),
    "Q4_K": (True, 32, 256, True, 0),
    "Q5_K": (False, 32, 256, True, 0),
    "Q6_K": (False, 16, 256, False, 32),  # (at 6 bits: its low nibbles packed, the rest in ``high``)
}
GPU_TYPES = tuple(KINDS)
# the super-block types with mins (Q4_K, Q5_K) pack their scales (the module docstring; the kernels
# test the same rule on their SB and HAS_MIN)
PACKED_SCALE_KINDS = tuple(kind for kind, (_, _, sb, has_min, _) in KINDS.items() if sb and has_min)
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
    high: torch.Tensor | None = None

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

    def four_planes(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """(scale, minimum, d, dmin) one value a group or super-block each: the packed K-quant
        scales (``PACKED_SCALE_KINDS``) unpacked to uint8 / float16, the other types' as stored."""
        if self.kind not in PACKED_SCALE_KINDS:
            return self.scale, self.minimum, self.d, self.dmin
        assert self.d is not None
        sm = self.scale.view(torch.uint8).reshape(self.n, -1, 4)
        dd = self.d.view(torch.float16).reshape(self.n, -1, 2)
        return (torch.cat((sm[..., 0], sm[..., 2]), dim=1), torch.cat((sm[..., 1], sm[..., 3]), dim=1),
                dd[..., 0].contiguous(), dd[..., 1].contiguous())

    @property
    def packed(self) -> bool:
        """Two codes a byte of ``codes`` (columns ``j`` and ``j + K/2``): the 4-bit types, Q6_K at 6 bits."""
        return KINDS[self.kind][0] or self.high is not None

    def code_values(self) -> torch.Tensor:
        """Every weight's code [N, K] (uint8; int8 for Q8_0): nibbles unpacked, Q6_K's high bits joined."""
        q = self.codes
        if not self.packed:
            return q
        if self.high is None:
            return torch.cat((q & 0x0F, q >> 4), dim=1)
        two = self.high.reshape(self.n, -1, 1, 8) >> _HIGH_SHIFTS.to(q.device)  # [N, T, (s, h), i]
        two = (two & 0x03).reshape(self.n, -1, 2, 2, 8).permute(0, 3, 1, 2, 4).reshape(self.n, 2, -1)  # [N, h, K/2]
        return torch.cat(((q & 0x0F) | (two[:, 0] << 4), (q >> 4) | (two[:, 1] << 4)), dim=1)

    def dequantize(self) -> torch.Tensor:
        """Dense float32 [N, K] with the kernels' operations (torch, any device)."""
        _, g, sb, has_min, bias = KINDS[self.kind]
        scale, minimum, d, dmin = self.four_planes()
        q = self.code_values().float() - bias
        s = scale.float().repeat_interleave(g, 1)
        if sb:
            assert d is not None
            s = d.float().repeat_interleave(sb, 1) * s
        w = s * q
        if has_min:
            assert minimum is not None
            mn = minimum.float().repeat_interleave(g, 1)
            if sb:
                assert dmin is not None
                w = w - dmin.float().repeat_interleave(sb, 1) * mn
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
        if switches.enabled("DEEPINFER_GGUF_Q6K_6BIT"):
            return GGUFPlanes(kind, rows, k, _pack_halves(q & 0x0F), sc, d=d, high=_high_parts(q))
        return GGUFPlanes(kind, rows, k, q.contiguous(), sc, d=d)
    d = b[..., 0:2].contiguous().view(torch.float16).reshape(rows, nb)
    dmin = b[..., 2:4].contiguous().view(torch.float16).reshape(rows, nb)
    sc, mn = _q4k_scale_min(b[..., 4:16])
    sc, mn = sc.reshape(rows, -1).contiguous(), mn.reshape(rows, -1).contiguous()
    if kind == "Q4_K":
        q = _nibbles(b[..., 16:], 32).reshape(rows, k)
        return GGUFPlanes(kind, rows, k, _pack_halves(q), *_pack_scales(sc, mn, d, dmin))
    # Q5_K: 32 bytes of fifth bits (bit i of byte l: weight 32 i + l), then 128 bytes of nibbles
    qh = b[..., 16:48].reshape(rows, nb, 1, 32) >> shifts(*range(8))
    ql = b[..., 48:176].reshape(rows, nb, 4, 1, 32) >> shifts(0, 4)
    q = ((ql & 0x0F).reshape(rows, nb, 8, 32) | ((qh & 1) << 4)).reshape(rows, k)
    return GGUFPlanes(kind, rows, k, q.contiguous(), *_pack_scales(sc, mn, d, dmin))


# bit offsets of a ``high`` byte's four 2-bit parts, as [(s, h)] for code byte 16 t + 8 s + i, nibble h
_HIGH_SHIFTS = torch.tensor([0, 4, 2, 6], dtype=torch.uint8).reshape(4, 1)


def _high_parts(codes: torch.Tensor) -> torch.Tensor:
    """Q6_K's ``high`` plane (the module docstring) of its codes [N, K] (0..63)."""
    rows, k = codes.shape
    # the high parts of columns 16 t + 8 s + i (first half: h = 0; second: h = 1) as [N, h, T, s, i]:
    # byte (t, i) gets bits 2 s + 4 h
    two = (codes >> 4).reshape(rows, 2, k // 32, 2, 8).to(torch.int32)
    shift = 2 * torch.arange(2).reshape(1, 1, 1, 2, 1) + 4 * torch.arange(2).reshape(1, 2, 1, 1, 1)
    high = (two << shift.to(codes.device)).sum(dim=(1, 3), dtype=torch.int32)  # [N, T, i]
    return high.to(torch.uint8).reshape(rows, k // 4).contiguous()


def _pack_scales(sc: torch.Tensor, mn: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor
                 ) -> tuple[torch.Tensor, None, torch.Tensor, None]:
    """A K-quant's scale, minimum, d and dmin planes packed (the module docstring): (scale,
    minimum, d, dmin) fields of its ``GGUFPlanes``."""
    rows, half = sc.shape[0], sc.shape[1] // 2
    sm = torch.stack((sc[:, :half], mn[:, :half], sc[:, half:], mn[:, half:]), dim=2)
    dd = torch.stack((d, dmin), dim=2)
    return (sm.contiguous().view(torch.int32).reshape(rows, half), None,
            dd.contiguous().view(torch.int32).reshape(rows, -1), None)
