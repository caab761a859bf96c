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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_PROMPT_CONTEXT = 6  # prompt tokens kept as decoding context


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
        self.text = ""
        self.stop = list(stop)
        self.include_stop = include_stop_str_in_output
        self.min_tokens = min_tokens
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._emitted = 0  # characters of self.text already returned as deltas
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

    def _extend(self, delta: str) -> str | None:
        start = len(self.text)
        self.text += delta
        if self.num_output_tokens < self.min_tokens:
            return None
        return self._find_stop(start, len(delta))

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

    def _find_stop(self, new_start: int, new_len: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            # only a match that overlaps the new characters is new
            i = self.text.find(s, max(0, new_start - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        self.stop_reason = s
        self.finished = True
        return s

    def finish(self) -> None:
        """Mark the sample finished (no more tokens): the held-back characters become final."""
        self.finished = True

    def take_delta(self) -> str:
        """Text not yet returned, minus a possible partial stop string unless finished."""
        end = len(self.text) if self.finished else max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta


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
