"""Per-region statistics of timing samples (pure Python, no numpy needed)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of already sorted values, linearly interpolated."""
    if not sorted_values:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q={q} must be within [0, 100]")
    rank = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (rank - lo)


def summarize(samples_ms: Sequence[float]) -> dict[str, float]:
    """``{"count", "mean_ms", "p50_ms", "p99_ms", "min_ms", "max_ms"}`` of samples in ms."""
    values = sorted(samples_ms)
    count = len(values)
    return {
        "count": count,
        "mean_ms": sum(values) / count if count else math.nan,
        "p50_ms": percentile(values, 50.0),
        "p99_ms": percentile(values, 99.0),
        "min_ms": values[0] if count else math.nan,
        "max_ms": values[-1] if count else math.nan,
    }
