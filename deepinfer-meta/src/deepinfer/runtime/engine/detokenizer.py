"""Incremental detokenization with stop strings, one ``IncrementalDetokenizer`` per sample.

Text grows by decoding a short window of tokens (the last few prompt tokens give context, so a
leading space or a multi-byte character split over tokens decodes right) and appending only the
part that is complete (no trailing U+FFFD). The window is tokenizers' ``DecodeStream`` where
available (the same algorithm in Rust; ``bench/detokenizer_bench.py``: 2.9-3.4x faster per
token than the Python window kept as the fallback, over 2,000 tokens of mixed text). When the sample's last token arrives
(``append(..., final=True)``) the text becomes the whole completion decoded in one go
(``decode_completion``, what a request without stop strings gets): bytes of an incomplete
character at the end become U+FFFD, so a completion's text never depends on how it was read.
A stop string ends the text at the character where it starts (or ends, with
``include_stop_str_in_output``); it is looked for only once ``min_tokens`` tokens exist. When
streaming, the last ``len(longest stop) - 1`` characters are held back so a partial stop string
is never emitted.

Stop strings are found by one Aho–Corasick automaton per stop list (``StopAutomaton``), shared
by every sample of a request; each sample's ``StopMatcher`` feeds every new character through it
once, so a token costs O(its new text) whatever the number of stop strings (a search per string
cost O(strings x text) per token: 60,000 stop strings made every other request 15-19x slower).
The automaton is written here rather than taken from pyahocorasick: the one feature of that
library that makes a stream O(new text), resuming a search (``AutomatonSearchIter.set(s,
reset=False)``), corrupts the heap once the text holds a character beyond U+FFFF (pyahocorasick
2.3.1, its issue #221; reproduced here within a few thousand random emoji texts), and model
output is full of emoji.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Sequence
from typing import Any

_PROMPT_CONTEXT = 6  # prompt tokens kept as decoding context
# The text is kept as pieces joined when read whole (``text``): ``str +=`` on an attribute copies
# the whole string, so a long completion cost O(its length) a token (bench/detokenizer_bench.py
# --long 65536: 1.76 us a token over the first eighth, 10.8 over the last; 1.35 throughout in
# pieces). The pieces are joined into one every _MAX_PARTS of them, which bounds their memory and
# costs O(text) per _MAX_PARTS tokens.
_MAX_PARTS = 1024


class IncrementalDetokenizer:
    """Turns one sample's output tokens into text as they arrive and watches for stop strings."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], *, skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False,
                 min_tokens: int = 0) -> None:
        # The raw tokenizers.Tokenizer decodes much faster than the transformers wrapper.
        self._decode = getattr(tokenizer, "backend_tokenizer", None)
        self._tok = tokenizer
        self._skip = skip_special_tokens
        ctx = prompt_context(tokenizer, prompt_ids, skip_special_tokens)
        self._ids: list[int] = ctx
        self._prefix_offset = 0
        self._read_offset = len(ctx)
        self._num_prompt_ctx = len(ctx)
        self._parts: list[str] = []  # the text, in pieces (``text`` joins them)
        self._len = 0  # its length in characters
        self.stop = list(stop)
        self.include_stop = include_stop_str_in_output
        self.min_tokens = min_tokens
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._matcher = StopMatcher(self.stop) if self.stop else None
        self._emitted = 0  # characters of the text already returned as deltas
        self.stop_reason: str | None = None
        self.finished = False
        self._stream = self._decode_stream(ctx)

    def _decode_stream(self, ctx: list[int]) -> Any:
        # tokenizers' DecodeStream (primed with the prompt context) does the windowed decode in
        # Rust, about 3x faster; older tokenizers without it (or a tokenizer without a Rust
        # backend) use the Python window below.
        if self._decode is None:
            return None
        try:
            from tokenizers.decoders import DecodeStream

            return DecodeStream(ids=ctx, skip_special_tokens=self._skip)
        except (ImportError, TypeError):
            return None

    def _decode_ids(self, ids: list[int]) -> str:
        if self._decode is not None:
            return self._decode.decode(ids, skip_special_tokens=self._skip)
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    @property
    def text(self) -> str:
        """The sample's text so far (its pieces joined once, then kept joined)."""
        parts = self._parts
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0] if parts else ""

    @text.setter
    def text(self, value: str) -> None:
        self._parts = [value] if value else []
        self._len = len(value)

    def _append_text(self, piece: str) -> None:
        parts = self._parts
        parts.append(piece)
        self._len += len(piece)
        if len(parts) > _MAX_PARTS:
            parts[:] = ["".join(parts)]

    def _suffix(self, start: int) -> str:
        """``text[start:]``, joining only the pieces from the one that holds ``start`` on (the
        characters not yet returned are in the last few pieces)."""
        parts, pos, i = self._parts, self._len, len(self._parts)
        while i > 0 and pos > start:
            i -= 1
            pos -= len(parts[i])
        return "".join(parts[i:])[start - pos:]

    @property
    def num_output_tokens(self) -> int:
        """Output tokens seen so far."""
        return len(self._ids) - self._num_prompt_ctx

    def append(self, new_ids: Sequence[int], final: bool = False) -> str | None:
        """Add output tokens; return the matched stop string if one now ends the text, else None.

        ``final``: these are the sample's last tokens; the text becomes the full decode."""
        if self.finished:
            return self.stop_reason
        for t in new_ids:
            self._ids.append(int(t))
            if self._stream is not None:
                chunk = self._stream.step(self._decode, self._ids[-1])
                if chunk:  # None while the last character is incomplete
                    self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
                    hit = self._extend(chunk)
                    if hit is not None:
                        return hit
                continue
            prefix = self._decode_ids(self._ids[self._prefix_offset:self._read_offset])
            full = self._decode_ids(self._ids[self._prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                delta = full[len(prefix):]
                self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
                hit = self._extend(delta)
                if hit is not None:
                    return hit
        return self._flush() if final else None

    def append_delta(self, new_ids: Sequence[int]) -> str:
        """``append(new_ids)`` then ``take_delta()`` (not the last tokens), in one call for the
        common sample without stop strings: a stream's per-token work (serve/token_stream.py)."""
        stream = self._stream
        if self._matcher is not None or stream is None or self.finished:
            self.append(new_ids)
            return self.take_delta()
        ids, dec, new = self._ids, self._decode, ""
        for t in new_ids:
            ids.append(t)
            chunk = stream.step(dec, t)
            if chunk:  # None while the last character is incomplete
                self._prefix_offset, self._read_offset = self._read_offset, len(ids)
                new += chunk
        before, emitted = self._len, self._emitted
        if new:
            self._append_text(new)
        self._emitted = self._len
        # no stop strings: nothing is held back, so the delta is the new text whenever every earlier
        # character went out already (the stream's every call after its first; no join then)
        return new if emitted == before else self._suffix(emitted)

    def _extend(self, delta: str) -> str | None:
        self._append_text(delta)
        if self._matcher is None:
            return None
        # every character goes through the automaton (its state must follow the text); only a
        # stop string that ends in the new characters once min_tokens tokens exist counts
        hit = self._matcher.feed(delta, report=self.num_output_tokens >= self.min_tokens)
        if hit is None:
            return None
        i, s = hit
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        self.stop_reason = s
        self.finished = True
        return s

    def _flush(self) -> str | None:
        # The whole completion decoded at once; the incremental text is a prefix of it except
        # for the bytes still pending (an incomplete character, shown as U+FFFD).
        whole = _decode_after(self._tok, self._ids[:self._num_prompt_ctx], self._ids[self._num_prompt_ctx:],
                              self._skip)
        if whole.startswith(self.text):
            tail = whole[len(self.text):]
        else:  # a tokenizer whose windowed decode differs: append the pending window's text
            prefix = self._decode_ids(self._ids[self._prefix_offset:self._read_offset])
            tail = self._decode_ids(self._ids[self._prefix_offset:])[len(prefix):]
        self._prefix_offset = self._read_offset = len(self._ids)
        return self._extend(tail) if tail else None

    def finish(self) -> None:
        """Mark the sample finished (no more tokens): the held-back characters become final."""
        self.finished = True

    def take_delta(self) -> str:
        """Text not yet returned, minus a possible partial stop string unless finished."""
        end = self._len if self.finished else max(self._emitted, self._len - self._hold)
        delta = self._suffix(self._emitted)[:end - self._emitted]
        self._emitted = end
        return delta


class StopMatcher:
    """The stop strings of one sample, found in its text as the text grows.

    ``feed(new)`` takes the characters appended to the text and returns ``(start, stop)`` of the
    stop string that starts earliest among those ending in ``new`` (equal starts: the one listed
    first), or None. The automaton is built once per stop list (cached: the ``n`` samples of a
    request share it); each sample keeps its own state in it, so a call costs O(len(new)),
    amortized, whatever the number and length of the stop strings.
    """

    __slots__ = ("_automaton", "_pos", "_state")

    def __init__(self, stops: Sequence[str]) -> None:
        self._automaton = stop_automaton(tuple(stops))
        self._state = 0  # the automaton's state after the text so far
        self._pos = 0  # characters fed so far

    def feed(self, new: str, report: bool = True) -> tuple[int, str] | None:
        """Advance over ``new``; when ``report``, the earliest stop string ending in it."""
        a = self._automaton
        goto, fail, out_len, out_order = a.goto, a.fail, a.out_len, a.out_order
        state, pos = self._state, self._pos
        best_start = best_order = -1
        for ch in new:
            c = ord(ch)
            while True:
                nxt = goto.get(state << _CHAR_BITS | c)
                if nxt is not None:
                    state = nxt
                    break
                if state == 0:
                    break
                state = fail[state]
            n = out_len[state]  # the longest stop string ending here (0: none)
            if n and report:
                start = pos - n + 1
                if best_start < 0 or (start, out_order[state]) < (best_start, best_order):
                    best_start, best_order = start, out_order[state]
            pos += 1
            if best_start >= 0 and pos - a.longest > best_start:
                break  # no later match can start at or before the best one (the sample ends here)
        self._state, self._pos = state, pos
        return None if best_start < 0 else (best_start, a.stops[best_order])


_CHAR_BITS = 21  # code points are < 2**21: (state << 21 | code point) keys one transition


class StopAutomaton:
    """The Aho–Corasick automaton of a stop list: the trie of the strings (``goto``: one dict
    of every edge), failure links, and per state the longest stop string that is a suffix of
    it (``out_len``, 0 for none; ``out_order``: its first position in the list)."""

    __slots__ = ("fail", "goto", "longest", "out_len", "out_order", "stops")

    def __init__(self, stops: tuple[str, ...]) -> None:
        if not stops or "" in stops:
            raise ValueError(f"stop strings must be a non-empty list of non-empty strings, got {stops!r:.80}")
        goto: dict[int, int] = {}
        parent, char, depth = array("i", [0]), array("i", [0]), array("i", [0])
        first: dict[int, int] = {}  # state where a stop string ends -> its first position
        for order, stop in enumerate(stops):
            state = 0
            for ch in stop:
                key = state << _CHAR_BITS | ord(ch)
                nxt = goto.get(key)
                if nxt is None:
                    nxt = goto[key] = len(parent)
                    parent.append(state)
                    char.append(ord(ch))
                    depth.append(depth[state] + 1)
                state = nxt
            first.setdefault(state, order)
        size = len(parent)
        fail, out_len, out_order = (array("i", bytes(4 * size)) for _ in range(3))
        # failure links in breadth-first order: a state's link is shallower, so already known
        for s in sorted(range(1, size), key=depth.__getitem__):
            p, c, f = parent[s], char[s], 0
            if p != 0:
                f = fail[p]
                while True:
                    nxt = goto.get(f << _CHAR_BITS | c)
                    if nxt is not None:
                        f = nxt
                        break
                    if f == 0:
                        break
                    f = fail[f]
            fail[s] = f
            if s in first:  # its own string is the longest suffix that is a stop string
                out_len[s], out_order[s] = depth[s], first[s]
            else:
                out_len[s], out_order[s] = out_len[f], out_order[f]
        self.goto, self.fail, self.out_len, self.out_order = goto, fail, out_len, out_order
        self.stops = stops
        self.longest = max(len(s) for s in stops)


@functools.lru_cache(maxsize=8)
def stop_automaton(stops: tuple[str, ...]) -> StopAutomaton:
    """The automaton of ``stops``, built once per list (the samples of a request, and requests
    with the same list, share it; a server builds it off the engine thread first)."""
    return StopAutomaton(stops)


def text_token_ids(ids: list[int], finish_reason: str | None, stop_reason: int | str | None,
                   include_stop_str_in_output: bool) -> list[int]:
    """The tokens of a sample's last output that make text. A sample ended by a stop token (EOS
    or stop_token_ids: finish "stop" without a stop string) keeps the token in token_ids but not
    its text, as in vLLM."""
    if ids and finish_reason == "stop" and not isinstance(stop_reason, str) and not include_stop_str_in_output:
        return ids[:-1]
    return ids


def _decoder(tokenizer: Any) -> Any:
    # The raw tokenizers.Tokenizer decodes much faster than the transformers wrapper.
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend.decode if backend is not None else tokenizer.decode


def prompt_context(tokenizer: Any, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> list[int]:
    """The last few prompt tokens, the decoding context of a completion, without trailing tokens
    that end inside a character (their bytes would otherwise join the completion's first ones)."""
    decode = _decoder(tokenizer)
    ctx = list(prompt_ids[-_PROMPT_CONTEXT:])
    while ctx and decode(ctx, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
        ctx.pop()
    return ctx


def decode_completion(tokenizer: Any, prompt_ids: Sequence[int], output_ids: Sequence[int],
                      skip_special_tokens: bool = True) -> str:
    """The text of a finished completion in one go: the same text the incremental path builds
    (the last prompt tokens give the decoding context, e.g. a SentencePiece leading space)."""
    return _decode_after(tokenizer, prompt_context(tokenizer, prompt_ids, skip_special_tokens), output_ids,
                         skip_special_tokens)


def _decode_after(tokenizer: Any, ctx: list[int], output_ids: Sequence[int], skip_special_tokens: bool) -> str:
    decode = _decoder(tokenizer)
    prefix = decode(ctx, skip_special_tokens=skip_special_tokens)
    full = decode(ctx + list(output_ids), skip_special_tokens=skip_special_tokens)
    if full.startswith(prefix):
        return full[len(prefix):]
    return decode(list(output_ids), skip_special_tokens=skip_special_tokens)
