"""The ``cuda`` entry point of the ``deepinfer.backends`` group.

Implements the meta package's ``deepinfer_backend`` hook with pluggy alone: this module
never imports ``deepinfer``. Describing the backend is free; ``probe`` touches only the
driver library (no context); ``load`` imports the native module.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import pluggy

from deepinfer_cuda import __version__
from deepinfer_cuda._probe import probe

hookimpl = pluggy.HookimplMarker("deepinfer")

PLUGIN_API_VERSION = 1
PRIORITY = 100


def load() -> ModuleType:
    """Import the backend; the returned module has ``cuda_utils`` and ``graph_timer``."""
    return importlib.import_module("deepinfer_cuda.backend")


@hookimpl
def deepinfer_backend() -> dict[str, Any]:
    return {
        "name": "cuda",
        "distribution": "deepinfer-cuda",
        "version": __version__,
        "plugin_api_version": PLUGIN_API_VERSION,
        "priority": PRIORITY,
        "probe": probe,
        "load": load,
    }
