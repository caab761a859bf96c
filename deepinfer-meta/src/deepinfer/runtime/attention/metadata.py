"""Per-step attention inputs in the flattened var-len layout the engine's prepare_* calls emit."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """One step's attention layout (the engine's var-len layout), as torch tensors on the model's device.

    ``slot_mapping[t]`` is the KV-cache slot (block * block_size + offset) token row ``t`` writes;
    padding rows carry -1 and are redirected to a scratch slot. Sequence ``i`` owns query rows
    ``query_start_loc[i]:query_start_loc[i+1]`` and attends over its first ``seq_lens[i]`` cached
    tokens, found through ``block_tables[i]``.
    """

    slot_mapping: torch.Tensor  # int64 [T], scratch slot for padding rows
    query_start_loc: np.ndarray  # int64 [B+1] (host copy: drives the per-sequence split)
    seq_lens: np.ndarray  # int64 [B] (host copy)
    seq_lens_t: torch.Tensor  # int32 [B] on device
    block_tables: torch.Tensor  # int32 [B, W] on device
    query_start_loc_t: torch.Tensor  # int32 [B+1] on device
    block_size: int
    max_query_len: int
    max_seq_len: int
    # Rows of single-token (decode) sequences and of multi-token (prefill) sequences.
    decode_seq_idx: np.ndarray
    prefill_seq_idx: np.ndarray
    # Rows past the sequences' query rows (a step graph's padding, worker/step_graph_runner.py):
    # the Triton attention then zeroes its output first, so those rows stay finite.
    padded_rows: bool = False


def build_attention_metadata(
    *,
    slot_mapping: np.ndarray,
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    block_size: int,
    scratch_slot: int,
    device: torch.device,
) -> AttentionMetadata:
    """Copy one step's host arrays to ``device`` and precompute the decode/prefill split."""
    num_seqs = int(seq_lens.shape[0])
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"query_start_loc has {query_start_loc.shape[0]} entries, expected num_seqs+1={num_seqs + 1}")
    if block_tables.shape[0] < num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows, expected at least {num_seqs}")
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    lens = np.asarray(seq_lens[:num_seqs], dtype=np.int64)
    q_lens = np.diff(qsl)
    if np.any(q_lens < 0) or np.any(q_lens > lens):
        raise ValueError("query_start_loc/seq_lens: a sequence has more query tokens than context tokens")
    slots = torch.from_numpy(np.where(slot_mapping < 0, scratch_slot, slot_mapping).astype(np.int64))
    max_blocks = int((lens.max() + block_size - 1) // block_size) if num_seqs else 0
    bt = np.ascontiguousarray(block_tables[:num_seqs, :max_blocks], dtype=np.int64)
    return AttentionMetadata(
        slot_mapping=slots.to(device, non_blocking=True),
        query_start_loc=qsl,
        seq_lens=lens,
        seq_lens_t=torch.from_numpy(lens.astype(np.int32)).to(device, non_blocking=True),
        block_tables=torch.from_numpy(bt).to(device, non_blocking=True),
        query_start_loc_t=torch.from_numpy(qsl.astype(np.int32)).to(device, non_blocking=True),
        block_size=block_size,
        max_query_len=int(q_lens.max()) if num_seqs else 0,
        max_seq_len=int(lens.max()) if num_seqs else 0,
        decode_seq_idx=np.nonzero(q_lens == 1)[0],
        prefill_seq_idx=np.nonzero(q_lens > 1)[0],
    )
