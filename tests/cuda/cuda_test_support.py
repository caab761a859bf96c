"""Shared helpers of the CUDA backend tests.

GPU tests are skipped, with the reason, when the backend's own probe says no usable
NVIDIA driver/device is there or torch has no CUDA; CPU-side tests always run.
"""

from __future__ import annotations

import pytest
from deepinfer_cuda._probe import probe


def _gpu_skip_reason() -> str | None:
    result = probe()
    if not result["available"]:
        return f"needs an NVIDIA GPU and driver ({result['reason']})"
    try:
        import torch
    except ImportError:
        return "needs torch"
    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU and driver (torch.cuda.is_available() is False)"
    return None


GPU_SKIP_REASON = _gpu_skip_reason()
requires_gpu = pytest.mark.skipif(GPU_SKIP_REASON is not None, reason=GPU_SKIP_REASON or "")



def load_backend():
    """The backend module, loaded the way the registry loads it."""
    from deepinfer_cuda.plugin import deepinfer_backend

    return deepinfer_backend()["load"]()
