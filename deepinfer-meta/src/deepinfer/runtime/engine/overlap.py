"""Zero-overhead scheduling (ZOS): may step N+1 run ahead of step N's tokens, and the hand-off.

In steady decode the engine loop launches a step without waiting for its tokens (the one step
executor, ``engine.executor``, keeps them on the device and copies them to pinned host memory
behind the step). Before waiting for them the loop schedules the next step ahead
(``Scheduler.schedule(overlap=True)``) and launches it: its input ids are gathered on the device
from step N's sampled ids (``zos_source_index``; ``gather_ids`` / ``resolve_ids`` here), so the
device never waits for the host. Only then does the host wait for step N's tokens, apply them
and detokenize, while step N+1 runs. On CPU the same path runs synchronously (the "device"
tensors are CPU tensors), so CI exercises it.

This module holds the decision and that hand-off, nothing else: ``Overlap.may_run_ahead``
(plain decode steps, and no live request that reads per-step results on the host: logprobs)
and the in-flight step. Penalties of a step launched ahead count step N's token on the device
(``count_pending_tokens``; the host sends it to the penalty tables a step later).

Speculative decoding: a verify step (rows with drafts) is no plain decode and runs
synchronously; a speculating loop's plain decode steps (no sequence drafts) run ahead as above
while no sequence of the step in flight is expected to draft (``EngineLoop._ahead_without_drafts``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from collections.abc import Container

    from deepinfer.runtime.sampling_params import SamplingParams


def blocks_overlap(params: SamplingParams) -> bool:
    """Whether a request keeps the loop synchronous (its logprobs are read per step on the host)."""
    return params.logprobs is not None


def is_plain_decode(out: Any) -> bool:
    """A step of plain decodes (one token and one sample per sequence): it may be launched ahead."""
    n = len(out)
    return n > 0 and out.num_decodes == n and out.num_decode_tokens == n and out.num_sample_rows == n


class Overlap:
    """The overlap loop's state: the step in flight and the requests that keep it synchronous."""

    def __init__(self) -> None:
        self.in_flight: Any | None = None  # a LaunchedStep not yet applied
        self.num_ahead = 0  # steps launched before the previous step's tokens were known
        self._blockers: set[str] = set()  # live requests that keep the loop synchronous

    def track(self, request_id: str, params: SamplingParams) -> None:
        """A request was added: remember it if it keeps the loop synchronous."""
        if blocks_overlap(params):
            self._blockers.add(request_id)

    def allowed(self, live: Container[str]) -> bool:
        """No live request (``live``: the loop's request ids) keeps the loop synchronous."""
        if self._blockers:
            self._blockers = {r for r in self._blockers if r in live}
        return not self._blockers

    def may_run_ahead(self, scheduled: Any, live: Container[str]) -> bool:
        """``scheduled`` may be launched without waiting for its tokens (another runs ahead of it)."""
        return is_plain_decode(scheduled) and self.allowed(live)


def count_pending_tokens(rows: torch.Tensor, counts: Any, seen: Any, pending: np.ndarray,
                         prev_tokens: torch.Tensor) -> None:
    """Step N's token of each penalized row (still on the device) is one more output token of it."""
    src = torch.from_numpy(pending.astype(np.int64)).to(rows.device, non_blocking=True)[rows]
    hit = torch.nonzero(src >= 0).flatten()
    tok = prev_tokens[src[hit]]
    counts[hit, tok] += 1
    seen[hit, tok] = True


def gather_ids(ids: torch.Tensor, src: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
    """Rows with ``src >= 0`` take the previous step's sampled id of logits row ``src`` (no host sync)."""
    return torch.where(src >= 0, prev_tokens[src.clamp(min=0)].to(ids.dtype), ids)


def resolve_ids(ids: torch.Tensor, src: torch.Tensor, prev_tokens: torch.Tensor) -> None:
    """``gather_ids`` in place on a captured graph's input ids."""
    ids.copy_(gather_ids(ids, src.long(), prev_tokens))
