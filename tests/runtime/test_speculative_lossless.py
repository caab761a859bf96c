"""Rejection sampling through the whole engine keeps the model's distribution: a tiny random
model sampled at temperature 1 (top-k 4) with and without speculation, the speculative engine fed
deliberately bad drafts (oracle drafts chosen among the tokens the model rarely samples there);
a two-sample chi-square test per output position finds no difference, while the same test does
tell the drafts apart from the model's samples."""

from __future__ import annotations

import numpy as np
import pytest
import torch

N = 1500
PROMPT = [5, 9, 17, 33]


def _homogeneity_p(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample chi-square p-value that samples ``a`` and ``b`` come from one distribution
    (categories with an expected count under 5 pooled)."""
    cats = sorted(set(a.tolist()) | set(b.tolist()))
    table = np.array([[np.sum(x == c) for c in cats] for x in (a, b)], dtype=np.float64)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    small = expected.min(0) < 5
    if small.any():
        table = np.concatenate([table[:, ~small], table[:, small].sum(1, keepdims=True)], axis=1)
        expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    df = table.shape[1] - 1
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    pytest.importorskip("deepinfer_engine", reason="the C++ engine (deepinfer-engine) is not built/installed")
    from tiny_models import save_tiny_model, save_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny-spec")
    save_tiny_model(path, "llama", seed=3)
    save_tiny_tokenizer(path)
    return str(path)


def _samples(llm, params):
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * N, params, use_tqdm=False)
    return np.array([list(o.outputs[0].token_ids) for o in outs])


def test_rejection_sampling_through_the_engine_keeps_the_distribution(tiny_dir):
    from deepinfer import LLM, SamplingParams

    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=4, ignore_eos=True)
    common = dict(dtype="float32", max_model_len=64, max_num_seqs=256, device="cpu")
    plain = _samples(LLM(tiny_dir, **common), params)
    # the drafts of positions 2 and 3: tokens the model samples there, but rarely
    rare = []
    for pos in (1, 2):
        values, counts = np.unique(plain[:, pos], return_counts=True)
        rare.append(int(values[np.argmin(counts)]))
    spec_llm = LLM(tiny_dir, **common, speculative_config={"method": "oracle", "num_speculative_tokens": 2})
    spec_llm.engine.speculator.record_oracle(PROMPT, [0, rare[0], rare[1], 0])
    spec = _samples(spec_llm, params)
    st = spec_llm.engine.speculator.stats
    assert st.num_draft_tokens >= N and 0 < st.acceptance_rate < 0.5, st.as_dict()  # bad drafts, verified
    for pos in range(4):
        assert _homogeneity_p(plain[:, pos], spec[:, pos]) > 1e-3, pos
    # position 2 and 3 jointly (the second draft is verified only after the first was kept)
    assert _homogeneity_p(plain[:, 1] * 1000 + plain[:, 2], spec[:, 1] * 1000 + spec[:, 2]) > 1e-3
    # the test can fail: the drafts themselves are far from the model's samples
    assert _homogeneity_p(plain[:, 1], np.full(N, rare[0])) < 1e-6
