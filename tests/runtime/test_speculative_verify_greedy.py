"""``Speculator.verify_greedy`` (plain-greedy verify steps, one device-to-host copy) against a
hand-written reference of greedy acceptance and against ``Speculator.verify`` on the same
random steps; oracle mode (forced acceptance) keeps every draft in both."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from deepinfer.runtime.sampling.sampler import SamplerOutput, SamplingBatch
from deepinfer.runtime.speculative.config import SpeculativeConfig


def _speculator(method, k):
    pytest.importorskip("deepinfer_engine", reason="the C++ engine (deepinfer-engine) is not built/installed")
    from deepinfer.runtime.speculative.speculator import Speculator

    return Speculator(SpeculativeConfig(method=method, num_speculative_tokens=k), lambda rid: None)


def _step(rng, k, vocab):
    """A random verify step: R sample rows, some with drafts; logits rows laid out as the engine
    does (a row's draft target rows, then its bonus row = its sample row)."""
    r = int(rng.integers(1, 6))
    counts = rng.integers(0, k + 1, r)
    rows, target_rows, drafts, cu, sample_rows = [], [], [], [0], []
    at = 0
    for i in range(r):
        target_rows += list(range(at, at + counts[i]))
        at += int(counts[i])
        rows.append(at)  # the bonus / sample row
        at += 1
        if counts[i]:
            sample_rows.append(i)
            cu.append(cu[-1] + int(counts[i]))
    logits = torch.randn(at, vocab)
    am = logits.argmax(-1).numpy()
    for i in range(r):  # drafts: right for a random prefix, then wrong (or right throughout)
        base = rows[i] - counts[i]
        keep = int(rng.integers(0, counts[i] + 1))
        for j in range(counts[i]):
            t = int(am[base + j])
            drafts.append(t if j < keep else (t + 1) % vocab)
    S = SimpleNamespace(num_seqs=len(sample_rows), num_drafts_total=len(drafts), sample_rows=sample_rows,
                        cu_num_drafts=cu, target_logits_rows=target_rows, draft_token_ids=drafts)
    si = SimpleNamespace(driver=SimpleNamespace(num_real_rows=r, seq_ids=list(range(100, 100 + r))),
                         kernel=SimpleNamespace(logits_rows=rows), speculative=S)
    return si, logits, np.array(rows), counts, np.array(drafts), am


def _reference(rows, counts, drafts, am, forced):
    out = []
    d = 0
    for i, c in enumerate(counts):
        base = rows[i] - c
        n = 0
        while n < c and (forced or drafts[d + n] == am[base + n]):
            n += 1
        toks = list(drafts[d:d + n]) + [int(am[base + n]) if n < c else int(am[rows[i]])]
        out.append((n, toks))
        d += c
    return out


@pytest.mark.parametrize("method", ["ngram", "oracle"])
def test_verify_greedy_is_greedy_acceptance_and_matches_verify(method):
    rng = np.random.default_rng(7)
    k, vocab = 4, 50
    spec = _speculator(method, k)
    for _ in range(40):
        si, logits, rows, counts, drafts, am = _step(rng, k, vocab)
        fast = spec.verify_greedy(si, logits.argmax(-1))
        ref = _reference(rows, counts, drafts, am, forced=method == "oracle")
        assert [(int(n), list(t[:n + 1])) for n, t in zip(fast.num_accepted, fast.tokens, strict=True)] == ref
        assert list(fast.num_drafts) == list(counts)
        r = len(rows)
        z = torch.zeros(r)
        batch = SamplingBatch(temperature=z, top_k=z.long(), top_p=z + 1, min_p=z, seeds=z.long(),
                              sample_index=z.long(), step=z.long(), max_logprobs=-1, all_greedy=True)
        rows_t = torch.from_numpy(rows)
        res = SamplerOutput(tokens=logits[rows_t].argmax(-1), logprobs=None, topk_ids=None, topk_logprobs=None)
        full = spec.verify(si, logits, rows_t, batch, res)
        assert (full.num_accepted == fast.num_accepted).all() and (full.tokens == fast.tokens).all()
