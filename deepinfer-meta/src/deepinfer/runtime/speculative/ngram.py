"""Prompt-lookup (n-gram) drafts: the tokens that followed an earlier occurrence of the
context's longest suffix n-gram (n from ``max_n`` down to ``min_n``).

Which occurrence (``match``): "earliest" (vLLM's NgramProposer), "latest" (the most recent, as
SGLang's recency-ordered n-gram trie prefers) or "longest" (the occurrence whose preceding tokens
agree with the context's for longest: the most context in common, as a suffix tree's deepest
match; ties go to the latest). How many drafts (``draft_length`` "adaptive", see
``next_draft_cap``): a per-request cap that halves after a rejected draft and doubles after a
step that kept all its drafts."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

MATCHES = ("earliest", "latest", "longest")
MAX_CONTEXT_EXTENSION = 64  # "longest": how far back beyond the n-gram candidates are compared


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int, match: str = "earliest") -> np.ndarray:
    """Up to ``k`` draft tokens (int32, possibly empty) continuing ``tokens`` (1-D ints).

    For n = max_n .. min_n: the last n tokens are looked up among the earlier windows of n tokens
    (any start before the suffix itself); the first n with a match wins, and among its matches
    ``match`` picks one (module docstring). The drafts are the tokens following it, which may run
    into the suffix. Fewer than k follow near the end."""
    if match not in MATCHES:
        raise ValueError(f"propose_ngram: match must be one of {', '.join(MATCHES)}, got {match!r}")
    t = np.asarray(tokens)
    length = len(t)
    if k <= 0 or length < 2:
        return np.zeros(0, np.int32)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = t[length - n:]
        windows = sliding_window_view(t[:length - 1], n)  # starts 0 .. length - n - 1
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            if match == "earliest":
                at = int(hits[0])
            elif match == "latest":
                at = int(hits[-1])
            else:
                at = _longest_context(t, hits, n)
            start = at + n
            return np.ascontiguousarray(t[start:start + k], dtype=np.int32)
    return np.zeros(0, np.int32)


def _longest_context(t: np.ndarray, hits: np.ndarray, n: int) -> int:
    """Of the windows starting at ``hits`` (each equal to the last n tokens), the one whose
    preceding tokens equal those before the suffix for longest (compared up to
    ``MAX_CONTEXT_EXTENSION`` tokens back); ties: the latest."""
    cand = hits
    before = len(t) - n - 1  # the token before the suffix
    for back in range(MAX_CONTEXT_EXTENSION):
        if len(cand) == 1 or before - back < 0:
            break
        pos = cand - 1 - back
        ok = pos >= 0
        ok[ok] = t[pos[ok]] == t[before - back]
        if not ok.any():
            break
        cand = cand[ok]
    return int(cand[-1])


def next_draft_cap(cap: int, k: int, num_drafts: int, num_accepted: int) -> int:
    """``draft_length`` "adaptive": the draft cap of a request's next step after a step that
    verified ``num_drafts`` drafts under cap ``cap`` (the first step's cap is k) and kept
    ``num_accepted`` of them. All kept: the cap doubles (at most k); a draft rejected: it halves,
    never below min(2, k) (one-draft steps rarely pay for their verify row on the CPU); no drafts
    verified: unchanged."""
    if num_drafts <= 0:
        return cap
    if num_accepted >= num_drafts:
        return min(k, 2 * cap)
    return max(min(2, k), cap // 2)
