"""Speculative decoding, the parts without a model: the n-gram proposer (vLLM's cases), the
config's checks, the verification (greedy cases as vLLM's rejection-sampler tests, and a
chi-square test that rejection sampling keeps the target distribution with a bad draft)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from deepinfer.runtime.speculative.config import SpeculativeConfig, parse_speculative_config
from deepinfer.runtime.speculative.metrics import SpecDecodeStats
from deepinfer.runtime.speculative.ngram import propose_ngram
from deepinfer.runtime.speculative.rejection import verify_drafts


def ng(tokens, lo, hi, k):
    return propose_ngram(np.array(tokens), lo, hi, k).tolist()


# ---- n-gram proposer (the behaviours of vLLM's tests/v1/spec_decode/test_ngram.py) ----------
def test_ngram_no_match():
    assert ng([1, 2, 3, 4, 5], 2, 2, 2) == []
    assert ng([1, 2, 3, 4, 1, 2, 3], 4, 4, 2) == []
    assert ng([1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2) == []


def test_ngram_drafts_follow_the_match_and_may_run_into_the_suffix():
    assert ng([1, 2, 3, 4, 1, 2, 3], 2, 2, 3) == [4, 1, 2]
    assert ng([1, 2, 3, 4, 1, 2, 3], 2, 2, 2) == [4, 1]
    assert ng([1, 2, 3, 4, 1, 2, 3], 1, 1, 3) == [4, 1, 2]
    assert ng([1, 3, 6, 2, 3, 4, 1, 2, 3], 2, 2, 3) == [4, 1, 2]


def test_ngram_first_match_wins_for_one_length():
    assert ng([1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 1, 2) == [6, 2]
    assert ng([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 3, 3, 2) == [100, 1]


def test_ngram_longest_length_wins():
    assert ng([1, 2, 3, 4, 1, 2, 3], 3, 4, 2) == [4, 1]
    assert ng([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 3, 4, 2) == [1, 2]  # the 4-gram, not [5, 1]
    assert ng([3, 4, 5, 2, 3, 4, 1, 2, 3, 4], 2, 4, 2) == [1, 2]  # the 3-gram, not [5, 2]


def test_ngram_fewer_than_k_near_the_end_and_degenerate_inputs():
    assert ng([7, 8, 7], 1, 1, 5) == [8, 7]
    assert ng([5], 1, 3, 2) == []
    assert ng([], 1, 3, 2) == []
    assert ng([1, 2, 1], 1, 2, 0) == []


def test_ngram_matches_a_brute_force_reference():
    rng = np.random.default_rng(0)
    for _ in range(300):
        t = rng.integers(0, 4, size=int(rng.integers(1, 20))).tolist()
        lo, hi, k = int(rng.integers(1, 3)), int(rng.integers(2, 5)), int(rng.integers(1, 5))
        hi = max(lo, hi)
        want: list[int] = []
        for n in range(hi, lo - 1, -1):
            if n >= len(t):
                continue
            hits = [i for i in range(len(t) - n) if t[i:i + n] == t[len(t) - n:]]
            if hits:
                want = t[hits[0] + n:hits[0] + n + k]
                break
        assert ng(t, lo, hi, k) == want, (t, lo, hi, k)


# ---- config -----------------------------------------------------------------------------------
def test_config_accepts_vllm_keys_dicts_and_json():
    c = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5,
                                  "prompt_lookup_min": 2})
    assert c == SpeculativeConfig("ngram", 3, 2, 5)
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2}') == SpeculativeConfig(
        "ngram", 2, 2, 5)
    assert parse_speculative_config(None) is None


@pytest.mark.parametrize("given, lo, hi", [({}, 2, 5), ({"prompt_lookup_max": 1}, 1, 1), ({"prompt_lookup_max": 3}, 2, 3),
                                           ({"prompt_lookup_max": 9}, 2, 9), ({"prompt_lookup_min": 1}, 1, 5),
                                           ({"prompt_lookup_min": 7}, 7, 7)])
def test_lookup_defaults_never_contradict_the_key_given(given, lo, hi):
    # defaults 2..5; one key alone moves the other's default so that min <= max (vLLM: min = max)
    c = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, **given})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (lo, hi)


@pytest.mark.parametrize("value, err, match", [
    ({"num_speculative_tokens": 2}, ValueError, r"\['method'\] is required"),
    ({"method": "eagle", "num_speculative_tokens": 2}, ValueError, r"\['method'\] must be one of"),
    ({"method": "ngram"}, ValueError, r"\['num_speculative_tokens'\] is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, ValueError, r"\['num_speculative_tokens'\] must be in"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, TypeError, r"\['num_speculative_tokens'\] must be an int"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     ValueError, r"\['prompt_lookup_min'\] \(4\) must be <="),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, ValueError, r"unknown key 'lookahead'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, ValueError, r"\['model'\] is required"),
    ({"method": "draft_model", "model": "ngram", "num_speculative_tokens": 2}, ValueError, r"\['model'\] is required"),
    ({"method": "draft_model", "model": 3, "num_speculative_tokens": 2}, TypeError, r"\['model'\] must be a path"),
    ({"method": "ngram", "model": "/a/draft", "num_speculative_tokens": 2}, ValueError, "needs method 'draft_model'"),
    ({"model": "/a/draft", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, ValueError,
     "belong to method 'ngram'"),
    ("{not json", ValueError, "not a JSON object"),
    ([1, 2], TypeError, "must be a dict"),
])
def test_config_errors_name_the_key(value, err, match):
    with pytest.raises(err, match=match):
        parse_speculative_config(value)


def test_the_method_is_inferred_from_the_model_as_vllm_does():
    # vLLM: no method + a model -> "ngram" for the names "ngram"/"[ngram]", else a draft model
    assert parse_speculative_config({"model": "/a/draft", "num_speculative_tokens": 3}) == \
        SpeculativeConfig("draft_model", 3, model="/a/draft")
    assert parse_speculative_config({"model": "[ngram]", "num_speculative_tokens": 3}).method == "ngram"
    got = parse_speculative_config('{"method": "draft_model", "model": "/a/d", "num_speculative_tokens": 2}')
    assert got.to_dict() == {"method": "draft_model", "num_speculative_tokens": 2, "model": "/a/d"}
    assert parse_speculative_config(got.to_dict()) == got


def test_engine_args_and_cli_take_the_config():
    from deepinfer.runtime.engine_args import EngineArgs

    a = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert a.speculative_config == SpeculativeConfig("ngram", 2, 2, 5)
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    ns = p.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'])
    assert EngineArgs.from_cli_args(ns).speculative_config.num_speculative_tokens == 5
    with pytest.raises(ValueError, match=r"speculative_config\['num_speculative_tokens'\]"):
        EngineArgs.from_cli_args(p.parse_args(["--speculative-config", '{"method": "ngram", '
                                               '"num_speculative_tokens": 99}']))
    assert "--speculative-config" in EngineArgs.markdown_table()


# ---- verification -------------------------------------------------------------------------
def _greedy_verify(drafts_per_seq, argmax_per_seq, bonus):
    cu = np.cumsum([0] + [len(d) for d in drafts_per_seq])
    flat = [t for d in drafts_per_seq for t in d]
    am = [t for a in argmax_per_seq for t in a]
    v = verify_drafts(torch.tensor(flat, dtype=torch.int64), cu, torch.ones(len(flat), dtype=torch.bool),
                      torch.tensor(am, dtype=torch.int64), None, torch.tensor(bonus, dtype=torch.int64))
    return [v.tokens[s, :v.num_accepted[s] + 1].tolist() for s in range(len(drafts_per_seq))]


def test_greedy_perfect_match_appends_the_bonus():
    assert _greedy_verify([[1, 2, 3]], [[1, 2, 3]], [4]) == [[1, 2, 3, 4]]


def test_greedy_early_mismatch_takes_the_target_token():
    assert _greedy_verify([[1, 2, 3]], [[1, 5, 3]], [4]) == [[1, 5]]
    assert _greedy_verify([[1, 2, 3]], [[9, 2, 3]], [4]) == [[9]]


def test_greedy_several_sequences_and_lengths():
    got = _greedy_verify([[1, 2], [3], [4, 5, 6]], [[1, 2], [7], [4, 8, 6]], [10, 11, 12])
    assert got == [[1, 2, 10], [7], [4, 8]]


def test_no_drafts_at_all():
    v = verify_drafts(torch.zeros(0, dtype=torch.int64), np.array([0]), torch.zeros(0, dtype=torch.bool),
                      torch.zeros(0, dtype=torch.int64), None, torch.zeros(0, dtype=torch.int64))
    assert v.num_accepted.shape == (0,)


def test_random_rows_need_target_probs():
    with pytest.raises(ValueError, match="target_probs"):
        verify_drafts(torch.tensor([1]), np.array([0, 1]), torch.tensor([False]), torch.tensor([1]), None,
                      torch.tensor([2]))


def test_a_certain_target_always_keeps_its_draft():
    p = torch.zeros(2, 5)
    p[:, 3] = 1.0
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        v = verify_drafts(torch.tensor([3, 3]), np.array([0, 2]), torch.tensor([False, False]),
                          torch.tensor([3, 3]), p, torch.tensor([4]), g)
        assert v.tokens[0].tolist() == [3, 3, 4]


def _chi_square_p(counts, probs, n):
    """Pearson's chi-square goodness-of-fit p-value (the upper regularised gamma function)."""
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of target probability 0 was produced"
    expected = probs[keep] * n
    stat = float((((counts[keep] - expected) ** 2) / expected).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_chi_square_helper_against_known_values():
    # chi2.sf(3.84146, 1) = 0.05 and chi2.sf(11.0705, 5) = 0.05 (tables)
    p = float(torch.special.gammaincc(torch.tensor(0.5, dtype=torch.float64), torch.tensor(3.84146 / 2)))
    assert p == pytest.approx(0.05, abs=1e-4)
    p = float(torch.special.gammaincc(torch.tensor(2.5, dtype=torch.float64), torch.tensor(11.0705 / 2)))
    assert p == pytest.approx(0.05, abs=1e-4)


@pytest.mark.parametrize("draft_probs_kind", ["one_hot", "distribution"])
def test_rejection_sampling_keeps_the_target_distribution_with_a_bad_draft(draft_probs_kind):
    """Two drafts per sequence, both drawn from a draft distribution far from the target's:
    the first output token must follow p0, and the second (when the first was kept) p1."""
    torch.manual_seed(0)
    vocab, n = 6, 40_000
    p0 = torch.tensor([0.05, 0.4, 0.25, 0.1, 0.15, 0.05])
    p1 = torch.tensor([0.3, 0.05, 0.05, 0.3, 0.2, 0.1])
    q = torch.tensor([0.6, 0.02, 0.02, 0.02, 0.04, 0.3])  # a deliberately bad draft
    g = torch.Generator().manual_seed(1234)
    drafts = torch.multinomial(q, 2 * n, replacement=True, generator=g).view(n, 2)
    probs = torch.stack([p0, p1]).repeat(n, 1)
    dprobs = q.repeat(2 * n, 1) if draft_probs_kind == "distribution" else None
    bonus = torch.multinomial(p1, n, replacement=True, generator=g)  # (unused by the check)
    cu = np.arange(0, 2 * n + 1, 2)
    v = verify_drafts(drafts.flatten(), cu, torch.zeros(2 * n, dtype=torch.bool), probs.argmax(1), probs,
                      bonus, g, dprobs)
    first = np.bincount(v.tokens[:, 0], minlength=vocab)
    assert _chi_square_p(first, p0.numpy(), n) > 1e-3
    kept = v.num_accepted >= 1
    second = np.bincount(v.tokens[kept, 1], minlength=vocab)
    assert _chi_square_p(second, p1.numpy(), int(kept.sum())) > 1e-3
    # and the check can fail: the drafts themselves do not follow p0
    assert _chi_square_p(np.bincount(drafts[:, 0].numpy(), minlength=vocab), p0.numpy(), n) < 1e-6


def test_stats_rates_and_positions():
    s = SpecDecodeStats(3)
    s.observe(np.array([3, 3, 0, 2]), np.array([3, 1, 0, 0]))
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 8, 4)
    assert s.acceptance_rate == 0.5
    assert s.mean_accepted_length == pytest.approx(1 + 4 / 3)
    assert s.accepted_per_pos == [2, 1, 1]


# ---- the engine's process_MTPInfo: per-row draft counts (-1 padding) and top-k logprobs ------
def _two_prefilled(logprobs=None):
    E = pytest.importorskip("deepinfer_engine._engine", reason="the C++ engine (deepinfer-engine) is not built")
    s = E.Scheduler(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                    vocab_size=300)
    s.add_request("a", [1, 2, 3, 4, 5], E.SamplingParams(max_tokens=20, logprobs=logprobs))
    s.add_request("b", [7, 8, 9], E.SamplingParams(max_tokens=20, logprobs=logprobs))
    s.schedule()
    return E, s


def test_next_drafts_rows_end_at_minus_one():
    E, s = _two_prefilled()
    E.process_MTPInfo(s, np.zeros(2, np.int32), np.array([[10], [20]], np.int32),
                      np.array([[100, 101, 102], [-1, -1, -1]], np.int32))
    a, b = s.get_sequences("a")[0], s.get_sequences("b")[0]
    assert a.draft_token_ids.tolist() == [100, 101, 102] and b.draft_token_ids.tolist() == []
    out = s.schedule()
    assert out.num_scheduled_tokens.tolist() == [4, 1]  # a verifies 3 drafts, b decodes plainly
    E.process_MTPInfo(s, np.array([1, 0], np.int32), np.array([[100, 7], [21, 0]], np.int32),
                      np.array([[5, -1], [6, 7]], np.int32))
    assert s.get_sequence(a.seq_id).token_ids.tolist() == [1, 2, 3, 4, 5, 10, 100, 7]
    assert s.get_sequence(a.seq_id).draft_token_ids.tolist() == [5]
    assert s.get_sequence(b.seq_id).draft_token_ids.tolist() == [6, 7]


def test_next_drafts_after_minus_one_and_topk_shapes_are_refused():
    E, s = _two_prefilled(logprobs=2)
    with pytest.raises(ValueError, match="next_drafts.*follows a -1"):
        E.process_MTPInfo(s, np.zeros(2, np.int32), np.array([[10], [20]], np.int32),
                          np.array([[-1, 5], [1, 2]], np.int32))
    with pytest.raises(ValueError, match="topk_token_ids.*given together"):
        E.process_MTPInfo(s, np.zeros(2, np.int32), np.array([[10], [20]], np.int32), None, None,
                          np.zeros((2, 1, 2), np.int32))
    with pytest.raises(ValueError, match="topk_token_ids"):
        E.process_MTPInfo(s, np.zeros(2, np.int32), np.array([[10], [20]], np.int32), None, None,
                          np.zeros((2, 2, 2), np.int32), np.zeros((2, 2, 2), np.float32))
    # nothing changed: the step applies now, with its top-k
    ids = np.array([[[10, 11]], [[20, 21]]], np.int32)
    vals = np.array([[[-0.5, -1.5]], [[-0.25, -2.0]]], np.float32)
    E.process_MTPInfo(s, np.zeros(2, np.int32), np.array([[10], [20]], np.int32), None,
                      np.array([[-0.5], [-0.25]], np.float32), ids, vals)
    outs = {ro.request_id: ro for ro in E.build_request_outputs(s, E.RequestOutputPool(4))}
    lp = outs["a"].outputs[0].logprobs[0]
    assert lp[10] == pytest.approx(-0.5) and lp[11] == pytest.approx(-1.5)
    assert outs["b"].outputs[0].logprobs[0][21] == pytest.approx(-2.0)
