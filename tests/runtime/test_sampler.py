"""The torch sampler against the numpy reference on fixed logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer.runtime.sampling.sampler import (
    apply_logits_processing,
    prompt_logprobs,
    sample,
    sampling_probs,
)
from numpy_reference import log_softmax, probs_row, process_row
from sampler_batch import make_batch

V = 64


@pytest.fixture
def logits():
    g = np.random.default_rng(1234)
    return g.normal(0, 2.0, size=(6, V)).astype(np.float32)


ROWS = [
    {"temperature": 0.7, "top_k": 5},
    {"temperature": 1.3, "top_p": 0.6},
    {"temperature": 1.0, "min_p": 0.2},
    {"temperature": 0.9, "top_k": 10, "top_p": 0.8, "min_p": 0.05},
    {"temperature": 1.0, "repetition": 1.7, "seen": [1, 2, 3, 40], "frequency": 0.5, "presence": 0.7,
     "counts": {2: 3, 40: 1, 7: 2}},
    {"temperature": 0.5, "bias": {5: 4.0, 6: -3.0}, "banned": [0, 9], "allowed": [5, 6, 9, 11, 12, 30]},
]


def _ref_kwargs(r):
    return dict(bias=r.get("bias"), banned=r.get("banned", ()), allowed=r.get("allowed"),
                seen=r.get("seen", ()), counts=r.get("counts"), repetition=r.get("repetition", 1.0),
                frequency=r.get("frequency", 0.0), presence=r.get("presence", 0.0))


def test_processing_and_filtering_match_numpy(logits):
    b = make_batch(ROWS)
    x = apply_logits_processing(torch.from_numpy(logits), b)
    probs = sampling_probs(x, b).numpy()
    for i, r in enumerate(ROWS):
        ref_x = process_row(logits[i], **_ref_kwargs(r))
        np.testing.assert_allclose(x[i].numpy(), ref_x, rtol=1e-5, atol=1e-5)
        ref_p = probs_row(ref_x, temperature=r["temperature"], top_k=r.get("top_k", -1),
                          top_p=r.get("top_p", 1.0), min_p=r.get("min_p", 0.0))
        np.testing.assert_allclose(probs[i], ref_p, rtol=1e-4, atol=1e-6)
        assert (probs[i] > 0).sum() < V or i == 4  # every filtering row removed something


def test_samples_stay_in_support_and_follow_distribution(logits):
    rows = [dict(ROWS[3], seed=7, step=s) for s in range(3000)]
    b = make_batch(rows)
    lg = torch.from_numpy(np.repeat(logits[3:4], len(rows), axis=0))
    toks = sample(lg, b).tokens.numpy()
    ref = probs_row(logits[3], temperature=0.9, top_k=10, top_p=0.8, min_p=0.05)
    assert set(np.unique(toks)) <= set(np.nonzero(ref)[0])
    freq = np.bincount(toks, minlength=V) / len(toks)
    # 3000 draws: every frequency within 4 standard deviations of its probability
    sd = np.sqrt(ref * (1 - ref) / len(toks))
    assert np.all(np.abs(freq - ref) <= 4 * sd + 1e-9)


def test_greedy_takes_argmax_after_bias_and_penalties(logits):
    rows = [{"temperature": 0.0}, {"temperature": 0.0, "bias": {17: 100.0}},
            {"temperature": 0.0, "banned": [int(np.argmax(logits[2]))]}]
    out = sample(torch.from_numpy(logits[:3]), make_batch(rows)).tokens.tolist()
    assert out[0] == int(np.argmax(logits[0]))
    assert out[1] == 17
    assert out[2] == int(np.argsort(-logits[2])[1])


def test_seeded_rows_do_not_depend_on_the_batch(logits):
    alone = sample(torch.from_numpy(logits[1:2]), make_batch([dict(ROWS[1], seed=99, step=4)])).tokens
    mixed_rows = [dict(ROWS[0], seed=1), dict(ROWS[1], seed=99, step=4), {"temperature": 0.0}, dict(ROWS[2])]
    mixed = sample(torch.from_numpy(logits[:4]), make_batch(mixed_rows)).tokens
    assert mixed[1] == alone[0]
    # different steps / sample indexes give different streams
    draws = {int(sample(torch.from_numpy(logits[1:2]), make_batch([dict(ROWS[1], seed=99, step=s)])).tokens[0])
             for s in range(40)}
    assert len(draws) > 1


def test_logprobs_are_raw_log_softmax(logits):
    rows = [dict(r) for r in ROWS]
    out = sample(torch.from_numpy(logits), make_batch(rows, max_logprobs=3))
    ref = log_softmax(logits)
    for i, t in enumerate(out.tokens.tolist()):
        assert out.logprobs[i].item() == pytest.approx(ref[i, t], abs=1e-5)
        top = np.argsort(-ref[i])[:3]
        assert out.topk_ids[i].tolist() == top.tolist()
        np.testing.assert_allclose(out.topk_logprobs[i].numpy(), ref[i, top], atol=1e-5)
    targets = torch.tensor([3, 1, 4, 1, 5, 9])
    lp, ids, vals = prompt_logprobs(torch.from_numpy(logits), targets, 2)
    np.testing.assert_allclose(lp.numpy(), ref[np.arange(6), targets.numpy()], atol=1e-5)
    assert ids.shape == (6, 2)
    np.testing.assert_allclose(vals.numpy(), np.sort(ref, axis=1)[:, ::-1][:, :2], atol=1e-5)


def _dense_penalties(rows, width):
    """The rows' counts/seen lists as the dense per-row tables the incremental engine path gives."""
    pen = [i for i, r in enumerate(rows) if r.get("counts") or r.get("seen")]
    counts = torch.zeros((len(pen), width), dtype=torch.float32)
    seen = torch.zeros((len(pen), width), dtype=torch.bool)
    for k, i in enumerate(pen):
        for t, c in (rows[i].get("counts") or {}).items():
            counts[k, t] = c
            seen[k, t] = c > 0
        for t in rows[i].get("seen", ()):
            seen[k, t] = True
    return torch.tensor(pen, dtype=torch.int64), counts, seen


@pytest.mark.parametrize("width", [48, V, 100])  # tables narrower than, equal to, wider than the vocabulary
def test_dense_penalties_match_sparse_path_and_numpy(logits, width):
    rows = [dict(r) for r in ROWS] + [{"repetition": 0.8, "counts": {3: 1}, "seen": [3, 5], "frequency": -0.3}]
    rows[4]["seen"] = sorted(set(rows[4]["seen"]) | set(rows[4]["counts"]))  # seen = prompt or output
    lg = torch.from_numpy(np.vstack([logits, logits[:1]]))
    sparse = make_batch(rows)
    dense = make_batch([{k: v for k, v in r.items() if k not in ("counts", "seen")} for r in rows])
    dense.penalty_rows, dense.penalty_counts, dense.penalty_seen = _dense_penalties(rows, width)
    x_dense = apply_logits_processing(lg, dense)
    assert torch.equal(x_dense, apply_logits_processing(lg, sparse))  # identical math
    for i, r in enumerate(rows):
        np.testing.assert_allclose(x_dense[i].numpy(), process_row(lg[i].numpy(), **_ref_kwargs(r)),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [1e-37, 5e-38, 1e-40, 1e-6])
def test_tiny_temperatures_sample_the_argmax_not_nan(logits, temperature):
    # logits / 1e-37 overflows float32: without the greedy threshold softmax is NaN and token 0 wins.
    rows = [{"temperature": temperature, "seed": s, "top_p": 0.9, "min_p": 0.1} for s in range(len(logits))]
    out = sample(torch.from_numpy(logits), make_batch(rows)).tokens.tolist()
    assert out == [int(np.argmax(row)) for row in logits]
    assert all(np.isfinite(sampling_probs(torch.from_numpy(logits), make_batch(rows)).numpy()).ravel())
