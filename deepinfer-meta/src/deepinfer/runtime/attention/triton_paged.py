"""Paged attention on CUDA with a Triton kernel of our own (prefill with cached prefix, decode, mixed).

Why our own kernel rather than a library: the runtime's cache layout (``[2, blocks, block_size,
kv_heads, head_dim]`` per layer, block tables from the engine) and its var-len batches are what
FlashInfer / FlashAttention's paged APIs also take, but neither is a dependency we can install
everywhere Triton already is (it ships with torch on Linux CUDA). One kernel covers every step
shape: the grid is (query tiles, kv heads); a tile holds up to BLOCK_Q query tokens of one
sequence times the GQA group of query heads sharing a kv head, so K/V blocks are read once per
tile; softmax is computed online (flash-attention style) over the sequence's blocks, with the
causal limit of each query row. float32 inputs use IEEE dot products (no TF32) so float32 runs
match the CPU path.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from deepinfer.runtime.attention.metadata import AttentionMetadata
from deepinfer.runtime.attention.torch_paged import write_kv
from deepinfer.runtime.attention.triton_softmax import online_softmax_block


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, tile_seq_ptr, tile_start_ptr,
    scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    q_off = tl.load(tile_start_ptr + tile)  # first query index of the tile within its sequence
    q_begin = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)

    M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, M)
    tok = q_off + rows // GROUP_PAD  # query index within the sequence
    head_in_group = rows % GROUP_PAD
    row_ok = (tok < q_len) & (head_in_group < GROUP)
    head = kvh * GROUP + head_in_group
    pos = seq_len - q_len + tok  # absolute position of each query row
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM

    q = tl.load(q_ptr + (q_begin + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, HEAD_DIM_PAD], tl.float32)

    last = tl.minimum(q_off + BLOCK_Q, q_len) - 1
    kv_len = seq_len - q_len + last + 1  # keys the tile's last query row may see
    n = tl.arange(0, BLOCK_SIZE)
    blk = 0
    while blk * BLOCK_SIZE < kv_len:
        block_id = tl.load(block_tables_ptr + seq * stride_bt + blk).to(tl.int64)
        kpos = blk * BLOCK_SIZE + n
        base = block_id * stride_kb + n[:, None] * stride_ks + kvh * stride_kh + d[None, :]
        kmask = (kpos < kv_len)[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + base, mask=kmask, other=0.0)
        v = tl.load(v_ptr + base, mask=kmask, other=0.0)
        visible = (kpos[None, :] <= pos[:, None]) & row_ok[:, None]
        m_i, l_i, acc = online_softmax_block(q, k, v, visible, m_i, l_i, acc, scale, IEEE)
        blk += 1
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + (q_begin + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def query_tiles(query_start_loc: np.ndarray, block_q: int) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's query tiles of a step, int32 on the host: each tile's sequence, and its first
    query index within that sequence (``block_q`` query rows of one sequence a tile)."""
    q_lens = np.diff(np.asarray(query_start_loc, dtype=np.int64))
    n_tiles = ((q_lens + block_q - 1) // block_q).astype(np.int64)
    tile_seq = np.repeat(np.arange(len(q_lens), dtype=np.int32), n_tiles)
    first = np.repeat(np.cumsum(n_tiles) - n_tiles, n_tiles)
    tile_start = ((np.arange(int(n_tiles.sum())) - first) * block_q).astype(np.int32)
    return tile_seq, tile_start


def _tiles(meta: AttentionMetadata, block_q: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Per step, shared by every layer: cache on the metadata object.
    cached = getattr(meta, "_triton_tiles", None)
    if cached is not None and cached[0] == block_q:
        return cached[1], cached[2]
    tile_seq, tile_start = query_tiles(meta.query_start_loc, block_q)
    ts = torch.from_numpy(tile_seq).to(device, non_blocking=True)
    tt = torch.from_numpy(tile_start).to(device, non_blocking=True)
    meta._triton_tiles = (block_q, ts, tt)  # type: ignore[attr-defined]
    return ts, tt


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, batch_invariant: bool = False) -> torch.Tensor:
    """Same contract as ``torch_paged.paged_attention``, on CUDA.

    ``batch_invariant``: one tile shape for every step (the decode one), so a query row is
    computed by the same instructions whether its step is a decode, a prompt chunk or a mix. A
    row depends only on its own keys either way: a tile reads key blocks from position 0 in one
    order, and the blocks past a row's position are masked to exactly zero weight."""
    write_kv(kv_cache, k, v, meta.slot_mapping)
    return attend_cached(q, kv_cache, meta, scale, batch_invariant)


def attend_cached(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                  batch_invariant: bool = False) -> torch.Tensor:
    """``paged_attention`` for a step whose keys and values are in ``kv_cache`` already (the fused
    eager forward stores them with the rotary kernel): the attention output [T, heads, head_dim]."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = kv_cache.shape[3]
    group = num_heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    # Decode-only steps: few query rows per tile (M >= 16 for tl.dot); prefill: 16 tokens per tile.
    block_q = max(1, 16 // group_pad) if meta.max_query_len == 1 or batch_invariant else 16
    tile_seq, tile_start = _tiles(meta, block_q, q.device)
    out = torch.zeros_like(q) if meta.padded_rows else torch.empty_like(q)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    block_tables = meta.block_tables
    if len(tile_seq) == 0:
        return out
    _paged_attention_kernel[(len(tile_seq), kv_heads)](
        q, k_cache, v_cache, out, block_tables, meta.seq_lens_t, meta.query_start_loc_t, tile_seq, tile_start,
        scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_SIZE=kv_cache.shape[2],
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        IEEE=q.dtype == torch.float32,
    )
    return out
