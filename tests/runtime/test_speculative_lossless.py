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
NOISE = 0.03  # the bad draft: the target's weights plus N(0, NOISE^2) noise (about a third of its drafts kept)
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


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    from tiny_models import save_tiny_model, save_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny-draft")
    save_tiny_tokenizer(path)  # (the test also samples the draft model alone)
    # a bad draft of tiny_dir's model: the same weights (seed 3) with noise on every matrix
    model = save_tiny_model(path, "llama", seed=3)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * NOISE)
    model.save_pretrained(path)
    return str(path)


def test_a_bad_draft_model_keeps_the_distribution(tiny_dir, draft_dir):
    """Sampled drafts from a perturbed copy of the model, verified with their q: the samples are
    the target's (per position and jointly), not the draft's."""
    from deepinfer import LLM, SamplingParams

    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=4, ignore_eos=True)
    common = dict(dtype="float32", max_model_len=64, max_num_seqs=256, device="cpu")
    plain = _samples(LLM(tiny_dir, **common), params)
    spec_llm = LLM(tiny_dir, **common, speculative_config={"method": "draft_model", "model": draft_dir,
                                                           "num_speculative_tokens": 2})
    spec = _samples(spec_llm, params)
    st = spec_llm.engine.speculator.stats
    assert st.num_draft_tokens >= N and 0.05 < st.acceptance_rate < 0.9, st.as_dict()
    for pos in range(4):
        assert _homogeneity_p(plain[:, pos], spec[:, pos]) > 1e-3, pos
    assert _homogeneity_p(plain[:, 1] * 1000 + plain[:, 2], spec[:, 1] * 1000 + spec[:, 2]) > 1e-3
    # the test can fail: the draft model's own samples (what keeping every draft would give) differ
    own = _samples(LLM(draft_dir, **common), params)
    assert min(_homogeneity_p(plain[:, pos], own[:, pos]) for pos in range(4)) < 1e-6


def test_draft_model_errors_and_its_share_of_the_kv_budget(tiny_dir, draft_dir, tmp_path):
    from deepinfer import LLM
    from tiny_models import save_tiny_model

    common = dict(dtype="float32", max_model_len=64, device="cpu", cpu_kv_cache_bytes=1 << 20)
    other = tmp_path / "other-vocab"
    save_tiny_model(other, "llama", seed=1, vocab=384)
    with pytest.raises(ValueError, match=r"vocab_size 384 differs from the target model's 320"):
        LLM(tiny_dir, **common, speculative_config={"model": str(other), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"neither a GGUF file nor a model directory"):
        LLM(tiny_dir, **common, speculative_config={"model": str(tmp_path / "nope"), "num_speculative_tokens": 2})
    # one block of 16 tokens: 2 layers x (K, V) x 2 kv heads x 16 dims x 4 bytes = 8 KiB per model
    assert LLM(tiny_dir, **common).worker.num_blocks == (1 << 20) // 8192
    llm = LLM(tiny_dir, **common, speculative_config={"model": draft_dir, "num_speculative_tokens": 2})
    assert llm.worker.num_blocks == llm.worker.draft_runner.num_blocks == (1 << 20) // (2 * 8192)
    assert llm.engine.speculator.config.method == "draft_model"


def test_sampling_under_the_overlap_loop_keeps_the_distribution(tiny_dir):
    """The overlap loop (ZOS) with n-gram drafts: steps whose lookups miss run ahead as plain
    decode steps, the others verify by rejection sampling; every position still follows the
    model's distribution (the seeded exact-distribution tests above run the synchronous loop)."""
    from deepinfer import LLM, SamplingParams

    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=8, ignore_eos=True)
    common = dict(dtype="float32", max_model_len=64, max_num_seqs=256, device="cpu")
    plain = _samples(LLM(tiny_dir, **common), params)
    # (small batches: a step runs ahead only when no sequence of it is expected to draft)
    spec_llm = LLM(tiny_dir, **dict(common, max_num_seqs=4), overlap_scheduling=True,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                                       "prompt_lookup_max": 2})
    spec = _samples(spec_llm, params)
    st = spec_llm.engine.speculator.stats
    assert st.num_draft_tokens >= 100 and st.num_accepted_tokens >= 10, st.as_dict()
    assert spec_llm.engine.overlap.num_ahead >= 100, spec_llm.engine.overlap.num_ahead
    for pos in range(8):
        assert _homogeneity_p(plain[:, pos], spec[:, pos]) > 1e-3, pos
    assert _homogeneity_p(plain[:, 4] * 1000 + plain[:, 5], spec[:, 4] * 1000 + spec[:, 5]) > 1e-3
