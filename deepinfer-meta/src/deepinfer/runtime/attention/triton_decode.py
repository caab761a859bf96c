"""Split-K paged decode attention on CUDA (Triton): one query token per sequence.

Why split-K: a decode step has one query row per sequence, so a kernel with one program per
(sequence, kv head) runs B * KVH programs — 8 for a Llama-3-8B batch of one on a GPU of 132
multiprocessors — each walking the whole context alone. Here the context is cut into
``num_splits`` chunks processed by separate programs that each write a partial (max, sum,
weighted values); the last of them to finish (an integer arrival counter per (sequence, kv
head), so the merge order is fixed) merges the partials with the log-sum-exp rule, or, with
``fold_merge=False``, a second kernel does. Every input is a device tensor (no host-side
lengths), so the kernels can be captured in a CUDA graph and replayed for any sequence lengths;
``num_splits`` is fixed per captured batch size. With the folded merge only the splits that hold
tokens run: a sequence of ``seq_len`` tokens uses ``cdiv(seq_len, per_split)`` of them, the others
return at once and the merge reads only the used ones, so a graph captured with 64 splits for
long contexts spends no empty programs and no 64-way merge on a short one.

``quantized=(xq, st)`` (experimental, ``DEEPINFER_GGUF_O_QUANT_IN_ATTENTION=1``) also stores the
output as the 8-bit activations of the GGUF dp4a GEMV that reads it next (the o projection):
signed-byte codes and, per 16 columns, the scale and the sums that
``kernels.gguf_gemv._quantize_activations_kernel`` would compute from the stored output, so that
kernel's launch goes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.runtime import switches
from deepinfer.runtime.attention.triton_softmax import online_softmax_block
from deepinfer.runtime.kernels.fused_ops import store_quantized_groups
from deepinfer.runtime.kernels.pdl import pdl_begin, pdl_launch, prefetch_enabled

# the output also as 8-bit activations: codes int8 [B*H*D], stats float32 [3 * B*H*D/16]
Quantized = tuple[torch.Tensor, torch.Tensor]


@triton.jit
def _store_normalised(out_ptrs, acc, l_i, mask, cols, xq_ptr, st_ptr, kt, R: tl.constexpr, QUANT: tl.constexpr):
    """acc / l_i (rows with no weight stay 0) in the output's dtype (and quantized, ``_store_out``)."""
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    _store_out(out_ptrs, out, mask, cols, xq_ptr, st_ptr, kt, R, QUANT)


@triton.jit
def _store_out(out_ptrs, out, mask, cols, xq_ptr, st_ptr, kt, R: tl.constexpr, QUANT: tl.constexpr):
    """The output tile ``out`` (float32) in the output's dtype. QUANT: also as the dp4a GEMV's
    activations, exactly as ``_quantize_activations_kernel`` makes them from the stored values:
    codes at the flat columns ``cols`` of ``xq``, and for each 16 columns (``R`` groups in the
    tile; a head's groups are all in or all out) the scale, the integer sum and the float sum at
    ``st + t``, ``st + kt + t`` and ``st + 2 * kt + t``."""
    dt: tl.constexpr = out_ptrs.dtype.element_ty
    tl.store(out_ptrs, out.to(dt), mask=mask)
    if QUANT:
        ok = tl.reshape(mask, [R, 16])
        xv = tl.where(ok, tl.reshape(out.to(dt).to(tl.float32), [R, 16]), 0.0)
        store_quantized_groups(xv, tl.reshape(cols, [R, 16]), ok, xq_ptr, st_ptr, kt)


@triton.jit
def _kv_tile(block_tables_ptr, seq, kvh, kstart, end, n, d, stride_bt, stride_kb, stride_ks, stride_kh,
             BLOCK_SIZE: tl.constexpr):
    """Offsets [BLOCK_N, D] of the cached keys (or values) at positions ``kstart + n`` of ``seq``'s
    kv head ``kvh`` through its block table, and the positions' mask (< ``end``)."""
    kpos = kstart + n
    kmask = kpos < end
    block_id = tl.load(block_tables_ptr + seq * stride_bt + kpos // BLOCK_SIZE, mask=kmask, other=0).to(tl.int64)
    offsets = block_id[:, None] * stride_kb + (kpos % BLOCK_SIZE)[:, None] * stride_ks + kvh * stride_kh + d[None, :]
    return offsets, kmask


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, part_o_ptr, part_ml_ptr, o_ptr, count_ptr,
    scale, num_splits, xq_ptr, st_ptr, kt,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, M: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, IEEE: tl.constexpr, DIRECT: tl.constexpr,
    FOLD_MERGE: tl.constexpr, PDL: tl.constexpr, PRELOAD: tl.constexpr = False, NEW_ROWS: tl.constexpr = 1,
    QUANT: tl.constexpr = False,
):
    # QUANT: the output is also stored as the o projection's 8-bit activations (``_store_out``).
    # PRELOAD: before the wait (kernels/pdl.py) the lengths and block tables (step inputs) and the
    # first tile's cached keys and values of earlier steps' tokens. The kernel just before this one
    # stores this step's k/v: the last NEW_ROWS positions of a row's context (one for a decode
    # step; a verify row's context ends with up to k + 1 of them), so those are read after the wait.
    if not PRELOAD:
        pdl_begin(PDL)
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    # the splits that hold tokens (at least one, for an empty sequence's output)
    active = tl.maximum(tl.cdiv(seq_len, tl.maximum(per_split, 1)), 1)
    if FOLD_MERGE:
        # no tokens and not counted by the merge: nothing to do (with PRELOAD it returns before
        # the wait; split 0 always waits, so the grid still ends after the kernel before it)
        if split >= active:
            return

    rows = tl.arange(0, M)
    row_ok = rows < GROUP
    head = kvh * GROUP + rows
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    out_mask = row_ok[:, None] & d_ok[None, :]  # this program's query heads: q, partials, output
    out_ptrs = o_ptr + seq * stride_ot + head[:, None] * stride_oh + d[None, :]
    out_cols = (seq * tl.num_programs(1) * GROUP + head)[:, None] * HEAD_DIM + d[None, :]  # flat, for QUANT
    R: tl.constexpr = M * HEAD_DIM_PAD // 16
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, HEAD_DIM_PAD], tl.float32)
    n = tl.arange(0, BLOCK_N)
    if PRELOAD:  # the first tile: earlier steps' rows before the wait, this step's after it
        base, kmask = _kv_tile(block_tables_ptr, seq, kvh, start, end, n, d, stride_bt, stride_kb, stride_ks,
                               stride_kh, BLOCK_SIZE)
        old = (kmask & (start + n < seq_len - NEW_ROWS))[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + base, mask=old, other=0.0)
        v = tl.load(v_ptr + base, mask=old, other=0.0)
        pdl_begin(PDL)
        new = (kmask & (start + n >= seq_len - NEW_ROWS))[:, None] & d_ok[None, :]
        k = tl.where(new, tl.load(k_ptr + base, mask=new, other=0.0), k)
        v = tl.where(new, tl.load(v_ptr + base, mask=new, other=0.0), v)
        q = tl.load(q_ptr + seq * stride_qt + head[:, None] * stride_qh + d[None, :], mask=out_mask, other=0.0)
        if start < end:
            m_i, l_i, acc = online_softmax_block(q, k, v, kmask[None, :], m_i, l_i, acc, scale, IEEE)
        first = start + BLOCK_N
    else:
        q = tl.load(q_ptr + seq * stride_qt + head[:, None] * stride_qh + d[None, :], mask=out_mask, other=0.0)
        first = start
    for kstart in range(first, end, BLOCK_N):
        base, kmask = _kv_tile(block_tables_ptr, seq, kvh, kstart, end, n, d, stride_bt, stride_kb, stride_ks,
                               stride_kh, BLOCK_SIZE)
        m2 = kmask[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + base, mask=m2, other=0.0)
        v = tl.load(v_ptr + base, mask=m2, other=0.0)
        m_i, l_i, acc = online_softmax_block(q, k, v, kmask[None, :], m_i, l_i, acc, scale, IEEE)
    if DIRECT:  # one split: normalise and store the output here (no merge launch)
        _store_normalised(out_ptrs, acc, l_i, out_mask, out_cols, xq_ptr, st_ptr, kt, R, QUANT)
        return
    if FOLD_MERGE:
        if active == 1:  # a short context: the one split with tokens stores the output
            _store_normalised(out_ptrs, acc, l_i, out_mask, out_cols, xq_ptr, st_ptr, kt, R, QUANT)
            return
    # partials: o [B, H, S, D] (unnormalised), ml [B, H, S, 2] (max, sum)
    num_heads = tl.num_programs(1) * GROUP
    pidx = (seq * num_heads + head) * num_splits + split
    tl.store(part_o_ptr + pidx[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)
    tl.store(part_ml_ptr + pidx * 2, m_i, mask=row_ok)
    tl.store(part_ml_ptr + pidx * 2 + 1, l_i, mask=row_ok)
    if FOLD_MERGE:
        # The last split program of this (sequence, kv head) to finish merges all of them (no
        # merge launch). The counter is an integer (the merge order is fixed: deterministic) and
        # the merging program sets it back to 0 for the next call.
        tl.debug_barrier()  # every thread's partial stores before the release below
        counter = count_ptr + seq * tl.num_programs(1) + kvh
        if tl.atomic_add(counter, 1, sem="acq_rel") == active - 1:
            tl.store(counter, 0)
            part0 = (seq * num_heads + head) * num_splits
            m_max = tl.full([M], float("-inf"), tl.float32)
            for s in range(0, active):
                m_s = tl.load(part_ml_ptr + (part0 + s) * 2, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
                m_max = tl.maximum(m_max, m_s)
            m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
            total = tl.zeros([M], tl.float32)
            merged = tl.zeros([M, HEAD_DIM_PAD], tl.float32)
            for s in range(0, active):
                m_s = tl.load(part_ml_ptr + (part0 + s) * 2, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
                l_s = tl.load(part_ml_ptr + (part0 + s) * 2 + 1, mask=row_ok, other=0.0, cache_modifier=".cg")
                w_s = tl.where(m_s > float("-inf"), tl.exp(m_s - m_max), 0.0)
                total += w_s * l_s
                po = tl.load(part_o_ptr + (part0 + s)[:, None] * HEAD_DIM + d[None, :],
                             mask=out_mask, other=0.0, cache_modifier=".cg")
                merged += po * w_s[:, None]
            _store_normalised(out_ptrs, merged, total, out_mask, out_cols, xq_ptr, st_ptr, kt, R, QUANT)


@triton.jit
def _decode_merge_kernel(part_o_ptr, part_ml_ptr, o_ptr, num_splits, stride_ot, stride_oh, xq_ptr, st_ptr, kt,
                         SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                         PDL: tl.constexpr, QUANT: tl.constexpr = False):
    pdl_begin(PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < num_splits
    base = (seq * num_heads + head) * num_splits
    m = tl.load(part_ml_ptr + (base + s) * 2, mask=s_ok, other=float("-inf"))
    ll = tl.load(part_ml_ptr + (base + s) * 2 + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(s_ok & (m > float("-inf")), tl.exp(m - m_max), 0.0)
    total = tl.sum(w * ll, 0)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    po = tl.load(part_o_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                 other=0.0)
    out = tl.sum(po * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    _store_out(o_ptr + seq * stride_ot + head * stride_oh + d, out, d_ok, (seq * num_heads + head) * HEAD_DIM + d,
               xq_ptr, st_ptr, kt, HEAD_DIM_PAD // 16, QUANT)


def choose_num_splits(batch: int, num_kv_heads: int, max_model_len: int, num_sms: int = 132,
                      block_n: int = 64) -> int:
    """Splits per sequence so that about two waves of programs fill the GPU, at most one per
    ``block_n`` tokens of the longest context and at most 64."""
    want = max(1, (2 * num_sms) // max(1, batch * num_kv_heads))
    return int(max(1, min(want, triton.cdiv(max_model_len, block_n), 64)))


class DecodeWorkspace:
    """The partial-result buffers of ``decode_attention``: room for ``batch * num_splits`` up to
    ``max_partials`` (allocated once, outside any graph capture)."""

    def __init__(self, max_partials: int, num_heads: int, head_dim: int, device: torch.device) -> None:
        self.part_o = torch.empty(max_partials * num_heads * head_dim, dtype=torch.float32, device=device)
        self.part_ml = torch.empty(max_partials * num_heads * 2, dtype=torch.float32, device=device)
        # finished splits per (sequence, kv head) for the folded merge; each call leaves them at 0
        self.counters = torch.zeros(max_partials * num_heads, dtype=torch.int32, device=device)
        self.max_partials = max_partials


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, num_splits: int, workspace: DecodeWorkspace | None = None,
                     out: torch.Tensor | None = None, fold_merge: bool = True,
                     preload: bool | None = None, new_rows: int = 1,
                     quantized: Quantized | None = None) -> torch.Tensor:
    """Attention of one query token per sequence ``q`` [B, H, D] over its first ``seq_lens[b]``
    cached tokens (block table row ``block_tables[b]``) in ``kv_cache`` [2, blocks, bs, KVH, D];
    the new token's k/v must already be in the cache. Returns [B, H, D].

    ``fold_merge``: the last split program of each (sequence, kv head) merges the partials (one
    launch); False merges them in a second kernel. ``preload``: each program loads its first tile
    of cached keys and values before waiting for the kernel before it (default:
    ``DEEPINFER_PDL_PREFETCH``, ``kernels/pdl.py``), all but the last ``new_rows`` positions of
    each row's context, which that kernel stores: 1 for a decode step, k + 1 for the rows of a
    verify step with k drafts (a row's context ends with up to k + 1 of its sequence's new tokens).
    ``quantized`` (int8 [B*H*D], float32 [3 * B*H*D/16]): also the output as 8-bit activations
    (per 16 columns: scale, integer sum, float sum), as the GGUF dp4a GEMV reads them."""
    if new_rows < 1:
        raise ValueError(f"decode_attention: new_rows must be >= 1, got {new_rows}")
    preload = prefetch_enabled() if preload is None else preload
    b, num_heads, head_dim = q.shape
    workspace = _checked_workspace(kv_cache, num_heads, num_splits, workspace, b, head_dim, q.device,
                                   "decode_attention")
    out = torch.empty_like(q) if out is None else out
    _check_quantized(quantized, out, b * num_heads * head_dim, "decode_attention")
    _launch(q, b, num_heads, head_dim, kv_cache, block_tables, seq_lens, scale, num_splits, workspace, out,
            fold_merge, preload, new_rows if preload else 1, quantized)
    return out


def _check_quantized(quantized: Quantized | None, out: torch.Tensor, cols: int, name: str) -> None:
    """ValueError naming ``name`` unless ``quantized`` (if given) holds ``cols`` 8-bit activations
    and their per-16-column stats, for a contiguous output whose heads are whole 16-column groups."""
    if quantized is None:
        return
    xq, st = quantized
    head_dim = out.shape[-1]
    if head_dim % 16 or not out.is_contiguous():
        raise ValueError(f"{name}: a quantized output needs a contiguous output of heads a multiple of 16 wide, "
                         f"got shape {tuple(out.shape)} with strides {out.stride()}")
    if xq.dtype != torch.int8 or xq.numel() != cols or not xq.is_contiguous():
        raise ValueError(f"{name}: quantized codes must be a contiguous int8 tensor of {cols} values, got "
                         f"{xq.dtype} {tuple(xq.shape)}")
    if st.dtype != torch.float32 or st.numel() != 3 * (cols // 16) or not st.is_contiguous():
        raise ValueError(f"{name}: quantized stats must be a contiguous float32 tensor of {3 * (cols // 16)} values "
                         f"(scale, integer sum, float sum per 16 columns), got {st.dtype} {tuple(st.shape)}")
    if xq.device != out.device or st.device != out.device:
        raise ValueError(f"{name}: quantized buffers are on {xq.device} / {st.device}, the output on {out.device}")


def _checked_workspace(kv_cache: torch.Tensor, num_heads: int, num_splits: int, workspace: DecodeWorkspace | None,
                       b: int, head_dim: int, device: torch.device, name: str) -> DecodeWorkspace:
    """The call's workspace (a new one for ``None``) once the heads, the splits and its room are
    checked; ValueError naming ``name`` otherwise."""
    if num_heads % kv_cache.shape[3]:
        raise ValueError(f"{name}: {num_heads} query heads are not a multiple of {kv_cache.shape[3]} kv heads")
    if not 1 <= num_splits <= 1024:
        raise ValueError(f"{name}: num_splits must be in [1, 1024], got {num_splits}")
    if workspace is None:
        workspace = DecodeWorkspace(b * num_splits, num_heads, head_dim, device)
    if workspace.max_partials < b * num_splits or workspace.part_o.numel() < b * num_splits * num_heads * head_dim:
        raise ValueError(f"{name}: the workspace holds {workspace.max_partials} partials, this call needs {b} "
                         f"sequences x {num_splits} splits")
    return workspace


def split_tile(block_size: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of the split kernel: (64 or the block size if larger, 4), or what
    ``DEEPINFER_DECODE_TILES="split=N,W"`` asks for (benchmarks; N a power of two). A split
    covers a multiple of BLOCK_N positions, so the tile also sets how many splits a context uses."""
    given = switches.tiles("DEEPINFER_DECODE_TILES", ("split",), (2,)).get("split")
    if given is None:
        return max(64, triton.next_power_of_2(block_size)), 4
    if given[0] & (given[0] - 1) or given[0] < 16:
        raise ValueError(f"DEEPINFER_DECODE_TILES: BLOCK_N must be a power of two of at least 16, got {given[0]}")
    return given[0], given[1]


def _launch(q: torch.Tensor, b: int, num_heads: int, head_dim: int, kv_cache: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, scale: float, num_splits: int, workspace: DecodeWorkspace, out: torch.Tensor,
            fold_merge: bool, preload: bool, new_rows: int, quantized: Quantized | None) -> None:
    """The split kernel (and the separate merge where it runs) over the query rows ``q`` [B, H, D];
    ``quantized``: (codes, stats) the output is also stored to."""
    kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    if b == 0:
        return
    group = num_heads // kv_heads
    part_o, part_ml = workspace.part_o, workspace.part_ml
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    block_n, warps = split_tile(block_size)
    pdl = pdl_launch(q.device)
    fold = fold_merge and num_splits > 1
    xq, st = quantized if quantized is not None else (out, out)
    kt = b * num_heads * head_dim // 16
    _decode_split_kernel[(b, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_o, part_ml, out, workspace.counters,
        scale, num_splits, xq, st, kt,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, M=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size, BLOCK_N=block_n,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), IEEE=q.dtype == torch.float32,
        DIRECT=num_splits == 1, FOLD_MERGE=fold, PRELOAD=preload, NEW_ROWS=new_rows, QUANT=quantized is not None,
        num_warps=warps, **pdl)
    if num_splits == 1 or fold:
        return
    _decode_merge_kernel[(b, num_heads)](
        part_o, part_ml, out, num_splits, out.stride(0), out.stride(1), xq, st, kt,
        SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim), QUANT=quantized is not None, num_warps=1, **pdl)
