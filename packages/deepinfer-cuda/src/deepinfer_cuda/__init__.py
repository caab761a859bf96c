"""DeepInfer's CUDA backend.

``deepinfer_cuda.cuda_utils`` (``alloc_tensor``, ``export_ipc_tensor``, ``import_ipc_tensor``)
and ``deepinfer_cuda.graph_timer`` (``EventHandle``, ``EventRecordNodeHandle``,
``GraphHandle``) over the CUDA driver API, which the native module loads at run time from
``libcuda.so.1``. Users normally reach them as ``deepinfer._C.cuda_utils`` /
``deepinfer._C.graph_timer`` after the plugin registry resolved this backend.

Submodules are imported on first access so that ``import deepinfer_cuda`` (and the plugin
probe) stay cheap.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__version__ = "0.1.0"
__all__ = ["__version__", "cuda_utils", "graph_timer"]


def __getattr__(name: str) -> ModuleType:
    if name in ("cuda_utils", "graph_timer"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
