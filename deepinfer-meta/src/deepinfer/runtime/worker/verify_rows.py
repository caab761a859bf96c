"""A verify step's tokens as one-token decode rows (what the verify CUDA graphs replay).

A speculative verify step gives each sequence s a few query tokens (its last token and its
drafts, ``q[s] <= k + 1``) in the engine's var-len layout: token arrays of T rows, then
``query_start_loc`` / ``seq_lens`` / ``block_tables`` per sequence. Token t of sequence s attends
causally to the first ``seq_lens[s] - (q[s] - 1 - j)`` cached positions (j: its index within the
sequence), and every token's K/V is written before any attention reads it. So the step is also
T independent decode rows: row t has its own token, position and slot, a context length of
``seq_lens[s] - (q[s] - 1 - j)`` and a copy of sequence s's block-table row. That is exactly
the input of the decode forward (``fused_decode_forward``: one query per row, split-K
attention over the paged cache), so a verify step of T tokens replays a decode graph captured
for T (padded) rows: no second attention kernel, the causal mask comes from the per-row
lengths. Each sequence's context is read once per query row (from L2 for the rows after the
first); the projections read the weights once for all rows, which is what the step is for.

Pure numpy (the bookkeeping is device-independent and tested on CPU).
"""

from __future__ import annotations

import numpy as np

# what a padding row holds (as the decode graphs' capture: token 0 at position 0, no KV write,
# a context of one token, block-table row of zeros)
PAD_SLOT = -1


def verify_row_count(query_start_loc: np.ndarray, seq_lens: np.ndarray, num_seqs: int, max_queries: int
                     ) -> int | None:
    """The step's token rows T if every sequence has 1..``max_queries`` query tokens and a
    context covering them (``seq_lens >= q``), else None (a shape the verify graphs do not take)."""
    if num_seqs <= 0:
        return None
    qsl = np.asarray(query_start_loc[:num_seqs + 1], dtype=np.int64)
    q = np.diff(qsl)
    if qsl[0] != 0 or q.min() < 0 or q.max() > max_queries or q.max() < 1:
        return None
    if (np.asarray(seq_lens[:num_seqs], dtype=np.int64) < q).any():
        return None
    return int(qsl[-1])


def expand_verify_rows(src: dict[str, np.ndarray], num_seqs: int, dst: dict[str, np.ndarray], padded: int) -> int:
    """Write the step in ``src`` (the engine's StepBuffers arrays, ``num_seqs`` sequence rows)
    into ``dst`` (another StepBuffers' arrays) as one-token decode rows, padded to ``padded``
    rows; returns the real row count T. ``dst``'s ``logits_indices`` get the step's own
    (``src``'s) logits indices, which index token rows = decode rows."""
    qsl = np.asarray(src["query_start_loc"][:num_seqs + 1], dtype=np.int64)
    t = int(qsl[-1])
    if t > padded or padded > len(dst["input_ids"]) or padded > dst["block_tables"].shape[0]:
        raise ValueError(f"expand_verify_rows: {t} token rows padded to {padded} do not fit buffers of "
                         f"{len(dst['input_ids'])} tokens / {dst['block_tables'].shape[0]} rows")
    q = np.diff(qsl)
    seq_of = np.repeat(np.arange(num_seqs), q)
    # queries after this one within its sequence: the row sees that many fewer keys
    after = (qsl[seq_of + 1] - 1) - np.arange(t)
    for name in ("input_ids", "positions", "slot_mapping"):
        dst[name][:t] = src[name][:t]
    dst["seq_lens"][:t] = np.asarray(src["seq_lens"], dtype=np.int64)[seq_of] - after
    width = src["block_tables"].shape[1]
    if dst["block_tables"].shape[1] != width:
        raise ValueError(f"expand_verify_rows: block-table widths differ ({width} vs {dst['block_tables'].shape[1]})")
    dst["block_tables"][:t] = src["block_tables"][seq_of]
    dst["input_ids"][t:padded] = 0
    dst["positions"][t:padded] = 0
    dst["slot_mapping"][t:padded] = PAD_SLOT
    dst["seq_lens"][t:padded] = 1
    dst["block_tables"][t:padded] = 0
    dst["query_start_loc"][:padded + 1] = np.arange(padded + 1)  # (not read by the graph; kept consistent)
    return t


def padded_size(rows: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= ``rows`` (None: larger than every one)."""
    for s in sizes:
        if s >= rows:
            return s
    return None


def verify_graph_sizes(decode_sizes: list[int], k: int, max_rows: int) -> list[int]:
    """Capture sizes of the verify graphs: each decode graph size B times k + 1 query tokens,
    at most ``max_rows`` (a step's token budget), and ``max_rows`` itself when some B*(k+1)
    passes it (so every step the budget allows has a graph)."""
    if k < 1:
        raise ValueError(f"verify_graph_sizes: k must be >= 1, got {k}")
    want = {b * (k + 1) for b in decode_sizes}
    sizes = {s for s in want if s <= max_rows}
    if any(s > max_rows for s in want):
        sizes.add(max_rows)
    return sorted(sizes)
