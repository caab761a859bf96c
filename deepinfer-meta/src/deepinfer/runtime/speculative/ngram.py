"""Prompt-lookup (n-gram) drafts: the tokens that followed the earliest earlier occurrence of
the context's longest suffix n-gram (n from ``max_n`` down to ``min_n``), as vLLM's NgramProposer."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to ``k`` draft tokens (int32, possibly empty) continuing ``tokens`` (1-D ints).

    For n = max_n .. min_n: the last n tokens are looked up among the earlier windows of n tokens
    (any start before the suffix itself); the first (earliest) match wins and the drafts are the
    tokens following it, which may run into the suffix. Fewer than k follow near the end."""
    t = np.asarray(tokens)
    length = len(t)
    if k <= 0 or length < 2:
        return np.zeros(0, np.int32)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = t[length - n:]
        windows = sliding_window_view(t[:length - 1], n)  # starts 0 .. length - n - 1
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[0]) + n
            return np.ascontiguousarray(t[start:start + k], dtype=np.int32)
    return np.zeros(0, np.int32)
