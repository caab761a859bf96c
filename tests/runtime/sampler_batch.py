"""Test helper: build a SamplingBatch from plain per-row dicts."""

from __future__ import annotations

import torch
from deepinfer.runtime.sampling.sampler import SamplingBatch


def make_batch(rows: list[dict], max_logprobs: int = -1) -> SamplingBatch:
    def col(key, default, dtype):
        return torch.tensor([r.get(key, default) for r in rows], dtype=dtype)

    def sparse(key):
        rr, tt, vv = [], [], []
        for i, r in enumerate(rows):
            items = r.get(key) or {}
            items = items.items() if isinstance(items, dict) else [(t, 1.0) for t in items]
            for t, v in items:
                rr.append(i)
                tt.append(t)
                vv.append(v)
        return (torch.tensor(rr, dtype=torch.int64), torch.tensor(tt, dtype=torch.int64),
                torch.tensor(vv, dtype=torch.float32))

    b = SamplingBatch(
        temperature=col("temperature", 1.0, torch.float32), top_k=col("top_k", -1, torch.int64),
        top_p=col("top_p", 1.0, torch.float32), min_p=col("min_p", 0.0, torch.float32),
        seeds=col("seed", 0, torch.int64), sample_index=col("sample_index", 0, torch.int64),
        step=col("step", 0, torch.int64),
        presence_penalty=col("presence", 0.0, torch.float32),
        frequency_penalty=col("frequency", 0.0, torch.float32),
        repetition_penalty=col("repetition", 1.0, torch.float32),
        max_logprobs=max_logprobs,
    )
    b.count_rows, b.count_tokens, b.count_values = sparse("counts")
    b.seen_rows, b.seen_tokens, _ = sparse("seen")
    b.bias_rows, b.bias_tokens, b.bias_values = sparse("bias")
    b.mask_rows, b.mask_tokens, _ = sparse("banned")
    b.allowed_rows, b.allowed_tokens, _ = sparse("allowed")
    b.all_greedy = all(r.get("temperature", 1.0) == 0 for r in rows)
    return b
