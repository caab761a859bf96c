"""``speculative_config``: vLLM's keys where they match, checked with errors that name the key."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model", "oracle")
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model", "ngram_match",
        "draft_length")
NGRAM_MATCHES = ("earliest", "latest", "longest")  # ngram.MATCHES (no import: config stays numpy-free)
DRAFT_LENGTHS = ("fixed", "adaptive")
NGRAM_ONLY_KEYS = ("prompt_lookup_min", "prompt_lookup_max", "ngram_match", "draft_length")
MAX_SPECULATIVE_TOKENS = 32
DEFAULT_LOOKUP_MIN, DEFAULT_LOOKUP_MAX = 2, 5
NGRAM_MODEL_NAMES = ("ngram", "[ngram]")  # vLLM's spellings of the n-gram method as a model name


@dataclass(frozen=True)
class SpeculativeConfig:
    """One engine's speculative decoding settings.

    ``method``: "ngram" (prompt lookup: drafts from the request's own prompt and output),
    "draft_model" (drafts from a smaller model with the target's tokenizer, ``model``: its path)
    or "oracle" (benchmarks only: drafts from a recorded greedy run of the same prompt, see
    ``Speculator.record_oracle``). ``num_speculative_tokens``: drafts verified per step (k).
    ``prompt_lookup_min`` / ``prompt_lookup_max``: the n-gram lengths tried, longest first
    (defaults 2 and 5: on bench/spec_bench.py's workload a minimum of 1 drafts from one-token
    coincidences, which cost verify rows and are rarely kept; vLLM defaults to 5 and 5).
    ``ngram_match``: which earlier occurrence of the matched n-gram the drafts follow: "earliest"
    (the default, as vLLM), "latest" (the most recent) or "longest" (the one with the most
    preceding tokens in common with the context; ties: the latest). ``draft_length``: "fixed"
    (the default: up to k drafts every step) or "adaptive" (a per-request cap, k at first, that
    halves after a step with a rejected draft, never below 2, and doubles after a step that
    kept all its drafts). Both are n-gram keys of DeepInfer's own (guide 12, "Choosing the
    match and the draft length").
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = DEFAULT_LOOKUP_MIN
    prompt_lookup_max: int = DEFAULT_LOOKUP_MAX
    model: str | None = None  # the draft model's path (method "draft_model")
    ngram_match: str = "earliest"
    draft_length: str = "fixed"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "draft_model":
            d["model"] = self.model
        else:
            d.update(prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max)
            if self.ngram_match != "earliest":
                d["ngram_match"] = self.ngram_match
            if self.draft_length != "fixed":
                d["draft_length"] = self.draft_length
        return d


def _int_key(d: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"speculative_config[{key!r}] must be an int, got {v!r}")
    if not lo <= v <= hi:
        raise ValueError(f"speculative_config[{key!r}] must be in [{lo}, {hi}], got {v}")
    return v


def _choice_key(d: dict[str, Any], key: str, default: str, choices: tuple[str, ...]) -> str:
    v = d.get(key, default)
    if v not in choices:
        raise ValueError(f"speculative_config[{key!r}] must be one of {', '.join(map(repr, choices))}, got {v!r}")
    return str(v)


def parse_speculative_config(value: Any) -> SpeculativeConfig | None:
    """``value`` (None, a dict, a JSON object string or a SpeculativeConfig) as a checked
    SpeculativeConfig; None means speculation off. Errors name the offending key."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"speculative_config: not a JSON object ({err.msg} at character {err.pos}): "
                             f"{value!r}") from None
    if not isinstance(value, dict):
        raise TypeError(f"speculative_config must be a dict or a JSON object string, got {type(value).__name__}")
    unknown = sorted(k for k in value if k not in KEYS)
    if unknown:
        raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(KEYS)})")
    model = value.get("model")
    if model is not None and not isinstance(model, str):
        raise TypeError(f"speculative_config['model'] must be a path (str), got {model!r}")
    method = value.get("method")
    if method is None:  # vLLM's inference: "ngram"/"[ngram]" as the model name, else a draft model
        if model is None:
            raise ValueError(f"speculative_config['method'] is required (one of {', '.join(METHODS)}) "
                             "unless 'model' names a draft model")
        method = "ngram" if model in NGRAM_MODEL_NAMES else "draft_model"
    if method not in METHODS:
        raise ValueError(f"speculative_config['method'] must be one of {', '.join(METHODS)}, got {method!r}")
    if method == "draft_model":
        if not model or model in NGRAM_MODEL_NAMES:
            raise ValueError("speculative_config['model'] is required with method 'draft_model' (the draft "
                             f"model's path), got {model!r}")
        given = [key for key in NGRAM_ONLY_KEYS if key in value]
        if given:
            raise ValueError(f"speculative_config[{given[0]!r}]: prompt_lookup_min/prompt_lookup_max/ngram_match/"
                             "draft_length belong to method 'ngram', not 'draft_model'")
    elif model is not None and model not in NGRAM_MODEL_NAMES:
        raise ValueError(f"speculative_config['model'] ({model!r}) is a draft model: it needs method "
                         f"'draft_model', not {method!r}")
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config['num_speculative_tokens'] is required (the drafts per step, k)")
    k = _int_key(value, "num_speculative_tokens", 0, 1, MAX_SPECULATIVE_TOKENS)
    # a default never contradicts the other key given: min <= max always holds unless both are given
    hi_given = value.get("prompt_lookup_max")
    lo_default = min(DEFAULT_LOOKUP_MIN, hi_given) if isinstance(hi_given, int) and hi_given >= 1 else DEFAULT_LOOKUP_MIN
    lo = _int_key(value, "prompt_lookup_min", lo_default, 1, 1024)
    hi = _int_key(value, "prompt_lookup_max", max(lo, DEFAULT_LOOKUP_MAX), 1, 1024)
    if lo > hi:
        raise ValueError(f"speculative_config['prompt_lookup_min'] ({lo}) must be <= "
                         f"speculative_config['prompt_lookup_max'] ({hi})")
    match = _choice_key(value, "ngram_match", "earliest", NGRAM_MATCHES)
    draft_length = _choice_key(value, "draft_length", "fixed", DRAFT_LENGTHS)
    return SpeculativeConfig(method=method, num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi,
                             model=model if method == "draft_model" else None, ngram_match=match,
                             draft_length=draft_length)
