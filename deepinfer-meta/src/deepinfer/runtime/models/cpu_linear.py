"""Float32 CPU matmuls of several rows through oneDNN (the copy inside torch's CPU wheel).

Why: torch's ``F.linear`` sends float32 CPU products to MKL, which on the AMD EPYC (AVX-512) we
measure on runs at 65-105 GFLOP/s per core on SmolLM2's projections, where oneDNN's inner product
runs the same products at 150-240 (512 rows; 2.0-2.3x) and is also faster from 4 rows on (1.3-3x at
4-64 rows); at one row both read the weight at the same speed. oneDNN takes the plain [out, in]
float32 weight (or its input-major relayout) as it is: no packed second copy of the weights is
kept, so the native decode kernels can keep reading the same arrays.

The entry point, ``torch.ops.mkldnn._linear_pointwise``, is private to torch (it is what torch's
own inductor emits for CPU linears). It is checked once per process (present, runs, agrees with
``F.linear``); when the check fails every product goes through ``F.linear`` and the reason is
logged. Checked with torch 2.13.0+cpu. ``DEEPINFER_CPU_ONEDNN=0`` turns it off.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F

from deepinfer.runtime import switches
from deepinfer.runtime.kernels.shared_linear import SharedLinear

ENV_SWITCH = "DEEPINFER_CPU_ONEDNN"
# From this many rows oneDNN is the faster of the two (one row: equal, so F.linear stays).
ONEDNN_FROM_ROWS = 4
_log = logging.getLogger(__name__)


@functools.cache
def onednn_unavailable_reason() -> str | None:
    """None when oneDNN float32 linears can be used in this process, else why not (logged once)."""
    reason = _check()
    if reason is not None:
        _log.info("float32 CPU linears use F.linear (MKL): %s", reason)
    return reason


def _check() -> str | None:
    if not switches.enabled(ENV_SWITCH):
        return f"switched off by {ENV_SWITCH}=0"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"
    try:
        op = _onednn_op()
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(8, 64, generator=gen)
        w = torch.randn(48, 64, generator=gen)
        b = torch.randn(48, generator=gen)
        for weight in (w, w.t().contiguous().t()):  # both layouts the loader leaves
            got = op(x, weight, b, "none", [], "")
            if not torch.allclose(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5):
                return "torch.ops.mkldnn._linear_pointwise disagrees with F.linear"
    except Exception as exc:  # noqa: BLE001 - any failure of a private op means: use F.linear
        return f"torch.ops.mkldnn._linear_pointwise is not usable ({type(exc).__name__}: {exc})"
    return None


def _onednn_op() -> Callable[..., torch.Tensor]:
    return cast(Callable[..., torch.Tensor], torch.ops.mkldnn._linear_pointwise)


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; 2-D float32 CPU inputs of ``ONEDNN_FROM_ROWS`` rows or more
    run on oneDNN (same values up to summation order)."""
    if (x.dim() == 2 and x.shape[0] >= ONEDNN_FROM_ROWS and x.dtype == torch.float32
            and weight.dtype == torch.float32 and x.device.type == "cpu" and weight.device.type == "cpu"
            and onednn_unavailable_reason() is None):
        return _onednn_op()(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class CpuLinear(SharedLinear):
    """``nn.Linear`` whose forward is ``cpu_linear`` (build it with ``sharing``)."""

    @property
    def kernel_path(self) -> str:  # models/describe.py
        if self.weight.dtype != torch.float32 or onednn_unavailable_reason() is not None:
            return "torch matmul"
        return f"torch matmul (1-{ONEDNN_FROM_ROWS - 1} rows), oneDNN inner product from {ONEDNN_FROM_ROWS} rows"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_linear(x, self.weight, self.bias)
