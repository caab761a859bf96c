"""Incremental detokenization in a front end of the engine core (issue 25).

The core sends each step's new token ids; a front end turns them into text with the engine's own
``IncrementalDetokenizer`` (same prompt context, same ``skip_special_tokens``, the same rule for a
stop token's text, the whole completion decoded at its last token), so the text a client gets is
byte-for-byte the text ``LLM.generate`` makes, and the core's step loop does no decoding.

A request with stop strings is the exception: it is detokenized in the core, which must stop it
in the step whose token completes a stop string (its blocks freed at once, its token count and
finish reason exactly those of ``LLM.generate``). A front end that found the stop string itself
would learn of it a step late at best, after the core had run and counted tokens past the stop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deepinfer.runtime.engine.detokenizer import IncrementalDetokenizer, text_token_ids
from deepinfer.runtime.sampling_params import SamplingParams
from deepinfer.serve.engine_thread import RequestDelta


def detokenized_here(params: SamplingParams) -> bool:
    """Whether a front end makes this request's text (the core then runs it with
    ``detokenize=False``): it wants text and has no stop strings to watch."""
    return bool(params.detokenize) and not params.stop_strings


class RequestText:
    """The text of one engine request's samples, made from the token ids of its deltas."""

    __slots__ = ("_detok", "_include_stop", "_prompt_ids", "_skip", "_tokenizer")

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._prompt_ids = prompt_ids
        self._skip = params.skip_special_tokens
        self._include_stop = params.include_stop_str_in_output
        self._detok: dict[int, IncrementalDetokenizer] = {}

    def _sample(self, index: int) -> IncrementalDetokenizer:
        d = self._detok.get(index)
        if d is None:  # built at the first token: its prompt context is decoded once
            d = self._detok[index] = IncrementalDetokenizer(self._tokenizer, self._prompt_ids,
                                                            skip_special_tokens=self._skip)
        return d

    def step(self, token_ids: list[int]) -> str:
        """The characters that new tokens of sample 0 (not its last) complete (token_stream.py)."""
        return self._sample(0).append_delta(token_ids)

    def absorb(self, token_ids: list[int]) -> None:
        """Decode new tokens of sample 0 (not its last) now and keep their text for the next
        ``fill``: a whole response's tokens are decoded as its steps come, not all at its end."""
        self._sample(0).append(token_ids)

    def fill(self, delta: RequestDelta) -> None:
        """Set each sample's ``text`` to the characters its new tokens complete."""
        for s in delta.samples:
            d = self._sample(s.index)
            if s.finish_reason is None:
                d.append(s.token_ids)
            else:
                d.append(text_token_ids(s.token_ids, s.finish_reason, s.stop_reason, self._include_stop), final=True)
                d.finish()
            s.text = d.take_delta()
