"""Speculative decoding counters, named as vLLM's ``spec_decode_*`` metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class SpecDecodeStats:
    """Running totals over verified sequences-steps.

    ``num_drafts``: sequence-steps that verified at least one draft; ``num_draft_tokens``: drafts
    verified; ``num_accepted_tokens``: drafts kept; ``accepted_per_pos[i]``: drafts kept at
    position i (the acceptance of position i is ``accepted_per_pos[i] / num_drafts``)."""

    k: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.k

    def observe(self, num_drafts: np.ndarray, num_accepted: np.ndarray) -> None:
        nd = np.asarray(num_drafts)
        na = np.asarray(num_accepted)
        live = nd > 0
        self.num_drafts += int(live.sum())
        self.num_draft_tokens += int(nd.sum())
        self.num_accepted_tokens += int(na.sum())
        for a in na[live]:
            for i in range(min(int(a), self.k)):
                self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Kept drafts / verified drafts (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verifying sequence-step: 1 + kept drafts per step (1 before any)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def per_position(self) -> list[float]:
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_pos]

    def as_dict(self) -> dict[str, object]:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length, "per_position_acceptance": self.per_position()}

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.k, self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_pos))
