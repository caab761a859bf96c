"""Beam search over ``LLM.generate``, with vLLM's interface and scoring (``LLM.beam_search``).

Each round extends every live beam of every prompt by one token: one ``generate`` call over all
beams (one-token requests asking for the top ``2 * beam_width`` logprobs), then per prompt the
``beam_width`` best extensions by score survive. An extension that ends in an end-of-sequence
token is a finished hypothesis (unless ``ignore_eos``). After ``max_tokens`` rounds the live
beams join the finished ones and the ``beam_width`` best are returned, best first.

Why over ``generate`` rather than in the engine: as vLLM does, the beams are ordinary requests,
so prefix caching shares their common prefix's KV blocks (a round recomputes only the one new
token per beam) and nothing in the scheduler or the step changes. The cost is one engine
round trip per token.

Score (vLLM's, after transformers'): ``cum_logprob / len(tokens) ** length_penalty``, where
``tokens`` counts the prompt and a final end-of-sequence token does not count. Logprobs are
the model's own (``temperature`` only changes which token the round samples, as in vLLM: the
default 0 is greedy).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

from deepinfer.runtime.sampling_params import SamplingParams

# The engine reports at most 20 logprobs per token (kMaxLogprobs); a round asks for 2 * width.
MAX_BEAM_WIDTH = 10


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``: ``beam_width`` beams (1..10), ``max_tokens`` new tokens at most,
    ``ignore_eos``, the ``temperature`` each round samples with, and the ``length_penalty``
    exponent of the score. Checked at construction (ValueError/TypeError naming the field)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"BeamSearchParams.{name} must be an int, got {value!r}")
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"BeamSearchParams.beam_width must be in [1, {MAX_BEAM_WIDTH}] (each round asks the "
                             f"engine for 2 * beam_width logprobs, at most 20), got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"BeamSearchParams.max_tokens must be >= 1, got {self.max_tokens}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"BeamSearchParams.{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"BeamSearchParams.temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"BeamSearchParams.ignore_eos must be a bool, got {self.ignore_eos!r}")


@dataclass
class BeamSearchSequence:
    """One hypothesis: ``tokens`` (prompt included), the ``logprobs`` dict of each new token's
    round (``{token_id: logprob}``, the chosen token among them), their sum ``cum_logprob``,
    ``text`` (the decoded tokens, prompt included: vLLM's), and ``finish_reason`` ("stop" for an
    end-of-sequence token, "length" otherwise)."""

    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        """The new tokens (without the prompt)."""
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """The ``beam_width`` best sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(seq: BeamSearchSequence, eos_ids: frozenset[int], length_penalty: float) -> float:
    """vLLM's score: ``cum_logprob / len ** length_penalty`` (prompt counted, a final EOS not)."""
    n = len(seq.tokens) - (1 if seq.tokens and seq.tokens[-1] in eos_ids else 0)
    return seq.cum_logprob / (max(n, 1) ** length_penalty)


#: one round of a search: the token ids of every live beam, and the one-token sampling params
BeamRound = tuple[list[list[int]], SamplingParams]


def beam_search_rounds(decode: Callable[[list[int]], str] | None, eos_ids: Sequence[int], prompts: list[list[int]],
                       params: BeamSearchParams, max_model_len: int, concurrency_limit: int | None = None,
                       ) -> Generator[BeamRound, list[dict[int, float]], list[BeamSearchOutput]]:
    """The search as a generator: it yields each round (every live beam's tokens, the round's
    ``SamplingParams``), is sent back each beam's top logprobs (``{token_id: logprob}`` of its one
    new token, in order), and returns the outputs. ``run_beam_search`` drives it with
    ``LLM.generate``; the server drives it with its engine (``serve/beam_search.py``)."""
    if concurrency_limit is not None and (isinstance(concurrency_limit, bool) or not isinstance(concurrency_limit, int)
                                          or concurrency_limit < 1):
        raise ValueError(f"concurrency_limit must be a positive int or None, got {concurrency_limit!r}")
    eos = frozenset(eos_ids)
    width = params.beam_width
    # (only the logprobs of a round are read: no text is made for them)
    round_params = SamplingParams(max_tokens=1, logprobs=2 * width, temperature=params.temperature,
                                  ignore_eos=True, detokenize=False)

    def key(s: BeamSearchSequence) -> float:
        return beam_score(s, eos, params.length_penalty)

    outputs: list[BeamSearchOutput] = []
    step = concurrency_limit or len(prompts) or 1
    for start in range(0, len(prompts), step):  # vLLM's concurrency_limit: prompts per batch
        batch = prompts[start:start + step]
        live = [[BeamSearchSequence(tokens=list(p), num_prompt_tokens=len(p))] for p in batch]
        done: list[list[BeamSearchSequence]] = [[] for _ in batch]
        for _ in range(params.max_tokens):
            for i, group in enumerate(live):  # at the context limit: finished, by length
                done[i] += [b for b in group if len(b.tokens) >= max_model_len]
                live[i] = [b for b in group if len(b.tokens) < max_model_len]
            beams = [(i, b) for i, group in enumerate(live) for b in group]
            if not beams:
                break
            tops = yield [b.tokens for _, b in beams], round_params
            extended: list[list[BeamSearchSequence]] = [[] for _ in batch]
            for (i, beam), top in zip(beams, tops, strict=True):
                for token, logprob in top.items():
                    child = BeamSearchSequence(tokens=[*beam.tokens, token], logprobs=[*beam.logprobs, top],
                                               cum_logprob=beam.cum_logprob + logprob,
                                               num_prompt_tokens=beam.num_prompt_tokens)
                    if token in eos and not params.ignore_eos:
                        child.finish_reason = "stop"
                        done[i].append(child)
                    else:
                        extended[i].append(child)
            live = [sorted(group, key=key, reverse=True)[:width] for group in extended]
        for group_live, group_done in zip(live, done, strict=True):
            for b in group_live + group_done:
                b.finish_reason = b.finish_reason or "length"
            best = sorted(group_done + group_live, key=key, reverse=True)[:width]
            if decode is not None:  # (None: the caller makes the texts)
                for b in best:
                    b.text = decode(b.tokens)
            outputs.append(BeamSearchOutput(sequences=best))
    return outputs


def run_beam_search(generate: Callable[[list[list[int]], SamplingParams], list[Any]],
                    decode: Callable[[list[int]], str], eos_ids: Sequence[int],
                    prompts: list[list[int]], params: BeamSearchParams, max_model_len: int,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
    """Beam search of each prompt (token ids) with ``generate(prompt_ids, sampling_params)``, which
    returns one output per prompt in order; ``decode`` makes the texts."""
    search = beam_search_rounds(decode, eos_ids, prompts, params, max_model_len, concurrency_limit)
    try:
        todo = next(search)
        while True:
            todo = search.send([r.outputs[0].logprobs[0] for r in generate(*todo)])
    except StopIteration as end:
        return end.value  # type: ignore[no-any-return]
