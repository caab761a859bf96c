"""Paged attention backends: torch on CPU (and any device), Triton on CUDA."""

from deepinfer.runtime.kernels.interpreter_compat import (
    patch_if_interpreting as _patch_if_interpreting,
)

_patch_if_interpreting()  # Triton's interpreter (the kernels on CPU tensors, the tests) on NumPy 2.4
