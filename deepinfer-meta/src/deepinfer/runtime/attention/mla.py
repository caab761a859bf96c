"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache, in plain torch.

Cache layout per layer: ``[1, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``: each
token keeps its normalised latent ``c`` (kv_lora_rank values) and its rotated rope key (shared by
every head), instead of per-head keys and values. ``kv_b`` ([heads, nope + v, kv_lora_rank]: the
up-projection of the latent into each head's non-rotary key and value) is applied two ways:

- decode rows (one query token): absorbed. ``q_nope`` is projected into the latent space
  (``q_nope @ W_uk``), attention runs over the latent cache itself (scores ``q_lat . c + q_pe .
  k_pe``, one key "head" shared by all query heads), and the weighted latent is projected out by
  ``W_uv``: no per-head key or value is ever materialised for the context. On CUDA the latent
  attention is the Triton kernel of ``attention.triton_mla`` (the decode graphs run it too);
  elsewhere torch's SDPA with one key head.
- prefill rows: the context's latents are expanded into per-head keys and values (one matmul),
  then ordinary causal attention.

Both give the same scores: ``q_nope . (W_uk c) = (q_nope W_uk) . c``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.runtime.attention.metadata import AttentionMetadata
from deepinfer.runtime.attention.torch_paged import _decode_layout


def _triton_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def write_latent(cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``latent`` ([T, kv_lora_rank + rope]) at its slots of the layer's latent ``cache``."""
    cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping, latent)


def mla_paged_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, cache: torch.Tensor,
                        meta: AttentionMetadata, kv_b: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention output [T, heads, v_head_dim] of the step's rows.

    ``q_nope`` [T, H, nope], ``q_pe`` [T, H, rope] (rotated), ``latent`` [T, C + rope] (this step's
    normalised latents and rotated rope keys, written to the cache here), ``kv_b`` [H, nope + v, C]."""
    write_latent(cache, latent, meta.slot_mapping)
    flat = cache.view(-1, cache.shape[-1])  # [slots, C + rope]
    heads, nope = q_nope.shape[1], q_nope.shape[2]
    c_dim = kv_b.shape[2]
    w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]  # [H, nope, C], [H, v, C]
    v_dim = w_uv.shape[1]
    out = q_nope.new_empty(q_nope.shape[0], heads, v_dim)
    bs = meta.block_size

    if meta.decode_seq_idx.size and q_nope.is_cuda and _triton_available():
        # the Triton MLA decode kernel (attention.triton_mla), as the decode graphs run it
        from deepinfer.runtime.attention.triton_mla import choose_mla_splits, mla_decode, num_sms

        dec = torch.from_numpy(meta.decode_seq_idx).to(q_nope.device)
        rows = torch.from_numpy(meta.query_start_loc[meta.decode_seq_idx]).to(q_nope.device)
        q = torch.cat([torch.einsum("bhd,hdc->bhc", q_nope[rows], w_uk), q_pe[rows]], dim=-1)
        max_len = int(meta.seq_lens[meta.decode_seq_idx].max())
        o_lat = mla_decode(q, cache, meta.block_tables[dec], meta.seq_lens_t[dec], c_dim, scale,
                           choose_mla_splits(q.shape[0], heads, max_len, num_sms(q.device)))
        out[rows] = torch.einsum("bhc,hvc->bhv", o_lat.to(q_nope.dtype), w_uv)
    elif meta.decode_seq_idx.size:
        rows, bt, max_len, valid = _decode_layout(meta, q_nope.device)
        b = bt.shape[0]
        slots = (bt[:, :, None] * bs + torch.arange(bs, device=bt.device)).reshape(b, -1)[:, :max_len]
        ctx = flat[slots]  # [B, S, C + rope] (a copy)
        mask = None
        if valid is not None:  # unwritten slots past a sequence's length: zero, then masked out
            ctx.masked_fill_(~valid[:, :, None], 0.0)
            mask = valid[:, None, None, :]
        q_lat = torch.einsum("bhd,hdc->bhc", q_nope[rows], w_uk)  # absorbed: query in latent space
        query = torch.cat([q_lat, q_pe[rows]], dim=-1).unsqueeze(2)  # [B, H, 1, C + rope]
        key = ctx.unsqueeze(1)  # [B, 1, S, C + rope]: one latent "head" for every query head
        o_lat = F.scaled_dot_product_attention(query, key, key[..., :c_dim], attn_mask=mask, scale=scale,
                                               enable_gqa=True)  # [B, H, 1, C]
        out[rows] = torch.einsum("bhc,hvc->bhv", o_lat.squeeze(2), w_uv)

    qsl, lens = meta.query_start_loc, meta.seq_lens
    for i in meta.prefill_seq_idx.tolist():
        start, end = int(qsl[i]), int(qsl[i + 1])
        qlen, slen = end - start, int(lens[i])
        if qlen == slen:
            ctx = latent[start:end]
        else:
            nblk = (slen + bs - 1) // bs
            slots = (meta.block_tables[i, :nblk, None] * bs + torch.arange(bs, device=flat.device)).reshape(-1)
            ctx = flat[slots[:slen]]
        kv = torch.einsum("sc,hdc->hsd", ctx[:, :c_dim], kv_b)  # [H, S, nope + v]: expanded
        k = torch.cat([kv[..., :nope], ctx[None, :, c_dim:].expand(heads, -1, -1)], dim=-1)
        q = torch.cat([q_nope[start:end], q_pe[start:end]], dim=-1).transpose(0, 1)  # [H, L, nope + rope]
        if qlen == slen:
            o = F.scaled_dot_product_attention(q[None], k[None], kv[None, ..., nope:], is_causal=True, scale=scale)
        else:  # query row r sits at position slen - qlen + r and sees keys 0..that position
            qpos = torch.arange(slen - qlen, slen, device=q.device)[:, None]
            mask = torch.arange(slen, device=q.device)[None, :] <= qpos
            o = F.scaled_dot_product_attention(q[None], k[None], kv[None, ..., nope:], attn_mask=mask, scale=scale)
        out[start:end] = o[0].transpose(0, 1)
    return out
