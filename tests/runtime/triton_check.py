"""Run by test_triton_attention.py in a subprocess with TRITON_INTERPRET=1 (set before triton loads):
the Triton kernel against the torch paged attention on mixed and decode-only batches."""

from __future__ import annotations

import numpy as np
import torch
from deepinfer.runtime.attention import torch_paged, triton_paged
from deepinfer.runtime.attention.metadata import build_attention_metadata

H, KVH, D, BS, NB = 9, 3, 64, 16, 40


def check(q_lens, seq_lens, tables, seed):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, NB + 1, BS, KVH, D, generator=g)
    cache_t = cache.clone()
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    slots = [tables[i][p // BS] * BS + p % BS
             for i, (ql, sl) in enumerate(zip(q_lens, seq_lens, strict=True)) for p in range(sl - ql, sl)]
    bt = np.zeros((len(tables), max(len(t) for t in tables)), np.int64)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = t
    meta = build_attention_metadata(slot_mapping=np.array(slots), query_start_loc=qsl, seq_lens=np.array(seq_lens),
                                    block_tables=bt, block_size=BS, scratch_slot=NB * BS, device=torch.device("cpu"))
    t = int(qsl[-1])
    q, k, v = (torch.randn(t, h, D, generator=g) for h in (H, KVH, KVH))
    ref = torch_paged.paged_attention(q, k, v, cache, meta, D ** -0.5)
    out = triton_paged.paged_attention(q, k, v, cache_t, meta, D ** -0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache_t, cache)  # the same slots were written


# decode (context 37), prefill chunk of 20 after 16 cached tokens, fresh prompt of 5, decode at position 0
check([1, 20, 5, 1], [37, 36, 5, 1], [[3, 4, 5], [10, 11, 12], [20], [30]], 0)
check([1, 1, 1], [37, 5, 17], [[3, 4, 5], [7], [8, 9]], 1)  # decode-only
print("ok")
