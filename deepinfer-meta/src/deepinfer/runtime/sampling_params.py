"""``SamplingParams``: how one request is sampled and when it stops, validated on every assignment."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Temperatures below this are greedy (as in vLLM): dividing logits by a smaller value overflows
# float32 (1e-37 turns a logit of 10 into inf, and softmax into NaN).
GREEDY_TEMPERATURE_THRESHOLD = 1e-5


def _as_int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    # numbers.Integral covers numpy integers; bool is refused (True is not a count).
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"SamplingParams.{name} must be an int, got {value!r}")
    value = int(value)
    if lo is not None and value < lo:
        raise ValueError(f"SamplingParams.{name} must be >= {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise ValueError(f"SamplingParams.{name} must be <= {hi}, got {value!r}")
    return value


def _as_float(name: str, value: Any) -> float:
    # numbers.Real covers numpy floating and integer scalars.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"SamplingParams.{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"SamplingParams.{name} must be a finite number, got {value!r}")
    return float(value)


def _as_bool(name: str, value: Any) -> bool:
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)  # numpy's bool scalar
    if not isinstance(value, bool):
        raise TypeError(f"SamplingParams.{name} must be a bool, got {value!r}")
    return value


def _in_range(name: str, v: float, ok: bool, what: str) -> float:
    if not ok:
        raise ValueError(f"SamplingParams.{name} must be {what}, got {v!r}")
    return v


def _n(v: Any) -> int:
    return _as_int("n", v, lo=1)


def _temperature(v: Any) -> float:
    t = _as_float("temperature", v)
    return _in_range("temperature", t, t >= 0, ">= 0")


def _top_p(v: Any) -> float:
    p = _as_float("top_p", v)
    return _in_range("top_p", p, 0.0 < p <= 1.0, "in (0, 1]")


def _top_k(v: Any) -> int:
    k = _as_int("top_k", v)
    if k < -1:
        raise ValueError(f"SamplingParams.top_k must be -1 (off), 0 (off) or positive, got {k!r}")
    return -1 if k == 0 else k


def _min_p(v: Any) -> float:
    p = _as_float("min_p", v)
    return _in_range("min_p", p, 0.0 <= p <= 1.0, "in [0, 1]")


def _penalty(name: str) -> Callable[[Any], float]:
    def check(v: Any) -> float:
        p = _as_float(name, v)
        return _in_range(name, p, -2.0 <= p <= 2.0, "in [-2, 2]")
    return check


def _repetition_penalty(v: Any) -> float:
    p = _as_float("repetition_penalty", v)
    return _in_range("repetition_penalty", p, p > 0, "> 0")


def _seed(v: Any) -> int | None:
    return None if v is None else _as_int("seed", v, lo=-(1 << 63), hi=(1 << 63) - 1)


def _stop(v: Any) -> tuple[str, ...]:
    if v is None:
        stops: tuple[str, ...] = ()
    elif isinstance(v, str):
        stops = (v,)
    elif isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v):
        stops = tuple(v)
    else:
        raise TypeError(f"SamplingParams.stop must be a string or a list of strings, got {v!r}")
    if any(s == "" for s in stops):
        raise ValueError(f"SamplingParams.stop must not contain an empty string, got {v!r}")
    return stops


def _token_ids(name: str) -> Callable[[Any], tuple[int, ...]]:
    def check(v: Any) -> tuple[int, ...]:
        if v is None:
            return ()
        if isinstance(v, (str, bytes, bytearray, dict, set)) or not hasattr(v, "__iter__"):
            raise TypeError(f"SamplingParams.{name} must be a list of token ids, got {v!r}")
        return tuple(_as_int(f"{name}[{i}]", t, lo=0) for i, t in enumerate(v))
    return check


def _positive_int(name: str) -> Callable[[Any], int]:
    return lambda v: _as_int(name, v, lo=1)


def _min_tokens(v: Any) -> int:
    return _as_int("min_tokens", v, lo=0)


def _num_logprobs(name: str) -> Callable[[Any], int | None]:
    return lambda v: None if v is None else _as_int(name, v, lo=0, hi=20)


def _logit_bias(v: Any) -> dict[int, float]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise TypeError(f"SamplingParams.logit_bias must be a dict {{token id: bias}}, got {v!r}")
    out: dict[int, float] = {}
    for t, b in v.items():
        tok = _as_int("logit_bias key", t, lo=0)
        bias = _as_float(f"logit_bias[{tok}]", b)
        out[tok] = _in_range(f"logit_bias[{tok}]", bias, -100.0 <= bias <= 100.0, "in [-100, 100]")
    return out


def _flag(name: str) -> Callable[[Any], bool]:
    return lambda v: _as_bool(name, v)


# One checker per field: it raises TypeError/ValueError naming the field, or returns the value
# stored (normalised: Python numbers, top_k 0 -> -1, stop and stop_token_ids as tuples, so they
# cannot be changed in place; logit_bias as a new dict, checked again by ``validate``).
_CHECKS: dict[str, Callable[[Any], Any]] = {
    "n": _n, "temperature": _temperature, "top_p": _top_p, "top_k": _top_k, "min_p": _min_p,
    "presence_penalty": _penalty("presence_penalty"), "frequency_penalty": _penalty("frequency_penalty"),
    "repetition_penalty": _repetition_penalty, "seed": _seed, "stop": _stop,
    "stop_token_ids": _token_ids("stop_token_ids"), "ignore_eos": _flag("ignore_eos"),
    "max_tokens": _positive_int("max_tokens"), "min_tokens": _min_tokens,
    "logprobs": _num_logprobs("logprobs"), "prompt_logprobs": _num_logprobs("prompt_logprobs"),
    "logit_bias": _logit_bias, "include_stop_str_in_output": _flag("include_stop_str_in_output"),
    "skip_special_tokens": _flag("skip_special_tokens"),
}


@dataclass
class SamplingParams:
    """Sampling and stopping parameters of a request (vLLM's names and meanings).

    Every field is validated when the object is built and whenever a field is assigned later
    (``sp.max_tokens = 0`` raises and leaves ``sp`` unchanged). Numbers may be Python or numpy
    scalars; they are stored as Python ``int``/``float``.

    Args:
        n: samples per prompt (they share the prompt's KV blocks).
        temperature: 0 = greedy; otherwise logits are divided by it. Values below
            ``GREEDY_TEMPERATURE_THRESHOLD`` (1e-5) are greedy too.
        top_p: keep the smallest set of tokens whose probability reaches top_p, in (0, 1].
        top_k: keep the k most likely tokens; -1 (or 0) = all.
        min_p: drop tokens less likely than min_p times the most likely one, in [0, 1].
        presence_penalty, frequency_penalty: in [-2, 2], subtracted once / per occurrence for
            tokens already generated.
        repetition_penalty: > 0; logits of tokens seen in prompt or output are divided (if
            positive) or multiplied (if negative) by it; 1 = off.
        seed: makes the request's samples reproducible, whatever the batch.
        stop: strings that end the completion when they appear in its text (excluded from the
            text unless include_stop_str_in_output). Not checked before min_tokens tokens exist.
        stop_token_ids: token ids that end the completion (kept in token_ids; their text is
            excluded from ``text`` unless include_stop_str_in_output).
        ignore_eos: keep generating after the end-of-sequence token.
        max_tokens: most tokens to generate (>= 1).
        min_tokens: no EOS, stop token id or stop string ends the completion before this many tokens.
        logprobs: when set (0 <= k <= 20), report the sampled token's logprob and the top-k.
        prompt_logprobs: when set (0 <= k <= 20), report each prompt token's logprob and the top-k.
        logit_bias: {token id: bias in [-100, 100]} added to the logits before sampling.
        include_stop_str_in_output: keep the matched stop string (or stop token's text) in the text.
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
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __setattr__(self, name: str, value: Any) -> None:
        check = _CHECKS.get(name)
        if check is None:
            raise AttributeError(f"SamplingParams has no field {name!r}")
        value = check(value)
        if self.__dict__.get("_ready"):
            mn = value if name == "min_tokens" else self.min_tokens
            mx = value if name == "max_tokens" else self.max_tokens
            self._check_min_max(mn, mx)
        object.__setattr__(self, name, value)

    def __post_init__(self) -> None:
        self._check_min_max(self.min_tokens, self.max_tokens)
        object.__setattr__(self, "_ready", True)

    @staticmethod
    def _check_min_max(min_tokens: int, max_tokens: int) -> None:
        if min_tokens > max_tokens:
            raise ValueError(f"SamplingParams.min_tokens={min_tokens} must be <= max_tokens={max_tokens}")

    def validate(self) -> None:
        """Check every field again (the engine calls this when a request is added, which also
        catches a ``logit_bias`` dict changed in place)."""
        for name, check in _CHECKS.items():
            object.__setattr__(self, name, check(getattr(self, name)))
        self._check_min_max(self.min_tokens, self.max_tokens)

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (derived on every read, so it always follows ``stop``)."""
        return list(self.stop or ())

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
        """True when the request takes the most likely token every step (temperature below
        ``GREEDY_TEMPERATURE_THRESHOLD``)."""
        return self.temperature < GREEDY_TEMPERATURE_THRESHOLD

    @property
    def effective_temperature(self) -> float:
        """The temperature the sampler uses: 0.0 (greedy) below the threshold, else ``temperature``."""
        return 0.0 if self.is_greedy else self.temperature
