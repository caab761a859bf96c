"""Paged attention in plain torch (the CPU path; also a reference on any device).

KV cache layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``. New keys and
values are scattered into their slots, then each sequence attends over the blocks of its block
table. Decode rows (one query token) are batched into one SDPA call over gathered, padded
contexts; prefill rows (several query tokens, possibly after a cached prefix) run one SDPA call
each with a bottom-right-aligned causal mask (on CPU: one call per ``CPU_QUERY_CHUNK`` query
rows, and a whole prompt attends over its own k/v rows without reading them back from the cache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.runtime.attention.metadata import AttentionMetadata


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``k``/``v`` ([T, kv_heads, head_dim]) at their slots of ``kv_cache``."""
    _, nb, bs, kvh, d = kv_cache.shape
    flat = kv_cache.view(2, nb * bs, kvh, d)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def _gather_context(cache: torch.Tensor, block_row: torch.Tensor, length: int) -> torch.Tensor:
    # cache [nb, bs, kvh, d]; returns [kvh, length, d]
    bs = cache.shape[1]
    nblk = (length + bs - 1) // bs
    ctx = cache[block_row[:nblk]].reshape(nblk * bs, cache.shape[2], cache.shape[3])[:length]
    return ctx.transpose(0, 1)


def _decode_layout(meta: AttentionMetadata, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
    # Computed once per step and shared by every layer (cached on the metadata object).
    cached = getattr(meta, "_decode_layout", None)
    if cached is not None:
        return cached
    dec = meta.decode_seq_idx
    rows = torch.from_numpy(meta.query_start_loc[dec]).to(device)
    dec_lens = meta.seq_lens[dec]
    max_len = int(dec_lens.max())
    nblk = (max_len + meta.block_size - 1) // meta.block_size
    bt = meta.block_tables[torch.from_numpy(dec).to(device)][:, :nblk]
    mask = None
    if int(dec_lens.min()) != max_len:
        mask = torch.arange(max_len, device=device)[None, :] < torch.from_numpy(dec_lens).to(device)[:, None]
    meta._decode_layout = (rows, bt, max_len, mask)  # type: ignore[attr-defined]
    return meta._decode_layout  # type: ignore[attr-defined]


# Query rows per attention call in a long CPU prefill. torch's CPU flash-attention kernel skips
# masked key blocks only 512 keys at a time, so one causal call over a 512-token prompt costs as
# much as a non-causal one; calls over 64 query rows each (keys up to the last row's position)
# skip the masked half: 512 tokens 7.0 -> 4.9 ms a layer on one thread, the same values.
CPU_QUERY_CHUNK = 64


def _causal_chunks(meta: AttentionMetadata, qlen: int, slen: int, dtype: torch.dtype, device: torch.device
                   ) -> list[tuple[int, int, torch.Tensor]]:
    """(first row, end row, additive mask [rows, keys]: 0 or -inf) of each query chunk of a
    prefill sequence whose ``qlen`` query rows end its ``slen`` tokens. Computed once per step and
    shared by every layer; additive, because SDPA turns a boolean mask into one at every call."""
    cache: dict[tuple[int, int], list[tuple[int, int, torch.Tensor]]] = meta.__dict__.setdefault("_chunks", {})
    chunks = cache.get((qlen, slen))
    if chunks is None:
        past = slen - qlen
        key = torch.arange(slen, device=device)
        chunks = []
        for first in range(0, qlen, CPU_QUERY_CHUNK):
            last = min(first + CPU_QUERY_CHUNK, qlen)
            rows = torch.arange(past + first, past + last, device=device)[:, None]
            hidden = key[None, :past + last] > rows
            chunks.append((first, last, torch.zeros(hidden.shape, dtype=dtype, device=device)
                           .masked_fill_(hidden, float("-inf"))))
        cache[(qlen, slen)] = chunks
    return chunks


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of ``q`` ([T, heads, d]) over each sequence's cached context; returns [T, heads, d]."""
    write_kv(kv_cache, k, v, meta.slot_mapping)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_heads = q.shape[1]
    qsl, lens = meta.query_start_loc, meta.seq_lens
    # A pure decode step (one query row per sequence, no padding rows): rows are 0..B-1 in
    # order, so no gather of q nor scatter into a separate output is needed.
    decode_only = meta.prefill_seq_idx.size == 0 and meta.decode_seq_idx.size == q.shape[0] > 0
    out = torch.empty_like(q) if not decode_only else q  # q: never written when decode_only

    if meta.decode_seq_idx.size:
        rows, bt, max_len, valid = _decode_layout(meta, q.device)
        # [B, nblk, bs, kvh, d] -> [B, S, kvh, d] (fresh copies) -> [B, kvh, S, d]
        kg = k_cache[bt].flatten(1, 2)[:, :max_len]
        vg = v_cache[bt].flatten(1, 2)[:, :max_len]
        mask = None
        if valid is not None:
            # Slots past a sequence's length may never have been written (the CPU cache is not
            # zero-filled): zero them so a NaN there cannot leak through 0 * NaN in SDPA.
            invalid = ~valid[:, :, None, None]
            kg.masked_fill_(invalid, 0.0)
            vg.masked_fill_(invalid, 0.0)
            mask = valid[:, None, None, :]
        kc, vc = kg.transpose(1, 2), vg.transpose(1, 2)
        qd = (q if decode_only else q[rows]).unsqueeze(2)  # [B, heads, 1, d]
        o = F.scaled_dot_product_attention(qd, kc, vc, attn_mask=mask, scale=scale,
                                           enable_gqa=kc.shape[1] != num_heads)
        if decode_only:
            return o.squeeze(2)
        out[rows] = o.squeeze(2)

    cpu = q.device.type == "cpu"
    for i in meta.prefill_seq_idx.tolist():
        start, end = int(qsl[i]), int(qsl[i + 1])
        qlen, slen = end - start, int(lens[i])
        if cpu and qlen == slen:  # a whole prompt: its keys/values are this step's own rows
            kc, vc = k[start:end].transpose(0, 1).unsqueeze(0), v[start:end].transpose(0, 1).unsqueeze(0)
        else:
            kc = _gather_context(k_cache, meta.block_tables[i], slen).unsqueeze(0)
            vc = _gather_context(v_cache, meta.block_tables[i], slen).unsqueeze(0)
        qp = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, heads, L, d]
        gqa = kc.shape[1] != num_heads
        if cpu and qlen > CPU_QUERY_CHUNK:
            for first, last, mask in _causal_chunks(meta, qlen, slen, q.dtype, q.device):
                keys = slen - qlen + last  # the chunk's last row sees keys 0..keys-1
                o = F.scaled_dot_product_attention(qp[:, :, first:last], kc[:, :, :keys], vc[:, :, :keys],
                                                   attn_mask=mask, scale=scale, enable_gqa=gqa)
                out[start + first:start + last] = o[0].transpose(0, 1)
            continue
        if qlen == slen:
            o = F.scaled_dot_product_attention(qp, kc, vc, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            # query row r sits at position slen - qlen + r and sees keys 0..that position
            qpos = torch.arange(slen - qlen, slen, device=q.device)[:, None]
            mask = torch.arange(slen, device=q.device)[None, :] <= qpos
            o = F.scaled_dot_product_attention(qp, kc, vc, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[start:end] = o[0].transpose(0, 1)
    return out
