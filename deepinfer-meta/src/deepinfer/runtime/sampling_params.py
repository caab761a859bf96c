"""``SamplingParams``: how one request is sampled and when it stops, validated on every assignment.

Every field the engine uses is stored once, in the ``deepinfer._C.engine.SamplingParams`` this
object holds (``engine``): the C++ ``SamplingParams::validate`` is the only copy of the rules and
bounds, applied when the object is built and on every assignment. Python keeps only what the
engine never sees: the stop strings, the bad words as text, and two detokenizer flags.
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
from typing import TYPE_CHECKING, Any

from deepinfer._C import engine as _E
from deepinfer.runtime.structured.params import StructuredOutputsParams

# Temperatures below this are greedy (as in vLLM): dividing logits by a smaller value overflows
# float32 (1e-37 turns a logit of 10 into inf, and softmax into NaN). Not a bound: the engine
# accepts any temperature >= 0; the runtime sends 0.0 below this (``effective_temperature``).
GREEDY_TEMPERATURE_THRESHOLD = 1e-5

# The engine's fields, in the constructor's order (``deepinfer._C.engine.SamplingParams``).
_ENGINE_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "seed", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens",
                  "logprobs", "prompt_logprobs", "logit_bias", "allowed_token_ids")
# What only the runtime sees (text side).
_PYTHON_FIELDS = ("stop", "include_stop_str_in_output", "skip_special_tokens", "bad_words", "structured_outputs",
                  "extra_args", "detokenize")
# Every field, in the positional order of ``SamplingParams(...)``.
_ORDER = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens",
          "logprobs", "prompt_logprobs", "logit_bias", "include_stop_str_in_output", "skip_special_tokens",
          "allowed_token_ids", "bad_words", "structured_outputs", "extra_args", "detokenize")


# logprobs / prompt_logprobs = -1 (vLLM): the whole vocabulary. The engine then gets 0 (the sampled
# or prompt token's own logprob, which cumulative_logprob sums); the runtime computes the full
# rows for those requests (``engine.full_logprobs``) and a flag here says they were asked.
_ALL_LOGPROBS = ("logprobs", "prompt_logprobs")


def _wants_all(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value == -1 \
        and type(value).__name__ not in ("bool", "bool_")


def _named(exc: Exception) -> Exception:
    """The engine's "<field>: <message>" as the runtime's "SamplingParams.<field>: <message>"."""
    text = str(exc)
    if text.startswith(_ALL_LOGPROBS):  # the engine does not know the runtime's -1
        text = text.replace("(or None)", "(or None, or -1 for the whole vocabulary)")
    return type(exc)(f"SamplingParams.{text}")


class _ReadOnlyDict(dict):  # type: ignore[type-arg]
    """``SamplingParams.logit_bias`` as read: a dict that refuses in-place changes (the value
    lives in the engine object; assign a new dict to change it)."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("SamplingParams.logit_bias is read-only: assign a new dict "
                        "(params.logit_bias = {...}) to change it")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]

    def __copy__(self) -> dict[int, float]:
        return dict(self)

    def __deepcopy__(self, memo: Any) -> dict[int, float]:
        return dict(self)

    def __reduce__(self) -> Any:
        return (dict, (dict(self),))


def _top_k(value: Any) -> Any:
    """vLLM's alias: top_k 0 means off, stored as the engine's -1 (any other value as given)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value == 0 \
            and type(value).__name__ not in ("bool", "bool_"):
        return -1
    return value


def _flag(name: str, value: Any) -> bool:
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)  # numpy's bool scalar
    if not isinstance(value, bool):
        raise TypeError(f"SamplingParams.{name} must be a bool, got {value!r}")
    return value


def _structured(value: Any) -> StructuredOutputsParams | None:
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):  # vLLM accepts the fields as a dict too
        try:
            return StructuredOutputsParams(**value)
        except TypeError as exc:
            raise TypeError(f"SamplingParams.structured_outputs: {exc}") from None
    raise TypeError("SamplingParams.structured_outputs must be a StructuredOutputsParams (or a dict of its "
                    f"fields), got {type(value).__name__}")


def _extra_args(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise TypeError(f"SamplingParams.extra_args must be a dict with str keys or None, got {value!r}")
    return dict(value)


def _strings(name: str, value: Any) -> tuple[str, ...]:
    if value is None:
        out: tuple[str, ...] = ()
    elif isinstance(value, str):
        out = (value,)
    elif isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
        out = tuple(value)
    else:
        raise TypeError(f"SamplingParams.{name} must be a string or a list of strings, got {value!r}")
    if any(s == "" for s in out):
        raise ValueError(f"SamplingParams.{name} must not contain an empty string, got {value!r}")
    return out


_PYTHON_CHECKS = {
    "stop": lambda v: _strings("stop", v),
    "bad_words": lambda v: _strings("bad_words", v),
    "include_stop_str_in_output": lambda v: _flag("include_stop_str_in_output", v),
    "skip_special_tokens": lambda v: _flag("skip_special_tokens", v),
    "detokenize": lambda v: _flag("detokenize", v),
    "structured_outputs": _structured,
    "extra_args": _extra_args,
}


def bad_words_token_ids(bad_words: tuple[str, ...] | list[str], tokenizer: Any) -> list[list[int]]:
    """vLLM's tokenization of bad words: each word (leading spaces stripped) as it reads at the
    start of a text, and, when that is a different single word of as many tokens, as it reads
    after a space (mid-text). ``tokenizer.encode(text, add_special_tokens=False)`` gives ids."""
    out: list[list[int]] = []
    for word in bad_words:
        bare = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not bare:
            raise ValueError(f"SamplingParams.bad_words: {word!r} has no tokens")
        out.append(bare)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out


class SamplingParams:
    """Sampling and stopping parameters of a request (vLLM's names and meanings).

    Every field is validated when the object is built and whenever a field is assigned later
    (``sp.max_tokens = 0`` raises and leaves ``sp`` unchanged). Numbers may be Python or numpy
    scalars; token-id lists may be lists, tuples or numpy integer arrays. Errors are
    TypeError/ValueError naming the field ("SamplingParams.temperature: -0.5 must be a finite
    value >= 0"); the rules of the engine fields are the engine's (``engine``).

    Args:
        n: samples per prompt (they share the prompt's KV blocks).
        temperature: 0 = greedy; otherwise logits are divided by it. Values below
            ``GREEDY_TEMPERATURE_THRESHOLD`` (1e-5) are greedy too.
        top_p: keep the smallest set of tokens whose probability reaches top_p, in (0, 1].
        top_k: keep the k most likely tokens; -1 (or 0, stored as -1) = all.
        min_p: drop tokens less likely than min_p times the most likely one, in [0, 1].
        presence_penalty, frequency_penalty: in [-2, 2], subtracted once / per occurrence for
            tokens already generated.
        repetition_penalty: > 0; logits of tokens seen in prompt or output are divided (if
            positive) or multiplied (if negative) by it; 1 = off.
        seed: makes the request's samples reproducible, whatever the batch.
        stop: strings that end the completion when they appear in its text (excluded from the
            text unless include_stop_str_in_output). Not checked before min_tokens tokens exist.
        stop_token_ids: token ids that end the completion (kept in token_ids; their text is
            excluded from ``text`` unless include_stop_str_in_output). Read back sorted, unique.
        ignore_eos: keep generating after the end-of-sequence token.
        max_tokens: most tokens to generate (>= 1).
        min_tokens: no EOS, stop token id or stop string ends the completion before this many tokens.
        logprobs: when set (0 <= k <= 20), report the sampled token's logprob and the top-k;
            -1 (vLLM's): the whole vocabulary (needs ``LLM(max_logprobs=-1)`` or >= the vocabulary).
        prompt_logprobs: when set (0 <= k <= 20), report each prompt token's logprob and the top-k;
            -1: the whole vocabulary, as for logprobs.
        logit_bias: {token id: bias in [-100, 100]} added to the logits before sampling (read
            back as a read-only dict: assign a new one to change it).
        include_stop_str_in_output: keep the matched stop string (or stop token's text) in the text.
        skip_special_tokens: drop special tokens from the text.
        detokenize: False leaves ``text`` empty (token ids only, as vLLM's): no detokenizer runs
            for the request. Stop strings need the text: with them it is a ValueError.
        allowed_token_ids: only these token ids may be sampled (None: every token).
        bad_words: words never generated (vLLM): each is tokenized when the request is added
            (as at the start of a text and after a space); the token that would complete a
            word's tokens is never sampled.
        structured_outputs: a ``StructuredOutputsParams`` (JSON schema, regex, choice, grammar
            or any JSON object) the output must match; its grammar is compiled (and checked:
            ValueError naming it) when the request is added.
        extra_args: a dict (str keys) for custom sampling code and plugins, as vLLM's; nothing
            in the engine reads it.
    """

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    if TYPE_CHECKING:  # the fields are properties installed below; typed here for the checker
        n: int
        temperature: float
        top_p: float
        top_k: int
        min_p: float
        presence_penalty: float
        frequency_penalty: float
        repetition_penalty: float
        seed: int | None
        stop: tuple[str, ...]
        stop_token_ids: tuple[int, ...] | None
        ignore_eos: bool
        max_tokens: int
        min_tokens: int
        logprobs: int | None
        prompt_logprobs: int | None
        logit_bias: dict[int, float]
        include_stop_str_in_output: bool
        skip_special_tokens: bool
        allowed_token_ids: tuple[int, ...] | None
        bad_words: tuple[str, ...]
        structured_outputs: StructuredOutputsParams | None
        extra_args: dict[str, Any] | None
        detokenize: bool
        _engine: Any
        _stop: tuple[str, ...]
        _bad_words: tuple[str, ...]
        _detokenize: bool

    def __init__(self, n: int = 1, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                 min_p: float = 0.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 repetition_penalty: float = 1.0, seed: int | None = None,
                 stop: str | list[str] | tuple[str, ...] | None = None,
                 stop_token_ids: Any = None, ignore_eos: bool = False, max_tokens: int = 16,
                 min_tokens: int = 0, logprobs: int | None = None, prompt_logprobs: int | None = None,
                 logit_bias: dict[int, float] | None = None, include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True, allowed_token_ids: Any = None,
                 bad_words: str | list[str] | None = None,
                 structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None,
                 extra_args: dict[str, Any] | None = None, detokenize: bool = True) -> None:
        all_lp, all_prompt = _wants_all(logprobs), _wants_all(prompt_logprobs)
        try:
            engine = _E.SamplingParams(
                n=n, temperature=temperature, top_p=top_p, top_k=_top_k(top_k), min_p=min_p,
                presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                repetition_penalty=repetition_penalty, seed=seed, stop_token_ids=stop_token_ids,
                ignore_eos=ignore_eos, max_tokens=max_tokens, min_tokens=min_tokens,
                logprobs=0 if all_lp else logprobs, prompt_logprobs=0 if all_prompt else prompt_logprobs,
                logit_bias=logit_bias, allowed_token_ids=allowed_token_ids)
        except (TypeError, ValueError) as exc:
            raise _named(exc) from None
        d = self.__dict__
        d["_engine"] = engine
        d["_all_logprobs"], d["_all_prompt_logprobs"] = all_lp, all_prompt
        d["_stop"] = _PYTHON_CHECKS["stop"](stop)
        d["_bad_words"] = _PYTHON_CHECKS["bad_words"](bad_words)
        d["_include_stop_str_in_output"] = _PYTHON_CHECKS["include_stop_str_in_output"](include_stop_str_in_output)
        d["_skip_special_tokens"] = _PYTHON_CHECKS["skip_special_tokens"](skip_special_tokens)
        d["_structured_outputs"] = _structured(structured_outputs)
        d["_extra_args"] = _extra_args(extra_args)
        d["_detokenize"] = _PYTHON_CHECKS["detokenize"](detokenize)
        self.check_text_needs()
        d["_bad_ids"] = None  # (tokenizer, its bad_words_token_ids), cached by engine_params

    # ---- fields ------------------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        if name in _ENGINE_FIELDS:
            if name == "top_k":
                value = _top_k(value)
            everything = name in _ALL_LOGPROBS and _wants_all(value)
            try:
                setattr(self._engine, name, 0 if everything else value)
            except (TypeError, ValueError) as exc:
                raise _named(exc) from None
            if name in _ALL_LOGPROBS:
                self.__dict__["_all_" + name] = everything
        elif name in _PYTHON_CHECKS:
            self.__dict__["_" + name] = _PYTHON_CHECKS[name](value)
            if name == "bad_words":
                self.__dict__["_bad_ids"] = None
        else:
            raise AttributeError(f"SamplingParams has no field {name!r}")

    @property
    def engine(self) -> Any:
        """The ``deepinfer._C.engine.SamplingParams`` holding every engine field (shared, not a
        copy: assigning its fields changes this object's)."""
        return self.__dict__["_engine"]

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (derived on every read, so it always follows ``stop``)."""
        return list(self._stop)

    # ---- checks ------------------------------------------------------------------------------
    def validate(self) -> None:
        """Check every field again. Fields are validated on every assignment and the values read
        back cannot be changed in place, so this finds nothing new; kept for callers of the
        dataclass version (the engine loop calls it when a request is added)."""
        try:
            self._engine.validate(0)
        except ValueError as exc:
            raise _named(exc) from None

    def check_text_needs(self) -> None:
        """ValueError when stop strings are asked without detokenization (vLLM's rule): they are
        matched in the text, which ``detokenize=False`` does not make."""
        if not self._detokenize and self._stop:
            raise ValueError("SamplingParams.stop: stop strings are only supported when detokenize is True "
                             "(set detokenize=True, or use stop_token_ids)")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if a token id (stop_token_ids, logit_bias, allowed_token_ids) or a
        logprob count is outside a vocabulary of ``vocab_size`` tokens (the engine's rule)."""
        try:
            self._engine.validate(vocab_size)
        except ValueError as exc:
            raise _named(exc) from None

    @property
    def wants_all_logprobs(self) -> bool:
        """logprobs=-1: every output token's logprobs over the whole vocabulary."""
        return bool(self.__dict__.get("_all_logprobs"))

    @property
    def wants_all_prompt_logprobs(self) -> bool:
        """prompt_logprobs=-1: every prompt token's logprobs over the whole vocabulary."""
        return bool(self.__dict__.get("_all_prompt_logprobs"))

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the most likely token every step (temperature below
        ``GREEDY_TEMPERATURE_THRESHOLD``)."""
        return self.temperature < GREEDY_TEMPERATURE_THRESHOLD

    @property
    def effective_temperature(self) -> float:
        """The temperature the sampler uses: 0.0 (greedy) below the threshold, else ``temperature``."""
        return 0.0 if self.is_greedy else self.temperature

    # ---- what the engine gets ----------------------------------------------------------------
    def engine_params(self, tokenizer: Any = None, extra_stop_token_ids: Any = ()) -> Any:
        """The engine SamplingParams of a request made with these parameters: ``engine`` as is,
        or a copy with what the runtime decides — the model's extra EOS ids added to
        stop_token_ids (not with ``ignore_eos``, which ignores every EOS id), the effective temperature, and ``bad_words`` tokenized with
        ``tokenizer`` (required when there are bad words; see ``bad_words_token_ids``)."""
        eng = self._engine
        changes: dict[str, Any] = {}
        if extra_stop_token_ids and not eng.ignore_eos:  # ignore_eos ignores every EOS id (vLLM)
            stops = set(eng.stop_token_ids)
            merged = stops.union(extra_stop_token_ids)
            if merged != stops:
                changes["stop_token_ids"] = sorted(merged)
        temperature = self.effective_temperature
        if temperature != eng.temperature:
            changes["temperature"] = temperature
        if self._bad_words:
            if tokenizer is None:
                raise ValueError("SamplingParams.bad_words: a tokenizer is needed to turn them into token ids")
            cached = self.__dict__["_bad_ids"]
            if cached is None or cached[0] is not tokenizer:
                cached = (tokenizer, bad_words_token_ids(self._bad_words, tokenizer))
                self.__dict__["_bad_ids"] = cached
            changes["bad_words_token_ids"] = cached[1]
        if not changes:
            return eng
        try:
            return eng.replace(**changes)
        except (TypeError, ValueError) as exc:
            raise _named(exc) from None

    # ---- value semantics ---------------------------------------------------------------------
    def _values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _ORDER}

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in self._values().items())
        return f"SamplingParams({body})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SamplingParams):
            return NotImplemented
        return self._engine == other._engine and all(
            self.__dict__["_" + k] == other.__dict__["_" + k] for k in _PYTHON_CHECKS) \
            and self.wants_all_logprobs == other.wants_all_logprobs \
            and self.wants_all_prompt_logprobs == other.wants_all_prompt_logprobs

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's ``clone``)."""
        new = object.__new__(SamplingParams)
        new.__dict__.update(self.__dict__)
        new.__dict__["_engine"] = self._engine.replace()
        if new.__dict__.get("_extra_args") is not None:
            new.__dict__["_extra_args"] = copy.deepcopy(new.__dict__["_extra_args"])
        return new

    __copy__ = clone

    def __deepcopy__(self, memo: Any) -> SamplingParams:
        return self.clone()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_bad_ids"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_detokenize", True)  # pickled before the field existed
        self.__dict__.setdefault("_all_logprobs", False)
        self.__dict__.setdefault("_all_prompt_logprobs", False)
        self.__dict__["_bad_ids"] = None


def _engine_property(name: str) -> property:
    def get(self: SamplingParams) -> Any:
        if name in _ALL_LOGPROBS and self.__dict__.get("_all_" + name):
            return -1  # the whole vocabulary (the engine holds 0)
        value = getattr(self.__dict__["_engine"], name)
        if name in ("stop_token_ids", "allowed_token_ids"):
            return value if value is None else tuple(value)  # no in-place change past validation
        if name == "logit_bias":
            return _ReadOnlyDict(value)
        return value

    def set_(self: SamplingParams, value: Any) -> None:
        self.__setattr__(name, value)

    return property(get, set_, doc=getattr(_E.SamplingParams, name).__doc__)


def engine_values(params: SamplingParams) -> dict[str, Any]:
    """Every engine field of ``params`` with the value its property reads (-1 for the whole
    vocabulary's logprobs included), as plain data (lists, a dict), from one read of the engine
    (``__getstate__``, where a property read costs ~0.3 us a field): what a request's parameters
    take across a process boundary (``serve.core.sampling_params_fields``)."""
    d = params.__dict__
    values: dict[str, Any] = d["_engine"].__getstate__()
    for name in _ALL_LOGPROBS:
        if d.get("_all_" + name):
            values[name] = -1  # (the engine holds 0)
    return values


def _python_property(name: str) -> property:
    def get(self: SamplingParams) -> Any:
        return self.__dict__["_" + name]

    def set_(self: SamplingParams, value: Any) -> None:
        self.__setattr__(name, value)

    return property(get, set_)


# A dataclass in name (``dataclasses.fields`` / ``replace`` work) whose fields are properties.
SamplingParams.__annotations__ = {name: Any for name in _ORDER}
SamplingParams = dataclasses.dataclass(init=False, repr=False, eq=False)(SamplingParams)  # type: ignore[misc]
for _name in _ENGINE_FIELDS:
    setattr(SamplingParams, _name, _engine_property(_name))
for _name in _PYTHON_FIELDS:
    setattr(SamplingParams, _name, _python_property(_name))
del _name
