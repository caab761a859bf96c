"""DeepInfer: an LLM inference engine with a C++ hot path and pluggable accelerator backends.

``import deepinfer`` is cheap: the runtime (and torch) load on first use of ``LLM`` or
``SamplingParams``; ``deepinfer._C`` loads its submodules on access.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("deepinfer")
except PackageNotFoundError:  # running from a source checkout
    __version__ = "0+dev"

if TYPE_CHECKING:
    from deepinfer.runtime.llm import LLM
    from deepinfer.runtime.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]

_LAZY = {
    "LLM": ("deepinfer.runtime.llm", "LLM"),
    "SamplingParams": ("deepinfer.runtime.sampling_params", "SamplingParams"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
