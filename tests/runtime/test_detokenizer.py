"""Incremental detokenization equals a full decode; stop strings cut at the right character."""

from __future__ import annotations

import pytest
from deepinfer.runtime.engine.detokenizer import IncrementalDetokenizer, decode_completion

TEXTS = [
    "Hello, world! The café costs 3€ — naïve 日本語 テキスト 🙂 done.",
    "  leading spaces\nand\ttabs\n\nnew paragraphs <|im_end|> after special",
    "def f(x):\n    return x ** 2  # squared",
]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True)
    streamed = ""
    for t in ids:
        assert d.append([t]) is None
        streamed += d.take_delta()
    d.finish()
    streamed += d.take_delta()
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert d.text == expected
    assert streamed == expected
    assert decode_completion(tokenizer, prompt, ids) == expected


@pytest.mark.parametrize("stop", [(), ("never",)], ids=["no-stop", "stop-strings"])
def test_append_delta_is_append_then_take_delta_at_any_split(tokenizer, stop):
    import random

    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    ids = tokenizer.encode(" ".join(TEXTS), add_special_tokens=False)
    rng = random.Random(0)
    for _ in range(5):
        fused = IncrementalDetokenizer(tokenizer, prompt, stop=stop)
        plain = IncrementalDetokenizer(tokenizer, prompt, stop=stop)
        at = 0
        while at < len(ids):
            step = ids[at:at + rng.randint(1, 3)]
            at += len(step)
            plain.append(step)
            assert fused.append_delta(step) == plain.take_delta()
            assert fused.text == plain.text
        fused.append([], final=True)
        plain.append([], final=True)
        assert fused.text == plain.text == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("max_parts", [1, 2, 1024])
def test_text_in_pieces_reads_the_same_wherever_they_were_joined(tokenizer, monkeypatch, max_parts):
    # The text is kept as pieces, joined every _MAX_PARTS and whenever ``text`` is read: deltas,
    # ``text`` and a stop string's cut must not depend on where that happened.
    import random

    from deepinfer.runtime.engine import detokenizer

    monkeypatch.setattr(detokenizer, "_MAX_PARTS", max_parts)
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    body = " ".join(TEXTS * 3)
    ids = tokenizer.encode(body, add_special_tokens=False)
    rng = random.Random(max_parts)
    for stop in ((), ("never",), ("STOP",)):
        d = IncrementalDetokenizer(tokenizer, prompt, stop=stop)
        text_ids = ids + tokenizer.encode(" then STOP and more", add_special_tokens=False) if stop == ("STOP",) else ids
        streamed, at, hit = "", 0, None
        while at < len(text_ids) and hit is None:
            step = text_ids[at:at + rng.randint(1, 3)]
            at += len(step)
            if stop:
                hit = d.append(step)
                streamed += d.take_delta()
            else:
                streamed += d.append_delta(step)
            if rng.random() < 0.2:  # a read of the whole text joins the pieces
                assert d.text.startswith(streamed)
        d.append([], final=True)
        d.finish()
        streamed += d.take_delta()
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        want = whole + " then " if stop == ("STOP",) else whole  # cut where the stop string starts
        assert hit == ("STOP" if stop == ("STOP",) else None)
        assert d.text == want and streamed == want, (stop, max_parts)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_finishes_at_the_right_character(tokenizer, include):
    text = "The answer is 42. STOP here and never print this"
    ids = tokenizer.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, [], stop=["never", "STOP"], include_stop_str_in_output=include)
    streamed = ""
    hit = None
    used = 0
    for t in ids:
        used += 1
        hit = d.append([t])
        streamed += d.take_delta()
        if hit:
            break
    streamed += d.take_delta()
    assert hit == "STOP"
    expected = text[: text.index("STOP") + (4 if include else 0)]
    assert d.text == expected
    assert streamed == expected  # the held-back part never leaked a partial stop string
    assert used < len(ids)


def test_stop_string_spanning_tokens_is_found_once_complete(tokenizer):
    text = "abc<END>def"
    ids = tokenizer.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, [], stop=["c<EN"])
    hits = [d.append([t]) for t in ids]
    assert "c<EN" in hits
    assert d.text == "ab"


def _streamed(tokenizer, prompt, ids, chunks, **kw):
    """(joined deltas, final text) of ``ids`` fed in ``chunks`` (sizes), the last one final."""
    d = IncrementalDetokenizer(tokenizer, prompt, **kw)
    out, i = "", 0
    for size in chunks:
        part = ids[i:i + size]
        i += size
        d.append(part, final=i >= len(ids))
        out += d.take_delta()
    d.finish()
    return out + d.take_delta(), d.text


REPLIES = ["這是一個測試。🙂👍🏽 日本語のテキスト", "Emoji: 👨‍👩‍👧‍👦 and 🇫🇷, CJK 漢字 한국어"]


@pytest.mark.parametrize("reply", REPLIES)
def test_text_does_not_depend_on_how_it_is_read_when_a_reply_ends_inside_a_character(tokenizer, reply):
    # Every prefix of a real emoji/CJK reply, including those ending inside a multi-byte
    # character: the joined stream deltas equal the one-go decode that generate returns.
    prompt = tokenizer.encode("Reply:", add_special_tokens=False)
    ids = tokenizer.encode(reply, add_special_tokens=False)
    cut_inside = 0
    for end in range(1, len(ids) + 1):
        want = decode_completion(tokenizer, prompt, ids[:end])
        cut_inside += want.endswith("\ufffd")
        for chunks in ([1] * end, [end], [2] * (end // 2 + 1)):
            joined, text = _streamed(tokenizer, prompt, ids[:end], chunks)
            assert joined == want and text == want, (end, chunks)
    assert cut_inside > 0  # the reply really has cuts inside a character


def test_property_random_token_sequences_read_any_way_give_the_generate_text(tokenizer):
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    vocab = len(tokenizer)

    @hypothesis.settings(max_examples=300, deadline=None, derandomize=True)
    @hypothesis.given(prompt=st.lists(st.integers(0, vocab - 1), max_size=8),
                      ids=st.lists(st.integers(0, vocab - 1), min_size=1, max_size=24),
                      seed=st.integers(0, 2**16), skip=st.booleans())
    def check(prompt, ids, seed, skip):
        import random

        rng = random.Random(seed)
        chunks = []
        while sum(chunks) < len(ids):
            chunks.append(rng.randint(1, 4))
        want = decode_completion(tokenizer, prompt, ids, skip_special_tokens=skip)
        joined, text = _streamed(tokenizer, prompt, ids, chunks, skip_special_tokens=skip)
        assert joined == want and text == want

    check()


def test_byte_tokens_make_incomplete_characters(tokenizer):
    # The byte-level tokens of "這" (3 bytes) fed one by one: a completion cut after 1 or 2 of
    # them ends in U+FFFD in both paths; complete characters before the cut are kept.
    ids = tokenizer.encode("a這", add_special_tokens=False)
    for end in range(1, len(ids) + 1):
        want = decode_completion(tokenizer, [], ids[:end])
        assert _streamed(tokenizer, [], ids[:end], [1] * end) == (want, want)


def test_stop_strings_are_looked_for_only_from_min_tokens_on(tokenizer):
    ids = tokenizer.encode("Paris is nice. Paris again", add_special_tokens=False)
    first = IncrementalDetokenizer(tokenizer, [], stop=["Paris"])
    assert first.append(ids) == "Paris" and first.text == ""
    d = IncrementalDetokenizer(tokenizer, [], stop=["Paris"], min_tokens=3)
    hit = None
    for n, t in enumerate(ids, 1):  # noqa: B007 - n is read after the loop
        hit = d.append([t])
        if hit:
            break
    assert hit == "Paris" and n > 3 and d.text == "Paris is nice. "


@pytest.mark.parametrize("skip", [True, False])
def test_a_prompt_ending_inside_a_character_does_not_leak_into_the_completion(tokenizer, skip):
    # The prompt's last token is the first byte of "這": its bytes are not the completion's.
    lead = tokenizer.encode("這", add_special_tokens=False)[0]
    prompt = tokenizer.encode("Say", add_special_tokens=False) + [lead]
    for ids in ([0], tokenizer.encode(" hello", add_special_tokens=False)):
        want = decode_completion(tokenizer, prompt, ids, skip_special_tokens=skip)
        assert "\ufffd" not in want
        assert _streamed(tokenizer, prompt, ids, [1] * len(ids), skip_special_tokens=skip) == (want, want)


def _reference_stop(text: str, new_start: int, stops: list[str]) -> tuple[int, str] | None:
    """The stop rule as first written (a search per string): among the stop strings that end in
    text[new_start:], the one starting earliest; equal starts: the first listed."""
    best = None
    for s in stops:
        i = text.find(s, max(0, new_start - len(s) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best


def test_property_stop_matcher_equals_a_search_per_string():
    hypothesis = pytest.importorskip("hypothesis")
    from deepinfer.runtime.engine.detokenizer import StopMatcher

    st = hypothesis.strategies
    alphabet = st.sampled_from("abé🙂 ")  # few letters: many overlapping, nested, repeated matches

    @hypothesis.settings(max_examples=400, deadline=None, derandomize=True)
    @hypothesis.given(stops=st.lists(st.text(alphabet, min_size=1, max_size=4), min_size=1, max_size=6),
                      chunks=st.lists(st.text(alphabet, max_size=6), min_size=1, max_size=12),
                      gated=st.integers(0, 4))
    def check(stops, chunks, gated):
        m = StopMatcher(stops)
        text = ""
        for k, chunk in enumerate(chunks):
            start = len(text)
            text += chunk
            report = k >= gated  # the first chunks are read while min_tokens is not reached
            got = m.feed(chunk, report=report)
            want = _reference_stop(text, start, stops) if report else None
            assert got == want, (stops, chunks, k)
            if got is not None:
                break

    check()


def test_stop_matching_cost_does_not_grow_with_the_number_of_stop_strings(tokenizer):
    # Issue 29: 60,000 stop strings were each searched after every token. With one automaton a
    # token costs the same with 4 or 20,000 stop strings (the automaton is built once per list).
    import random
    import time

    rng = random.Random(0)
    many = ["".join(rng.choice("qxzjQXZJ") for _ in range(12)) + str(i) for i in range(20_000)]
    ids = tokenizer.encode(" ".join(TEXTS) * 3, add_special_tokens=False)

    def per_token(stops):
        IncrementalDetokenizer(tokenizer, [], stop=stops)  # builds (and caches) the automaton
        best = float("inf")
        for _ in range(3):
            d = IncrementalDetokenizer(tokenizer, [], stop=stops)
            t0 = time.perf_counter()
            for t in ids:
                assert d.append([t]) is None
                d.take_delta()
            best = min(best, time.perf_counter() - t0)
        return best / len(ids)

    few, lots = per_token(many[:4]), per_token(many)
    # a search per string: ~15,000x slower here; the automaton: equal within the machine's noise
    assert lots < 5 * few + 20e-6, (few, lots)


def test_stop_strings_shared_by_samples_and_repeated_keep_their_semantics(tokenizer):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    # all four end in the text appended at once: "two" starts first (and is listed twice)
    stops = ["three", "wo t", "two", "two", "o t"]
    results = []
    for _ in range(3):  # the samples of one request share the automaton, each reads on its own
        d = IncrementalDetokenizer(tokenizer, [], stop=stops, include_stop_str_in_output=True)
        results.append((d.append(ids), d.text))
    assert results == [("two", "one two")] * 3
    from deepinfer.runtime.engine.detokenizer import StopMatcher

    # within one piece of new text: the earliest start wins, equal starts go to the first listed
    assert StopMatcher(["o t", "two t"]).feed("one two three") == (4, "two t")
    assert StopMatcher(["two t", "two"]).feed("one two three") == (4, "two t")
    assert StopMatcher(["two", "two t"]).feed("one two three") == (4, "two")
