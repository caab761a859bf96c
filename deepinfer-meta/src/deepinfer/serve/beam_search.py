"""Served beam search (vLLM's ``use_beam_search``): the offline search's rounds
(``runtime/beam_search.beam_search_rounds``) driven by the server's engine.

Each round is one engine request per live beam (one token, the top ``2 * n`` logprobs), submitted
as the routes submit theirs (admission, priority, cache salt); prefix caching shares the beams'
common prefix, so a round recomputes one token per beam. The search ends with one finished delta
per prompt whose samples are its ``n`` best beams, best first: the routes turn it into choices
as they turn any delta into choices, whole or streamed (one chunk per beam, as vLLM streams it).
A beam's text is its new tokens without a final end-of-sequence token (vLLM's).
"""

from __future__ import annotations

from collections.abc import Callable

from deepinfer.runtime.beam_search import BeamSearchOutput, BeamSearchParams, beam_search_rounds
from deepinfer.serve.engine_run import EngineRun
from deepinfer.serve.engine_thread import RequestDelta, SampleDelta, first_sample


class BeamSearchRun:
    """A served beam search, with the part of ``EngineRun``'s interface the routes use: its deltas
    (one finished delta per prompt) come when the search has ended. ``close()`` aborts the round
    in flight; the search runs only while the route iterates it."""

    def __init__(self, start: Callable[..., EngineRun], request_id: str, prompts: list[list[int]],
                 params: BeamSearchParams, eos_token_ids: list[int], max_model_len: int,
                 decode: Callable[[list[int]], str]) -> None:
        self._start, self._id = start, request_id
        self._prompts, self._params = prompts, params
        self._eos, self._max_model_len, self._decode = frozenset(eos_token_ids), max_model_len, decode
        self._round: EngineRun | None = None
        self._deltas: list[RequestDelta] | None = None
        self.request_ids: list[str] = []  # (no engine request outlives a round)

    async def _search(self) -> list[RequestDelta]:
        search = beam_search_rounds(None, sorted(self._eos), self._prompts, self._params, self._max_model_len)
        try:
            beams, params = next(search)
            k = 0
            while True:
                run = self._round = self._start(f"{self._id}-beam{k}", beams, [params] * len(beams))
                tops: list[dict[int, float]] = [{} for _ in beams]
                try:
                    async for delta in run:
                        sample = first_sample(delta)
                        if sample.logprobs:
                            tops[delta.tag] = dict(sample.logprobs[0])
                finally:
                    run.close()
                    self._round = None
                k += 1
                beams, params = search.send(tops)
        except StopIteration as end:
            outputs: list[BeamSearchOutput] = end.value
        return [self._delta(i, out) for i, out in enumerate(outputs)]

    def _delta(self, tag: int, out: BeamSearchOutput) -> RequestDelta:
        samples = []
        for j, beam in enumerate(out.sequences):
            ids = beam.output_token_ids
            shown = ids[:-1] if beam.finish_reason == "stop" and ids and ids[-1] in self._eos else ids
            samples.append(SampleDelta(j, list(ids), self._decode(shown), None, beam.finish_reason, None))
        return RequestDelta(tag, samples, True)

    # --- EngineRun's interface ---
    def __aiter__(self) -> BeamSearchRun:
        return self

    async def __anext__(self) -> RequestDelta:
        if self._deltas is None:
            self._deltas = await self._search()
        if not self._deltas:
            raise StopAsyncIteration
        return self._deltas.pop(0)

    async def batch(self, min_tokens: int = 1) -> list[RequestDelta]:
        if self._deltas is None:
            self._deltas = await self._search()
        out, self._deltas = self._deltas, []
        return out

    def close(self) -> None:
        if self._round is not None:
            self._round.close()
        self._deltas = []
