"""DeepInfer: an LLM inference engine with a C++ hot path and pluggable accelerator backends.

``import deepinfer`` imports nothing else: the runtime (and torch) load on first use of ``LLM``
or ``SamplingParams``, ``__version__`` is read on first access, and ``deepinfer._C`` loads its
submodules on access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    __version__: str
    from deepinfer.runtime.beam_search import BeamSearchParams
    from deepinfer.runtime.llm import LLM
    from deepinfer.runtime.sampling_params import SamplingParams
    from deepinfer.runtime.structured.params import StructuredOutputsParams

__all__ = ["LLM", "BeamSearchParams", "SamplingParams", "StructuredOutputsParams", "__version__"]

_LAZY = {
    "LLM": ("deepinfer.runtime.llm", "LLM"),
    "SamplingParams": ("deepinfer.runtime.sampling_params", "SamplingParams"),
    "BeamSearchParams": ("deepinfer.runtime.beam_search", "BeamSearchParams"),
    "StructuredOutputsParams": ("deepinfer.runtime.structured.params", "StructuredOutputsParams"),
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deepinfer")
    except PackageNotFoundError:  # running from a source checkout
        return "0+dev"


def __getattr__(name: str) -> Any:
    if name == "__version__":  # read from the installed metadata on first use
        globals()["__version__"] = _version()
        return globals()["__version__"]
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
