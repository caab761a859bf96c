"""Prompts given as embeddings (vLLM's ``{"prompt_embeds": tensor[L, hidden]}``).

The engine schedules such a prompt by its length only: it gets placeholder token ids, and the
model takes the given embedding rows in place of the token embeddings at the prompt positions
(``StepExecutor``: eager forward; decode steps are plain token steps).

Prefix caching hashes blocks by token ids, so equal placeholder ids would let one embeddings
prompt reuse another's KV (a silent wrong answer). The placeholder ids are therefore derived from
a SHA-256 of the embeddings themselves: equal tensors share their cached blocks (correctly),
different ones get unrelated ids (a chance collision of a whole block is below 2^-90 even for a
64-token vocabulary and 16-token blocks).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch


def check_prompt_embeds(value: Any, hidden_size: int, where: str) -> torch.Tensor:
    """``value`` as a CPU float tensor [L, hidden_size] (a leading batch dimension of 1 is
    dropped, as vLLM does); TypeError/ValueError naming ``where`` and the shape otherwise."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: prompt_embeds must be a torch.Tensor of shape (L, {hidden_size}), "
                        f"got {type(value).__name__}")
    t = value.detach()
    if t.ndim == 3 and t.shape[0] == 1:
        t = t[0]
    if t.ndim != 2 or t.shape[1] != hidden_size:
        raise ValueError(f"{where}: prompt_embeds must have shape (L, {hidden_size}) (the model's hidden size), "
                         f"got {tuple(value.shape)}")
    if t.shape[0] == 0:
        raise ValueError(f"{where}: prompt_embeds is empty (0 positions)")
    if not t.is_floating_point():
        raise TypeError(f"{where}: prompt_embeds must be a floating-point tensor, got {t.dtype}")
    t = t.to("cpu")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{where}: prompt_embeds has non-finite values (NaN or inf)")
    return t.contiguous()


def placeholder_ids(embeds: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids the engine schedules ``embeds`` [L, hidden] by: pseudo-random ids in
    [0, vocab_size) seeded by a hash of the tensor (dtype, shape and bytes), so that prefix
    caching only ever matches the same embeddings."""
    h = hashlib.sha256(f"{embeds.dtype}{tuple(embeds.shape)}".encode())
    h.update(embeds.contiguous().view(torch.uint8).numpy().tobytes())
    rng = np.random.Generator(np.random.PCG64(int.from_bytes(h.digest(), "little")))
    return rng.integers(0, vocab_size, size=embeds.shape[0]).tolist()  # type: ignore[no-any-return]


def step_embeds(metadata: Any, query_start_loc: np.ndarray, first_prompt_row: int,
                embeds: dict[str, torch.Tensor]) -> tuple[np.ndarray, torch.Tensor] | None:
    """(token rows of the step, their embeddings) for the prompt positions the step computes of
    requests in ``embeds`` (by request id), or None when it computes none. ``metadata``: the
    step's SequenceMetadataPool; rows before ``first_prompt_row`` are decodes (token steps)."""
    at: list[np.ndarray] = []
    values: list[torch.Tensor] = []
    for i in range(first_prompt_row, len(metadata)):
        m = metadata[i]
        e = embeds.get(m.request_id)
        if e is None:
            continue
        start, n, done = int(query_start_loc[i]), int(m.num_new_tokens), int(m.num_computed_tokens)
        if int(query_start_loc[i + 1]) - start != n:
            raise RuntimeError(f"prompt embeddings: row {i} has {n} new tokens but the step layout gives it "
                               f"{int(query_start_loc[i + 1]) - start}")
        stop = min(done + n, int(e.shape[0]))  # positions past the prompt are output tokens (recompute)
        if stop <= done:
            continue
        at.append(np.arange(start, start + stop - done, dtype=np.int64))
        values.append(e[done:stop])
    if not at:
        return None
    return np.concatenate(at), torch.cat(values)
