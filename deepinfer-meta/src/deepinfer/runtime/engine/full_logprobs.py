"""Whole-vocabulary logprobs (vLLM's ``logprobs=-1`` / ``prompt_logprobs=-1``), carried in Python.

The engine's output path builds a ``{token_id: logprob}`` dict per token from the top-k it is
given (k <= 20). For the whole vocabulary that would be V Python floats per token (about 5 MB
per token at V = 49,152, and ~4 ms to build), for every such request, every step. Instead the
engine gets k = 0 (it still reports the chosen token's own logprob and sums
``cumulative_logprob``), the step executor hands the requests' full float32 rows to the engine
loop (``RowStore``), and their outputs carry ``VocabLogprobs``: a read-only mapping over one
row, built in O(1), whose iteration order is the chosen token first, then every token by
descending logprob (the order of the engine's dicts).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np


class VocabLogprobs(Mapping[int, float]):
    """``{token_id: logprob}`` over the whole vocabulary for one position, backed by one float32
    row: ``m[t]``, ``len(m)`` (the vocabulary size), ``t in m`` and ``m.get`` cost O(1);
    iterating (``items()``, ``dict(m)``) sorts the row once: the chosen token, then the others
    by descending logprob."""

    __slots__ = ("_first", "_order", "_row")

    def __init__(self, row: np.ndarray, first: int) -> None:
        self._row = row
        self._first = int(first)
        self._order: np.ndarray | None = None

    def __getitem__(self, token_id: int) -> float:
        if not isinstance(token_id, (int, np.integer)) or isinstance(token_id, bool) \
                or not 0 <= token_id < len(self._row):
            raise KeyError(token_id)
        return float(self._row[token_id])

    def __len__(self) -> int:
        return len(self._row)

    def __contains__(self, token_id: object) -> bool:
        return bool(isinstance(token_id, (int, np.integer)) and not isinstance(token_id, bool)
                    and 0 <= token_id < len(self._row))

    def __iter__(self) -> Iterator[int]:
        if self._order is None:
            order = np.argsort(-self._row, kind="stable")
            self._order = np.concatenate(([self._first], order[order != self._first]))
        return iter(self._order.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, VocabLogprobs):
            return self._first == other._first and np.array_equal(self._row, other._row)
        return Mapping.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        head = ", ".join(f"{t}: {self[t]!r}" for t in list(self)[:3])
        return f"VocabLogprobs({{{head}, ...}} over {len(self)} tokens)"

    def __reduce__(self) -> Any:
        return (VocabLogprobs, (np.array(self._row), self._first))


class RowStore:
    """The full rows of one request: per sample index, one row per output token (in order), and
    one row per scored prompt position."""

    __slots__ = ("output", "prompt", "sent")

    def __init__(self) -> None:
        self.output: dict[int, list[np.ndarray]] = {}
        self.prompt: dict[int, np.ndarray] = {}
        self.sent: dict[int, int] = {}  # rows already given in delta outputs, per sample index

    def add_output(self, index: int, row: np.ndarray) -> None:
        self.output.setdefault(index, []).append(row)

    def completion_logprobs(self, index: int, token_ids: list[int], delta: bool) -> list[VocabLogprobs]:
        """The logprobs of a completion's ``token_ids`` (all of them, or in ``delta`` the new ones)."""
        rows = self.output.get(index, [])
        start = self.sent.get(index, 0) if delta else 0
        if delta:
            self.sent[index] = start + len(token_ids)
        return [VocabLogprobs(rows[start + i], t) for i, t in enumerate(token_ids) if start + i < len(rows)]

    def prompt_logprobs(self, prompt_ids: list[int]) -> list[VocabLogprobs | None]:
        return [None] + [VocabLogprobs(self.prompt[p], prompt_ids[p]) for p in range(1, len(prompt_ids))
                         if p in self.prompt]


class _Completion:
    """An engine completion with ``logprobs`` replaced (every other field read through)."""

    __slots__ = ("_c", "logprobs")

    def __init__(self, completion: Any, logprobs: list[Any] | None) -> None:
        self._c = completion
        self.logprobs = logprobs

    def __getattr__(self, name: str) -> Any:
        if name == "_c":
            raise AttributeError(name)
        return getattr(self._c, name)

    def __repr__(self) -> str:
        return repr(self._c)


class WholeVocabOutput:
    """An engine RequestOutput whose completions' ``logprobs`` and/or ``prompt_logprobs`` cover
    the whole vocabulary (every other field read through)."""

    __slots__ = ("_output", "outputs", "prompt_logprobs")

    def __init__(self, output: Any, store: RowStore, params: Any, prompt_ids: list[int], delta: bool) -> None:
        self._output = output
        outs = list(output.outputs)
        if params.wants_all_logprobs:
            outs = [_Completion(c, store.completion_logprobs(c.index, list(c.token_ids), delta)) for c in outs]
        self.outputs = outs
        self.prompt_logprobs = store.prompt_logprobs(prompt_ids) if params.wants_all_prompt_logprobs \
            else output.prompt_logprobs

    def __getattr__(self, name: str) -> Any:
        if name == "_output":
            raise AttributeError(name)
        return getattr(self._output, name)

    def __repr__(self) -> str:
        return repr(self._output)
