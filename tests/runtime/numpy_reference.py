"""Independent numpy (float64) reference of the sampler's logits processing and filtering."""

from __future__ import annotations

import numpy as np


def process_row(logits, *, bias=None, banned=(), allowed=None, seen=(), counts=None,
                repetition=1.0, frequency=0.0, presence=0.0):
    x = np.array(logits, dtype=np.float64)
    for t, v in (bias or {}).items():
        x[t] += v
    if allowed is not None:
        keep = np.zeros_like(x, dtype=bool)
        keep[list(allowed)] = True
        x[~keep] = -np.inf
    if repetition != 1.0:
        for t in set(seen):
            x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    for t, c in (counts or {}).items():
        x[t] -= frequency * c + (presence if c > 0 else 0.0)
    for t in banned:
        x[t] = -np.inf
    return x


def probs_row(x, *, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    x = np.array(x, dtype=np.float64) / (temperature if temperature > 0 else 1.0)
    if 0 < top_k < x.size:
        kth = np.sort(x)[::-1][top_k - 1]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        ahead = np.cumsum(p[order]) - p[order]
        drop = order[ahead >= top_p]
        p[drop] = 0.0
        p /= p.sum()
    if min_p > 0:
        p[p < min_p * p.max()] = 0.0
        p /= p.sum()
    return p


def log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))
