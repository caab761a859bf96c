"""Which device the runtime runs on: the one of the backend the plugin registry selected.

CUDA backend -> the torch CUDA device; Ascend backend -> the torch_npu device (when torch_npu
imports); no usable backend -> CPU. A backend whose torch side is missing (a CPU-only torch
under the CUDA backend, no torch_npu under Ascend) also gives CPU, and says why.
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


def selected_backend_name() -> str | None:
    """The name of the backend the registry resolves, or None when none is usable."""
    from deepinfer.plugins.registry import BackendUnavailableError, registry

    try:
        return registry.resolve().name
    except BackendUnavailableError:
        return None


def resolve_runtime_device(device: str | None) -> RuntimeDevice:
    """``device`` as asked ("cpu", "cuda:1", "npu", ...), or the selected backend's device when None."""
    if device is None:
        return device_for_backend(selected_backend_name())
    if not isinstance(device, str) or not device:
        raise ValueError(f"device must be a string such as 'cpu' or 'cuda:0', got {device!r}")
    kind = device.split(":", 1)[0]
    backend = {"cuda": "cuda", "npu": "ascend", "cpu": "cpu"}.get(kind, kind)
    return RuntimeDevice(device, backend, "asked for with device=")
