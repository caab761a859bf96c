"""Test/bench helper: quantize float weights to GGUF blocks with torch (any device; fast on a GPU).

``quantize(w, kind)`` -> raw GGUF bytes [rows, bytes per row] (uint8, ``w``'s device) for Q4_0, Q4_1,
Q8_0, Q4_K, Q5_K and Q6_K. Simple round-to-nearest per block (llama.cpp's K-quant search for the
best scales is not reproduced): the blocks are valid GGUF whatever their quality, and
``gguf.quants.dequantize`` reads them (tests compare against it). gguf's own numpy quantizer covers
only Q4_0/Q4_1/Q8_0 and takes minutes for an 8B model; this takes seconds on the H200.
"""

from __future__ import annotations

import torch


def _f16_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).contiguous().view(torch.uint8).reshape(*t.shape, 2)


def _halves(q: torch.Tensor, width: int) -> torch.Tensor:
    """Codes [..., 2*width*n] -> bytes [..., width*n]: each run of 2*width codes as low then high nibbles."""
    q = q.reshape(*q.shape[:-1], -1, 2, width)
    return (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(*q.shape[:-3], -1)


def _safe_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.where(b != 0, a / torch.where(b != 0, b, torch.ones_like(b)), torch.zeros_like(a))


def _k_scale_bytes(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """6-bit scales and mins [..., 8] -> gguf's 12 packed bytes (inverse of gguf_blocks._q4k_scale_min)."""
    d = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    m = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    md = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return torch.cat((d, m, md), dim=-1)


def _k_min_scales(w: torch.Tensor, levels: int) -> tuple[torch.Tensor, ...]:
    """w [R, nb, 8, 32] -> (d, dmin [R, nb] fp16-rounded, sc, mn [R, nb, 8] uint8, q [R, nb, 8, 32] uint8)."""
    lo = w.amin(-1).clamp(max=0)
    s = (w.amax(-1) - lo) / levels
    d = (s.amax(-1) / 63).half().float()
    dmin = ((-lo).amax(-1) / 63).half().float()
    sc = _safe_div(s, d[..., None]).round().clamp(0, 63)
    mn = _safe_div(-lo, dmin[..., None]).round().clamp(0, 63)
    step = (d[..., None] * sc)[..., None]
    q = _safe_div(w + (dmin[..., None] * mn)[..., None], step).round().clamp(0, levels)
    return d, dmin, sc.to(torch.uint8), mn.to(torch.uint8), q.to(torch.uint8)


def quantize(w: torch.Tensor, kind: str) -> torch.Tensor:
    """Raw GGUF blocks of float weights ``w`` [rows, K] (K a multiple of the type's block)."""
    w = w.float()
    rows, k = w.shape
    if kind == "Q8_0":
        b = w.reshape(rows, -1, 32)
        d = (b.abs().amax(-1) / 127).half().float()
        q = _safe_div(b, d[..., None]).round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
        return torch.cat((_f16_bytes(d), q), -1).reshape(rows, -1)
    if kind == "Q4_0":
        b = w.reshape(rows, -1, 32)
        idx = b.abs().argmax(-1, keepdim=True)
        d = (b.gather(-1, idx)[..., 0] / -8).half().float()
        q = (_safe_div(b, d[..., None]) + 8.5).floor().clamp(0, 15).to(torch.uint8)
        return torch.cat((_f16_bytes(d), _halves(q, 16)), -1).reshape(rows, -1)
    if kind == "Q4_1":
        b = w.reshape(rows, -1, 32)
        lo, hi = b.amin(-1), b.amax(-1)
        d = ((hi - lo) / 15).half().float()
        m = lo.half().float()
        q = _safe_div(b - m[..., None], d[..., None]).round().clamp(0, 15).to(torch.uint8)
        return torch.cat((_f16_bytes(d), _f16_bytes(m), _halves(q, 16)), -1).reshape(rows, -1)
    if kind in ("Q4_K", "Q5_K"):
        b = w.reshape(rows, -1, 8, 32)
        d, dmin, sc, mn, q = _k_min_scales(b, 15 if kind == "Q4_K" else 31)
        head = torch.cat((_f16_bytes(d), _f16_bytes(dmin), _k_scale_bytes(sc, mn)), -1)
        q = q.reshape(rows, -1, 256)
        if kind == "Q4_K":
            return torch.cat((head, _halves(q, 32)), -1).reshape(rows, -1)
        bits = (q >> 4).reshape(rows, -1, 8, 32).to(torch.int32)
        qh = (bits << torch.arange(8, device=w.device).reshape(8, 1)).sum(-2).to(torch.uint8)
        return torch.cat((head, qh, _halves(q & 15, 32)), -1).reshape(rows, -1)
    if kind == "Q6_K":
        b = w.reshape(rows, -1, 16, 16)
        idx = b.abs().argmax(-1, keepdim=True)
        s = b.gather(-1, idx)[..., 0] / -32  # [R, nb, 16]
        big = s.abs().argmax(-1, keepdim=True)
        d = (s.gather(-1, big)[..., 0] / -128).half().float()
        sc = _safe_div(s, d[..., None]).round().clamp(-128, 127)
        q = (_safe_div(b, (d[..., None] * sc)[..., None]).round() + 32).clamp(0, 63).to(torch.uint8)
        q = q.reshape(rows, -1, 2, 128)  # two halves of 128 weights
        ql = ((q[..., :64] & 15) | ((q[..., 64:] & 15) << 4)).reshape(rows, -1, 128)
        hi = (q >> 4).reshape(rows, -1, 2, 4, 32).to(torch.int32)
        qh = (hi << (2 * torch.arange(4, device=w.device)).reshape(4, 1)).sum(-2).to(torch.uint8).reshape(rows, -1, 64)
        scales = sc.to(torch.int8).view(torch.uint8)
        return torch.cat((ql, qh, scales, _f16_bytes(d)), -1).reshape(rows, -1)
    raise ValueError(f"quantize: no quantizer for {kind}")
