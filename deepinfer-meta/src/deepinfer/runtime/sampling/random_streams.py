"""Counter-based random numbers: one independent stream per (seed, sample index, step).

A seeded request must draw the same tokens whatever else is in the batch, on CPU and GPU alike.
Instead of one torch.Generator per row we hash (key, token id) with integer mixing in torch:
vectorised over rows, identical on every device, and independent of the batch by construction.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_SMALLEST_VARIATE = 2.9802322e-08  # -log(1 - 2**-25): the variate of the largest u before rounding


def _mix32(h: torch.Tensor) -> torch.Tensor:
    # A 32-bit integer finaliser (values kept < 2**32 in int64 so products cannot overflow).
    h = ((h ^ (h >> 16)) * 0x45D9F3B) & _M32
    h = ((h ^ (h >> 16)) * 0x45D9F3B) & _M32
    return h ^ (h >> 16)


def stream_keys(seeds: torch.Tensor, sample_index: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row from its int64 seed, its sample index in the request and its step."""
    s = seeds.to(torch.int64)
    h = _mix32(s & _M32)
    h = _mix32(h ^ ((s >> 32) & _M32))
    h = _mix32(h ^ (sample_index.to(torch.int64) & _M32))
    return _mix32(h ^ (step.to(torch.int64) & _M32))


def exponential_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) variates [rows, vocab]: ``argmax(p / E)`` is then a sample from ``p`` (race of exponentials)."""
    ids = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    h = _mix32((ids[None, :] * 0x9E3779B1 & _M32) ^ keys[:, None])
    h = _mix32(h ^ (keys[:, None] * 0x2545F49 & _M32))
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # uniform in (0, 1]
    # (2**24 - 1) + 0.5 rounds to 2**24 in float32: u is then exactly 1 and its variate 0, and a
    # token of probability 0 (masked: banned, outside allowed_token_ids, past top-k...) would win
    # with 0 / 0 = NaN. Such a variate is the smallest one instead (-log(1 - 2**-25)).
    return (-torch.log(u)).clamp_min_(_SMALLEST_VARIATE)
