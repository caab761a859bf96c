"""Turn the engine's ``SamplerInputs`` (numpy views, CSR lists) into the sampler's device tensors."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from deepinfer.runtime.sampler import SamplingBatch


def _t(a: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # The engine reuses its storage next step: copy now.
    return torch.from_numpy(np.array(a)).to(device=device, dtype=dtype, non_blocking=True)


def _csr_rows(offsets: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(len(offsets) - 1, dtype=np.int64), np.diff(offsets))


def sampling_batch_from_engine(si: Any, device: torch.device) -> tuple[torch.Tensor, SamplingBatch]:
    """(logits row of each sample row, SamplingBatch) for one step's SamplerInputs ``si``."""
    k, tr, drv = si.kernel, si.transform, si.driver
    rows = _t(k.logits_rows, torch.int64, device)
    b = SamplingBatch(
        temperature=_t(k.temperature, torch.float32, device),
        top_k=_t(k.top_k, torch.int64, device),
        top_p=_t(k.top_p, torch.float32, device),
        min_p=_t(k.min_p, torch.float32, device),
        seeds=_t(k.seeds, torch.int64, device),
        sample_index=_t(k.subsequences, torch.int64, device),
        step=_t(k.offsets, torch.int64, device),
        max_logprobs=int(drv.max_num_logprobs),
        all_greedy=bool(k.all_greedy),
    )
    if not tr.no_penalties:
        b.presence_penalty = _t(tr.presence_penalty, torch.float32, device)
        b.frequency_penalty = _t(tr.frequency_penalty, torch.float32, device)
        b.repetition_penalty = _t(tr.repetition_penalty, torch.float32, device)
        prow = _csr_rows(np.asarray(tr.penalty_offsets))
        ptok = np.asarray(tr.penalty_token_ids, dtype=np.int64)
        counts = np.asarray(tr.penalty_output_counts)
        in_prompt = np.asarray(tr.penalty_in_prompt).astype(bool)
        out_mask = counts > 0
        b.count_rows = _t(prow[out_mask], torch.int64, device)
        b.count_tokens = _t(ptok[out_mask], torch.int64, device)
        b.count_values = _t(counts[out_mask], torch.float32, device)
        seen = out_mask | in_prompt
        b.seen_rows = _t(prow[seen], torch.int64, device)
        b.seen_tokens = _t(ptok[seen], torch.int64, device)
    if not tr.no_logit_bias:
        b.bias_rows = _t(_csr_rows(np.asarray(tr.bias_offsets)), torch.int64, device)
        b.bias_tokens = _t(tr.bias_token_ids, torch.int64, device)
        b.bias_values = _t(tr.bias_values, torch.float32, device)
    if not tr.no_banned:
        b.mask_rows = _t(_csr_rows(np.asarray(tr.banned_offsets)), torch.int64, device)
        b.mask_tokens = _t(tr.banned_token_ids, torch.int64, device)
    if not tr.no_allowed:
        b.allowed_rows = _t(_csr_rows(np.asarray(tr.allowed_offsets)), torch.int64, device)
        b.allowed_tokens = _t(tr.allowed_token_ids, torch.int64, device)
    return rows, b
