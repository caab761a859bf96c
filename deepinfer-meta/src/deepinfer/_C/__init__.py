"""The unified native namespace ``deepinfer._C``.

``engine`` comes from the ``deepinfer-engine`` wheel and always works. ``cuda_utils`` and
``graph_timer`` come from the backend wheel that the plugin registry resolves at their
first import; with no usable backend they raise an ImportError that says why and what to
install. Submodules are imported on access so ``import deepinfer._C`` stays cheap.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["cuda_utils", "engine", "graph_timer"]


def __getattr__(name: str) -> ModuleType:
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
