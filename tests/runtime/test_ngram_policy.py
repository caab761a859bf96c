"""The n-gram proposer's match choice (``ngram_match``) and adaptive draft length
(``draft_length``): hand-computed cases, a brute-force reference, the config's checks, and
greedy output token for token the plain one with each policy through the engine loop (also
under the overlap loop)."""

from __future__ import annotations

import numpy as np
import pytest
from deepinfer.runtime.sampling_params import SamplingParams
from deepinfer.runtime.speculative.config import SpeculativeConfig, parse_speculative_config
from deepinfer.runtime.speculative.ngram import MAX_CONTEXT_EXTENSION, next_draft_cap, propose_ngram


def ng(tokens, lo, hi, k, match):
    return propose_ngram(np.array(tokens), lo, hi, k, match).tolist()


# [1, 2, 3] occurs at 1 (after 9), 6 (after 5) and 11 (after 6); the suffix [1, 2, 3] follows a 5
THREE = [9, 1, 2, 3, 10, 5, 1, 2, 3, 11, 6, 1, 2, 3, 12, 5, 1, 2, 3]


def test_earliest_latest_and_longest_context_pick_different_occurrences():
    assert ng(THREE, 3, 3, 1, "earliest") == [10]
    assert ng(THREE, 3, 3, 1, "latest") == [12]
    assert ng(THREE, 3, 3, 1, "longest") == [11]  # the one after a 5, as the suffix is
    assert ng(THREE, 3, 3, 3, "earliest") == [10, 5, 1]
    assert ng(THREE, 3, 3, 3, "latest") == [12, 5, 1]
    assert ng(THREE, 3, 3, 3, "longest") == [11, 6, 1]
    assert (
        ng(THREE, 3, 3, 3, "earliest") == propose_ngram(np.array(THREE), 3, 3, 3).tolist()
    )  # the default


def test_longest_context_compares_further_back_and_ties_go_to_the_latest():
    # both earlier [1, 2, 3] follow a 5; only the first follows 4, 5 as the suffix does
    assert ng([4, 5, 1, 2, 3, 10, 7, 5, 1, 2, 3, 11, 4, 5, 1, 2, 3], 3, 3, 1, "longest") == [10]
    assert ng([4, 5, 1, 2, 3, 10, 7, 5, 1, 2, 3, 11, 4, 5, 1, 2, 3], 3, 3, 1, "latest") == [11]
    # a tie (both follow a 5, then the sequence start / a 10 against an 11): the latest
    assert ng([5, 1, 2, 3, 10, 5, 1, 2, 3, 11, 5, 1, 2, 3], 3, 3, 1, "longest") == [11]
    assert ng([5, 1, 2, 3, 10, 5, 1, 2, 3, 11, 5, 1, 2, 3], 3, 3, 1, "earliest") == [10]


def test_the_longest_n_gram_still_wins_before_the_match_choice():
    # the 3-gram [2, 3, 4] occurs once (-> 7); the 2-gram [3, 4] also later (-> 8): n first
    t = [2, 3, 4, 7, 3, 4, 8, 2, 3, 4]
    for match in ("earliest", "latest", "longest"):
        assert ng(t, 2, 3, 1, match) == [7]
    assert ng(t, 2, 2, 1, "latest") == [8]


def test_the_longest_context_is_compared_only_so_far_back():
    # two occurrences share a run of 2 * MAX_CONTEXT_EXTENSION zeros before them; past the cap
    # they tie, and the latest wins although the earlier one's context is longer
    run = [0] * (2 * MAX_CONTEXT_EXTENSION)
    t = [1] + run + [5, 6, 10] + [2] + run + [5, 6, 11] + [1] + run + [5, 6]
    assert ng(t, 2, 2, 1, "longest") == [11]


def brute(t, lo, hi, k, match):
    for n in range(hi, lo - 1, -1):
        if n >= len(t):
            continue
        hits = [i for i in range(len(t) - n) if t[i : i + n] == t[len(t) - n :]]
        if not hits:
            continue
        if match == "earliest":
            at = hits[0]
        elif match == "latest":
            at = hits[-1]
        else:

            def context(i, n=n):  # tokens before the window equal to those before the suffix
                c = 0
                while i - c - 1 >= 0 and t[i - c - 1] == t[len(t) - n - c - 1]:
                    c += 1
                return c

            best = max(context(i) for i in hits)
            at = [i for i in hits if context(i) == best][-1]
        return t[at + n : at + n + k]
    return []


@pytest.mark.parametrize("match", ["earliest", "latest", "longest"])
def test_each_match_agrees_with_a_brute_force_reference(match):
    rng = np.random.default_rng(1)
    for _ in range(400):
        t = rng.integers(0, 3, size=int(rng.integers(1, 24))).tolist()
        lo, hi, k = int(rng.integers(1, 3)), int(rng.integers(2, 5)), int(rng.integers(1, 6))
        hi = max(lo, hi)
        assert ng(t, lo, hi, k, match) == brute(t, lo, hi, k, match), (t, lo, hi, k)


def test_an_unknown_match_is_refused():
    with pytest.raises(
        ValueError, match="match must be one of earliest, latest, longest, got 'first'"
    ):
        propose_ngram(np.array([1, 2, 1, 2]), 1, 2, 2, "first")


def test_the_adaptive_cap_halves_after_a_rejection_and_doubles_after_a_full_acceptance():
    k, cap, caps = 7, 7, []
    # (drafts verified, kept) per step
    for drafts, kept in [
        (7, 7),
        (7, 2),
        (3, 3),
        (6, 0),
        (3, 1),
        (2, 0),
        (2, 2),
        (4, 4),
        (0, 0),
        (5, 4),
    ]:
        cap = next_draft_cap(cap, k, drafts, kept)
        caps.append(cap)
    assert caps == [7, 3, 6, 3, 2, 2, 4, 7, 7, 3]
    # fewer drafts than the cap (the lookup found fewer), all kept: it still doubles
    assert next_draft_cap(4, 7, 2, 2) == 7 and next_draft_cap(2, 7, 1, 1) == 4
    # never below min(2, k)
    assert next_draft_cap(1, 1, 1, 0) == 1 and next_draft_cap(2, 4, 2, 0) == 2


# ---- config -----------------------------------------------------------------------------------
def test_config_takes_the_policy_keys_with_today_s_behaviour_by_default():
    c = parse_speculative_config(
        {
            "method": "ngram",
            "num_speculative_tokens": 7,
            "prompt_lookup_min": 3,
            "ngram_match": "longest",
            "draft_length": "adaptive",
        }
    )
    assert (c.ngram_match, c.draft_length, c.prompt_lookup_min, c.prompt_lookup_max) == (
        "longest",
        "adaptive",
        3,
        5,
    )
    assert c.to_dict()["ngram_match"] == "longest" and c.to_dict()["draft_length"] == "adaptive"
    d = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4})
    assert (d.ngram_match, d.draft_length) == (
        "earliest",
        "fixed",
    ) and "ngram_match" not in d.to_dict()
    assert parse_speculative_config(c.to_dict()) == c
    assert SpeculativeConfig("ngram", 4).ngram_match == "earliest"


@pytest.mark.parametrize(
    "value, match",
    [
        (
            {"ngram_match": "first"},
            r"speculative_config\['ngram_match'\] must be one of 'earliest', 'latest', "
            r"'longest', got 'first'",
        ),
        ({"ngram_match": 1}, r"\['ngram_match'\] must be one of .* got 1"),
        (
            {"draft_length": "auto"},
            r"speculative_config\['draft_length'\] must be one of 'fixed', 'adaptive', "
            r"got 'auto'",
        ),
        ({"draft_length": None}, r"\['draft_length'\] must be one of .* got None"),
    ],
)
def test_bad_policy_values_name_the_key(value, match):
    with pytest.raises(ValueError, match=match):
        parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4, **value})


def test_the_policy_keys_belong_to_the_ngram_method():
    for key, v in (("ngram_match", "longest"), ("draft_length", "adaptive")):
        with pytest.raises(
            ValueError, match=rf"speculative_config\['{key}'\]: .* belong to method 'ngram'"
        ):
            parse_speculative_config(
                {"method": "draft_model", "model": "/a/draft", "num_speculative_tokens": 3, key: v}
            )


# ---- through the engine loop: lossless with each policy ---------------------------------------------
@pytest.fixture(scope="module")
def engine_helpers():
    import test_speculative_engine as h

    return h


@pytest.fixture(scope="module")
def prompt_ids(tokenizer, engine_helpers):
    return [tokenizer.encode(p) for p in engine_helpers.PROMPTS]


@pytest.fixture(scope="module")
def baseline(loaded_default, tokenizer, prompt_ids, engine_helpers):
    h = engine_helpers
    return h.tokens_of(
        h.run(
            h.make_loop(loaded_default, tokenizer),
            prompt_ids,
            SamplingParams(temperature=0, max_tokens=40),
        )
    )


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(
    "match, length", [("longest", "adaptive"), ("latest", "fixed"), ("earliest", "adaptive")]
)
def test_greedy_output_is_the_plain_output_with_each_policy(
    loaded_default, tokenizer, prompt_ids, baseline, engine_helpers, match, length, overlap
):
    h = engine_helpers
    spec = dict(
        h.NGRAM,
        num_speculative_tokens=7,
        prompt_lookup_min=2,
        ngram_match=match,
        draft_length=length,
    )
    loop = h.make_loop(loaded_default, tokenizer, spec, overlap=overlap)
    got = h.tokens_of(h.run(loop, prompt_ids, SamplingParams(temperature=0, max_tokens=40)))
    assert got == baseline
    st = loop.speculator.stats
    assert st.num_draft_tokens > 20 and st.num_accepted_tokens > 10, st
    if length == "adaptive":  # the caps were kept per sequence and moved below k
        caps = [cap for _, cap in loop.speculator._caps.values()]
        assert caps and all(2 <= c <= 7 for c in caps), caps


def test_adaptive_drafts_follow_the_cap_step_by_step(
    loaded_default, tokenizer, prompt_ids, engine_helpers, monkeypatch
):
    """Each verify step of a sequence drafts at most the cap that ``next_draft_cap`` gives from its
    previous verify step (k before the first), replayed from the loop's own (drafts, kept) counts."""
    from deepinfer.runtime.speculative import speculator as sp

    h = engine_helpers
    seen: list[tuple[int, int, int]] = []  # (seq id, drafts verified, kept), in step order
    orig = sp.Speculator.next_drafts

    def spy(self, scheduler, step):
        for r, sid in enumerate(step.seq_ids):
            if sid >= 0 and step.num_drafts[r]:
                seen.append((int(sid), int(step.num_drafts[r]), int(step.num_accepted[r])))
        return orig(self, scheduler, step)

    monkeypatch.setattr(sp.Speculator, "next_drafts", spy)
    spec = dict(h.NGRAM, num_speculative_tokens=7, prompt_lookup_min=2, draft_length="adaptive")
    loop = h.make_loop(loaded_default, tokenizer, spec)
    h.run(loop, prompt_ids, SamplingParams(temperature=0, max_tokens=60))
    caps: dict[int, int] = {}
    shrank = False
    for sid, drafts, kept in seen:
        cap = caps.get(sid, 7)
        assert drafts <= cap, (sid, drafts, cap)
        caps[sid] = next_draft_cap(cap, 7, drafts, kept)
        shrank |= caps[sid] < 7
    assert len(seen) > 5 and shrank
