"""Run by test_batch_invariance.py in a subprocess with TRITON_INTERPRET=1 (set before triton loads):
the batch-invariant Triton kernels of deterministic=True on CUDA, on the CPU.

- invariant_linear / invariant_rms_norm match a float64 / torch reference, and every output row
  is bitwise the same computed alone or among 2..70 rows (the kernels do not depend on the row
  count). In the interpreter a tile's product is numpy's matmul, whose BLAS rounds a tile's
  edge rows differently from its first ones, so the linear rows are compared at the same
  position within their row tile (offsets that are multiples of BLOCK_M); the GPU's MMA has no
  such edge (the H200 test compares every row: test_batch_invariance_gpu.py);
- the attention kernel in its batch-invariant mode gives a prompt's query rows bitwise the same
  prefilled as one chunk, beside other sequences, or chunked (chunk boundaries at multiples of
  the tile's 4 query tokens, for the interpreter's matmul as above; on the H200 any chunking
  and one row per step are compared).
"""

from __future__ import annotations

import numpy as np
import torch
from deepinfer.runtime.attention import torch_paged, triton_paged
from deepinfer.runtime.attention.metadata import build_attention_metadata
from deepinfer.runtime.kernels.batch_invariant import BLOCK_M, invariant_linear, invariant_rms_norm
from deepinfer.runtime.models.llama import RMSNorm

gen = torch.Generator().manual_seed(0)

# ---- linear: reference, and rows independent of the batch ------------------------------------
for n, k, bias in ((200, 96, False), (67, 160, True)):  # partial N and K tiles
    x = torch.randn(70, k, generator=gen)  # 70 rows: 3 row tiles of BLOCK_M = 32
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    full = invariant_linear(x, w, b)
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    assert torch.allclose(full.double(), ref, rtol=1e-5, atol=1e-4), (full.double() - ref).abs().max()
    for rows, start in ((1, 0), (1, BLOCK_M), (2, 2 * BLOCK_M), (5, BLOCK_M), (33, 0), (38, BLOCK_M), (6, 64)):
        part = invariant_linear(x[start:start + rows], w, b)
        assert torch.equal(part, full[start:start + rows]), (n, k, rows, start)
    assert invariant_linear(x[:0], w, b).shape == (0, n)
    batched = invariant_linear(x.view(7, 10, k), w, b)  # leading dimensions kept
    assert torch.equal(batched.view(70, n), full)
assert BLOCK_M < 70

# ---- RMSNorm ---------------------------------------------------------------------------------
norm = RMSNorm(80, 1e-5)
with torch.no_grad():
    norm.weight.copy_(torch.rand(80, generator=gen) + 0.5)
x = torch.randn(37, 80, generator=gen)
ref = norm(x)
norm.batch_invariant = True
got = norm(x)
torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
for rows, start in ((1, 0), (1, 36), (3, 5), (20, 17)):
    assert torch.equal(norm(x[start:start + rows]), got[start:start + rows])
heads = torch.randn(6, 4, 80, generator=gen)[:, 1:3]  # q/k norm input: a non-contiguous head slice
assert torch.equal(norm(heads), invariant_rms_norm(heads.contiguous(), norm.weight, 1e-5))

# ---- attention: a prompt's rows the same however its step is made up -------------------------
H, KVH, D, BS, NB = 8, 2, 64, 16, 40
P = 37  # the prompt of sequence 0: blocks 3, 4, 5
table0 = [3, 4, 5]
k_all, v_all = torch.randn(P, KVH, D, generator=gen), torch.randn(P, KVH, D, generator=gen)
q_all = torch.randn(P, H, D, generator=gen)


def attend(chunks: list[tuple[int, int]], others: bool) -> dict[int, torch.Tensor]:
    """Sequence 0's rows [a, b) for each chunk, one step per chunk; with ``others`` a decode row
    and a 9-token prompt of other sequences share each step. Returns {position: output row}."""
    cache = torch.zeros(2, NB + 1, BS, KVH, D)
    out = {}
    for a, b in chunks:
        q_lens, seq_lens, tables = [b - a], [b], [table0]
        if others:
            q_lens += [1, 9]
            seq_lens += [21, 9]
            tables += [[10, 11], [20]]
        qsl = np.concatenate([[0], np.cumsum(q_lens)])
        slots = [tables[i][p // BS] * BS + p % BS
                 for i, (ql, sl) in enumerate(zip(q_lens, seq_lens, strict=True)) for p in range(sl - ql, sl)]
        bt = np.zeros((len(tables), 3), np.int64)
        for i, t in enumerate(tables):
            bt[i, :len(t)] = t
        meta = build_attention_metadata(slot_mapping=np.array(slots), query_start_loc=qsl,
                                        seq_lens=np.array(seq_lens), block_tables=bt, block_size=BS,
                                        scratch_slot=NB * BS, device=torch.device("cpu"))
        extra = int(qsl[-1]) - (b - a)
        q = torch.cat([q_all[a:b], torch.randn(extra, H, D, generator=gen)])
        k = torch.cat([k_all[a:b], torch.randn(extra, KVH, D, generator=gen)])
        v = torch.cat([v_all[a:b], torch.randn(extra, KVH, D, generator=gen)])
        o = triton_paged.paged_attention(q, k, v, cache, meta, D ** -0.5, batch_invariant=True)
        ref = torch_paged.paged_attention(q, k, v, cache.clone(), meta, D ** -0.5)
        torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)
        for i, pos in enumerate(range(a, b)):
            out[pos] = o[i]
    return out


whole = attend([(0, P)], others=False)
for layout, others in (([(0, P)], True), ([(0, 4), (4, 20), (20, P)], True), ([(0, 8), (8, 12), (12, P)], False)):
    got_rows = attend(layout, others)
    differ = [p for p in range(P) if not torch.equal(got_rows[p], whole[p])]
    assert not differ, (layout[:3], others, differ)
print("ok")
