"""``SamplingParams``: how one request is sampled and when it stops, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


def _check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"SamplingParams.{name} must be an int, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"SamplingParams.{name} must be >= {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise ValueError(f"SamplingParams.{name} must be <= {hi}, got {value!r}")


def _check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"SamplingParams.{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass
class SamplingParams:
    """Sampling and stopping parameters of a request (vLLM's names and meanings).

    Args:
        n: samples per prompt (they share the prompt's KV blocks).
        temperature: 0 = greedy; otherwise logits are divided by it.
        top_p: keep the smallest set of tokens whose probability reaches top_p, in (0, 1].
        top_k: keep the k most likely tokens; -1 (or 0) = all.
        min_p: drop tokens less likely than min_p times the most likely one, in [0, 1].
        presence_penalty, frequency_penalty: in [-2, 2], subtracted once / per occurrence for
            tokens already generated.
        repetition_penalty: > 0; logits of tokens seen in prompt or output are divided (if
            positive) or multiplied (if negative) by it; 1 = off.
        seed: makes the request's samples reproducible, whatever the batch.
        stop: strings that end the completion when they appear in its text (excluded from the
            text unless include_stop_str_in_output).
        stop_token_ids: token ids that end the completion (kept in token_ids).
        ignore_eos: keep generating after the end-of-sequence token.
        max_tokens: most tokens to generate (>= 1).
        min_tokens: no EOS / stop token id ends the completion before this many tokens.
        logprobs: when set (k >= 0), report the sampled token's logprob and the top-k.
        prompt_logprobs: when set (k >= 0), report each prompt token's logprob and the top-k.
        logit_bias: {token id: bias} added to the logits before sampling.
        include_stop_str_in_output: keep the matched stop string in the text.
        skip_special_tokens: drop special tokens from the text.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check_int("n", self.n, lo=1)
        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature!r}")
        self.top_p = _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (off), 0 (off) or positive, got {self.top_k!r}")
        if self.top_k == 0:
            self.top_k = -1
        self.min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = _check_float(name, getattr(self, name))
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"SamplingParams.{name} must be in [-2, 2], got {v!r}")
            setattr(self, name, v)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, lo=-(1 << 63), hi=(1 << 63) - 1)
        if self.stop is None:
            stops: list[str] = []
        elif isinstance(self.stop, str):
            stops = [self.stop]
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            stops = list(self.stop)
        else:
            raise TypeError(f"SamplingParams.stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in stops):
            raise ValueError(f"SamplingParams.stop must not contain an empty string, got {self.stop!r}")
        self.stop_strings = stops
        ids = list(self.stop_token_ids or [])
        for t in ids:
            _check_int("stop_token_ids[...]", t, lo=0)
        self.stop_token_ids = ids
        _check_int("max_tokens", self.max_tokens, lo=1)
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens={self.min_tokens} must be <= "
                             f"max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None:
                _check_int(name, v, lo=0, hi=20)
        bias = dict(self.logit_bias or {})
        for t, v in bias.items():
            _check_int("logit_bias key", t, lo=0)
            bias[t] = _check_float(f"logit_bias[{t}]", v)
            if not -100.0 <= bias[t] <= 100.0:
                raise ValueError(f"SamplingParams.logit_bias[{t}] must be in [-100, 100], got {v!r}")
        self.logit_bias = bias
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if a token id (stop_token_ids, logit_bias) is outside the vocabulary."""
        for t in self.stop_token_ids or []:
            if t >= vocab_size:
                raise ValueError(f"SamplingParams.stop_token_ids: token id {t} is outside the vocabulary "
                                 f"(size {vocab_size})")
        for t in self.logit_bias or {}:
            if t >= vocab_size:
                raise ValueError(f"SamplingParams.logit_bias: token id {t} is outside the vocabulary "
                                 f"(size {vocab_size})")

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the most likely token every step."""
        return self.temperature == 0.0
