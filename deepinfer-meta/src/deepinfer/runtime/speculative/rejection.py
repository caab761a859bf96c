"""Verification of draft tokens against the target model's distributions (lossless).

Greedy rows accept a draft while it equals the target's argmax; the first mismatch is replaced
by that argmax, so the output is exactly the non-speculative greedy output. Random rows use
rejection sampling (Leviathan et al., Chen et al.): draft x with draft probability q(x) is kept
with probability min(1, p(x) / q(x)); at the first rejection the token is drawn from the
residual max(p - q, 0) renormalised. Every output token is then distributed exactly as p. For
n-gram drafts q is one-hot on the draft (keep with probability p(x); residual = p without x).
When every draft is kept, the bonus token is the ordinary sample of the row after the last draft.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Verified:
    """Per speculative sequence s: ``num_accepted[s]`` kept drafts and ``tokens[s, :num_accepted[s] + 1]``
    (the kept drafts, then the recovered or bonus token); ``rows[s, j]``: the index among the
    draft rows (``j < num_drafts``) or -1 (the bonus row) that produced ``tokens[s, j]``."""

    num_accepted: np.ndarray  # int32 [S]
    tokens: np.ndarray  # int32 [S, max_k + 1]


def verify_drafts(draft_ids: torch.Tensor, cu_num_drafts: np.ndarray, greedy: torch.Tensor,
                  target_argmax: torch.Tensor, target_probs: torch.Tensor | None, bonus_tokens: torch.Tensor,
                  generator: torch.Generator | None = None, draft_probs: torch.Tensor | None = None) -> Verified:
    """Verify the drafts of S sequences (D draft tokens in all, CSR by ``cu_num_drafts`` [S + 1]).

    ``draft_ids`` int64 [D]; ``greedy`` bool [D] (the row of each draft is greedy);
    ``target_argmax`` int64 [D] (the target's argmax at each draft position, of the processed
    logits); ``target_probs`` float [D, V] (the target's sampling distribution at each draft
    position; may be None when every row is greedy); ``bonus_tokens`` int64 [S] (the token drawn
    from each sequence's row after its last draft); ``draft_probs`` float [D, V] or None (None:
    one-hot drafts, as n-gram); ``generator``: the random stream of the accept draws and residual
    samples."""
    cu = np.asarray(cu_num_drafts, dtype=np.int64)
    num_seqs = len(cu) - 1
    d = int(cu[-1]) if num_seqs >= 0 else 0
    max_k = int(np.max(np.diff(cu))) if num_seqs > 0 else 0
    accept = (draft_ids == target_argmax) if d else torch.zeros(0, dtype=torch.bool)
    recovered = target_argmax.clone() if d else torch.zeros(0, dtype=torch.int64)
    random_rows = (~greedy).nonzero().flatten() if d else torch.zeros(0, dtype=torch.int64)
    if len(random_rows):
        if target_probs is None:
            raise ValueError("target_probs: random (temperature > 0) rows need the target's probabilities")
        dev = target_probs.device
        p = target_probs[random_rows].float()
        x = draft_ids[random_rows]
        px = p.gather(1, x[:, None]).squeeze(1)
        if draft_probs is None:
            qx = torch.ones_like(px)
            residual = p.scatter(1, x[:, None], 0.0)
        else:
            q = draft_probs[random_rows].float()
            qx = q.gather(1, x[:, None]).squeeze(1)
            residual = (p - q).clamp_min(0.0)
        u = torch.rand(len(random_rows), generator=generator, device=dev)
        accept[random_rows] = u * qx < px  # u < p(x) / q(x), without dividing by q = 0
        total = residual.sum(dim=1, keepdim=True)
        # a row whose residual is empty keeps its draft with probability 1 (p >= q everywhere)
        residual = torch.where(total > 0, residual / total.clamp_min(1e-30), p)
        recovered[random_rows] = torch.multinomial(residual, 1, generator=generator).squeeze(1)
    acc_h = accept.cpu().numpy()
    rec_h = recovered.cpu().numpy()
    drafts_h = draft_ids.cpu().numpy()
    bonus_h = bonus_tokens.cpu().numpy()
    num_accepted = np.zeros(num_seqs, np.int32)
    tokens = np.zeros((num_seqs, max_k + 1), np.int32)
    for s in range(num_seqs):
        a, b = int(cu[s]), int(cu[s + 1])
        rejected = np.flatnonzero(~acc_h[a:b])
        n = int(rejected[0]) if len(rejected) else b - a
        num_accepted[s] = n
        tokens[s, :n] = drafts_h[a:a + n]
        tokens[s, n] = rec_h[a + n] if n < b - a else bonus_h[s]
    return Verified(num_accepted, tokens)
