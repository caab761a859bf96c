"""The ``ascend`` entry point of the ``deepinfer.backends`` group.

Uses ``pluggy.HookimplMarker("deepinfer")`` only: this module never imports the
``deepinfer`` package. Describing the backend is cheap; :func:`probe` loads
``libascendcl.so`` with ctypes and asks for the device count and the CANN version
without ``aclInit`` or a device context; :func:`load` imports the native module.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import pluggy

from deepinfer_ascend import __version__
from deepinfer_ascend._probe import probe

hookimpl = pluggy.HookimplMarker("deepinfer")

PLUGIN_API_VERSION = 1
PRIORITY = 90


def load() -> ModuleType:
    """Import ``deepinfer_ascend._native`` (submodules ``cuda_utils`` and ``graph_timer``)."""
    return importlib.import_module("deepinfer_ascend._native")


@hookimpl
def deepinfer_backend() -> dict[str, Any]:
    """Describe the Ascend backend for the deepinfer plugin registry."""
    return {
        "name": "ascend",
        "distribution": "deepinfer-ascend",
        "version": __version__,
        "plugin_api_version": PLUGIN_API_VERSION,
        "priority": PRIORITY,
        "probe": probe,
        "load": load,
    }
