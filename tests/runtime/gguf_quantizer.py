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
    """Raw GGUF blocks of float weights ``w`` [rows, K] (K a multiple of the type's block: ValueError
    otherwise, e.g. SmolLM2's K = 576 for the 256-wide K-quants)."""
    block = 256 if kind.endswith("_K") else 32
    if w.dim() != 2 or w.shape[1] % block:
        raise ValueError(f"quantize: {kind} packs rows of whole {block}-weight blocks; a weight of shape "
                         f"{tuple(w.shape)} has K = {w.shape[-1]}, not a multiple of {block}")
    w = w.float()
    rows = w.shape[0]
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


def q4_k_m_type(tensor: str, layer: int, layers: int) -> str:
    """llama.cpp's Q4_K_M choice for a Llama projection (its ``use_more_bits``): attn_v and ffn_down
    in Q6_K on the first and last eighth of the layers and every third one between, else Q4_K."""
    more = layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
    return "Q6_K" if tensor in ("v", "down") and more else "Q4_K"


def quantize_model_projections(model: torch.nn.Module, scheme: str) -> dict[str, int]:
    """Swap a LlamaForCausalLM's projections and LM head for ``GGUFLinearCUDA`` layers holding its
    own (dense) weights quantized by ``scheme`` ("q4_0", "q8_0", "q4_1", "q4_k_m"); returns the count
    of tensors per type. For benchmarks of random-weight shapes (no GGUF file written)."""
    from deepinfer.runtime.kernels.gguf_layout import regroup
    from deepinfer.runtime.models.gguf_linear import GGUFLinearCUDA, chain_model

    counts: dict[str, int] = {}
    layers = model.layers

    def planes(w: torch.Tensor, kind: str):  # type: ignore[no-untyped-def]
        counts[kind] = counts.get(kind, 0) + 1
        return regroup(quantize(w, kind), kind)

    def kind_of(tensor: str, i: int) -> str:
        return q4_k_m_type(tensor, i, len(layers)) if scheme == "q4_k_m" else scheme.upper()

    with torch.no_grad():
        for i, layer in enumerate(layers):
            q, kv = layer.split[0], layer.split[1]
            w = layer.qkv_proj.weight
            parts = [planes(w[:q + kv], kind_of("qk", i)), planes(w[q + kv:], kind_of("v", i))]
            layer.qkv_proj = GGUFLinearCUDA(parts, layer.qkv_proj.bias)
            layer.o_proj = GGUFLinearCUDA([planes(layer.o_proj.weight, kind_of("o", i))])
            layer.gate_up_proj = GGUFLinearCUDA([planes(layer.gate_up_proj.weight, kind_of("gate_up", i))])
            layer.down_proj = GGUFLinearCUDA([planes(layer.down_proj.weight, kind_of("down", i))])
        head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        model.quantized_head = GGUFLinearCUDA([planes(head, "Q6_K" if scheme == "q4_k_m" else scheme.upper())])
        model.lm_head = None
    chain_model(model)  # as the GGUF loader does (DEEPINFER_GGUF_DENSE_ROWS)
    return counts
