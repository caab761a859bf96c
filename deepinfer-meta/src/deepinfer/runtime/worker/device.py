"""Which device the runtime runs on: the one of the backend the plugin registry selected
(``plugins.devices`` says which torch device serves each backend)."""

from __future__ import annotations

from deepinfer.plugins.devices import RuntimeDevice, device_for_backend

__all__ = ["RuntimeDevice", "device_for_backend", "resolve_runtime_device", "selected_backend_name"]


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
