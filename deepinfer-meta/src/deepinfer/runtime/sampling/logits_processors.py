"""Custom logits processors with vLLM's v1 interface (``LLM(logits_processors=[...])``).

A processor is a class: built once per engine with ``(config, device, is_pin_memory)``; told
before each step which requests entered and left the batch (``update_state(BatchUpdate | None)``);
then ``apply(logits)`` gets the step's logits, float32 ``[batch_size, vocab]``, one row per
sample in batch-index order, and returns them (changed in place or not). Per-request arguments
travel in ``SamplingParams.extra_args``; ``validate_params`` may refuse a request (ValueError)
when it is added. Names and shapes are vLLM's, so a processor written for vLLM's v1 engine needs
only its imports changed (``deepinfer.runtime.sampling.logits_processors``).

How DeepInfer fills the batch: a step's batch is its sample rows in the engine's order; a sample
that keeps its index is not mentioned again, one whose index changed is reported as removed from
its old index and added at its new one (``moved`` stays empty: vLLM allows either). ``added``
carries the request's ``SamplingParams``, its prompt token ids and its output token ids as a list
that grows as tokens are applied (the same list object from step to step, as vLLM's).

The processors run after the forward and before the sampler's penalties, bias, temperature and
top-k/p (vLLM applies its argmax-invariant built-ins later; every custom processor here runs at
this point, on greedy requests too). Steps run synchronously while processors are configured
(zero-overhead scheduling is off: ``update_state`` must see the previous step's tokens).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch


class MoveDirectionality(Enum):
    """vLLM's kinds of move within the batch (DeepInfer reports none; see the module doc)."""

    UNIDIRECTIONAL = auto()
    SWAP = auto()


RemovedRequest = int
AddedRequest = tuple[int, Any, "list[int] | None", "list[int]"]  # (index, params, prompt ids, output ids)
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch changed since the last step; process ``removed``, then ``added``, then ``moved``."""

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """vLLM's v1 ``LogitsProcessor`` interface."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        """Raise ValueError for a request this processor cannot serve (called when it is added);
        accepts every request unless overridden."""
        return None

    @abstractmethod
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The step's logits [batch_size, vocab] with this processor's changes (in place allowed)."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when it never changes a row's argmax (DeepInfer applies it either way)."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Before each step's ``apply``: the batch's changes (None: none since the last step)."""
        raise NotImplementedError


def resolve_processors(value: Any) -> tuple[Any, ...]:
    """``LLM(logits_processors=...)`` as a tuple of classes or ``"module:Class"`` / ``"module.Class"``
    names (a comma-separated string of names on the command line); TypeError/ValueError naming what
    is wrong. Names are imported here, so a typo fails when the engine is built."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"logits_processors must be a list of LogitsProcessor classes or their "
                        f"'module:Class' names, got {type(value).__name__}")
    for item in value:
        load_processor_class(item)
    return tuple(value)


def load_processor_class(item: Any) -> type:
    """The class of one ``logits_processors`` entry."""
    cls = item
    if isinstance(item, str):
        module, sep, name = item.partition(":")
        if not sep:
            module, _, name = item.rpartition(".")
        if not module or not name:
            raise ValueError(f"logits_processors: {item!r} is not a 'module:Class' name")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"logits_processors: cannot import {item!r} ({type(exc).__name__}: {exc})") from None
    if not isinstance(cls, type):
        raise TypeError(f"logits_processors: expected a class, got {cls!r}")
    missing = [m for m in ("apply", "update_state", "is_argmax_invariant") if not callable(getattr(cls, m, None))]
    if missing:
        raise TypeError(f"logits_processors: {cls.__name__} lacks {', '.join(missing)} (vLLM's v1 "
                        "LogitsProcessor interface: deepinfer.runtime.sampling.logits_processors)")
    return cls


def processor_config(max_num_seqs: int, max_model_len: int, vocab_size: int, engine_args: Any) -> Any:
    """What a processor's constructor gets as ``vllm_config``: the attributes vLLM's processors
    read (``scheduler_config.max_num_seqs``, ``model_config.max_model_len`` / ``get_vocab_size()``)
    and ``engine_args`` (DeepInfer's options)."""
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        model_config=SimpleNamespace(max_model_len=max_model_len, get_vocab_size=lambda: vocab_size),
        engine_args=engine_args)


Key = tuple[str, int]  # (request id, sample index)


def sample_row_keys(si: Any, metadata: Any, requests: Any = None) -> list[tuple[int, str, int]]:
    """(sample row, request id, sample index) of each real sample row of the step whose sampler
    inputs are ``si`` (engine order), only of the requests in ``requests`` when given. Copies
    what it reads (the engine reuses its storage next step)."""
    by_seq: dict[int, str] = {}
    for i in range(len(metadata)):
        m = metadata[i]
        if requests is None or m.request_id in requests:
            by_seq[int(m.seq_id)] = m.request_id
    if not by_seq:
        return []
    n = int(si.driver.num_real_rows)
    seq_ids = np.asarray(si.driver.seq_ids)[:n].tolist()
    subs = np.asarray(si.kernel.subsequences)[:n].tolist()
    return [(r, by_seq[s], int(subs[r])) for r, s in enumerate(seq_ids) if s in by_seq]


class LogitsProcessors:
    """The engine loop's processors: batch bookkeeping, per-sample output token lists, apply."""

    def __init__(self, classes: Iterable[Any], config: Any, device: torch.device,
                 request_of: Callable[[str], Any]) -> None:
        self.processors = [load_processor_class(c)(config, device, device.type == "cuda") for c in classes]
        self.request_of = request_of  # request id -> (SamplingParams, prompt ids) or None
        self._index: dict[Key, int] = {}  # the batch as the processors last saw it
        self._outputs: dict[Key, list[int]] = {}

    def check(self, params: Any) -> None:
        for p in self.processors:
            type(p).validate_params(params)

    def step_keys(self, si: Any, metadata: Any) -> list[Key]:
        """(request id, sample index) of each sample row of the step (engine order)."""
        return [(rid, j) for _, rid, j in sample_row_keys(si, metadata)]

    def apply(self, keys: list[Key], logits: torch.Tensor) -> torch.Tensor:
        """Tell the processors the batch (``keys``, one per row of ``logits``) and apply them."""
        removed, added = [], []
        for key, old in self._index.items():
            if old >= len(keys) or keys[old] != key:
                removed.append(old)
        for i, key in enumerate(keys):
            if self._index.get(key) != i:
                request = self.request_of(key[0])
                params, prompt = (None, None) if request is None else request
                added.append((i, params, prompt, self._outputs.setdefault(key, [])))
        update = BatchUpdate(len(keys), removed, added, []) if removed or added else None
        self._index = {key: i for i, key in enumerate(keys)}
        for p in self.processors:
            p.update_state(update)
            logits = p.apply(logits)
        return logits

    def accept(self, keys: list[Key], tokens: np.ndarray) -> None:
        """The applied step's token of each row to its sample's output list."""
        for key, tok in zip(keys, tokens.tolist(), strict=False):
            self._outputs.setdefault(key, []).append(int(tok))

    def prune(self, live: Any) -> None:
        """Forget the samples of requests the loop no longer runs."""
        for key in [k for k in self._outputs if k[0] not in live]:
            del self._outputs[key]
