"""Host-known top-k / top-p / min-p usage (the engine's no_top_k ... flags) lets the sampler skip
its device-side checks (device-to-host syncs) without changing a single sampled token."""

from __future__ import annotations

import dataclasses

import torch
from deepinfer.runtime.sampling.sampler import sample
from sampler_batch import make_batch

ROWS = [
    dict(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2),  # greedy: its filters do not matter
    dict(temperature=0.8, seed=1),
    dict(temperature=1.3, seed=2, step=4),
]


def _tokens(batch, logits):
    return sample(logits, batch).tokens.tolist()


def test_flags_saying_unused_give_the_same_tokens_as_device_checks():
    logits = torch.randn(len(ROWS), 200, generator=torch.Generator().manual_seed(0))
    checked = make_batch(ROWS)
    known = dataclasses.replace(checked, top_k_used=False, top_p_used=False, min_p_used=False)
    assert _tokens(known, logits) == _tokens(checked, logits)


def test_flags_saying_used_give_the_same_tokens_as_device_checks():
    rows = [*ROWS, dict(temperature=1.0, seed=3, top_k=5, top_p=0.7, min_p=0.05)]
    logits = torch.randn(len(rows), 200, generator=torch.Generator().manual_seed(1))
    checked = make_batch(rows)
    known = dataclasses.replace(checked, top_k_used=True, top_p_used=True, min_p_used=True)
    assert _tokens(known, logits) == _tokens(checked, logits)
    # and the filters matter here: with them switched off the top-k row may leave its top 5
    off = dataclasses.replace(checked, top_k_used=False, top_p_used=False, min_p_used=False)
    draws = {sample(logits, dataclasses.replace(off, step=off.step + i)).tokens[3].item() for i in range(40)}
    top5 = set(logits[3].topk(5).indices.tolist())
    assert draws - top5, "without the filters some draw of the top-k row falls outside its top 5"
    kept = {sample(logits, dataclasses.replace(known, step=known.step + i)).tokens[3].item() for i in range(40)}
    assert kept <= top5
