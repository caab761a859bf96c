"""Which torch device serves each accelerator backend (a fact about the backends, not the runtime).

CUDA backend -> the torch CUDA device; Ascend backend -> the torch_npu device (when torch_npu
imports); no usable backend -> CPU. A backend whose torch side is missing (a CPU-only torch
under the CUDA backend, no torch_npu under Ascend) also gives CPU, and says why. ``deepinfer env``
reports it and the runtime (``runtime/worker/device.py``) runs there.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RuntimeDevice:
    """The device string for torch, the backend serving it ("cuda", "ascend" or "cpu") and why."""

    device: str
    backend: str
    reason: str


def _torch_cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _torch_npu_available() -> bool:
    try:
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ImportError:
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def device_for_backend(backend: str | None) -> RuntimeDevice:
    """The runtime device that the selected backend named ``backend`` (None: none) serves."""
    if backend == "cuda":
        if _torch_cuda_available():
            return RuntimeDevice("cuda", "cuda", "the CUDA backend is selected")
        return RuntimeDevice("cpu", "cpu", "the CUDA backend is selected, but this torch build has no CUDA")
    if backend == "ascend":
        if _torch_npu_available():
            return RuntimeDevice("npu", "ascend", "the Ascend backend is selected")
        return RuntimeDevice("cpu", "cpu", "the Ascend backend is selected, but torch_npu does not import "
                             "or sees no NPU")
    if backend is None:
        return RuntimeDevice("cpu", "cpu", "no accelerator backend is available")
    return RuntimeDevice("cpu", "cpu", f"backend {backend!r} has no torch device the runtime knows")
