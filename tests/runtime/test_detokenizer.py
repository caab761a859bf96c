"""Incremental detokenization equals a full decode; stop strings cut at the right character."""

from __future__ import annotations

import pytest
from deepinfer.runtime.detokenizer import IncrementalDetokenizer, decode_completion

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
