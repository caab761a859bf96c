"""Fused Triton kernels of the CUDA decode path (importing this module needs Triton)."""

from deepinfer.runtime.kernels.interpreter_compat import (
    patch_if_interpreting as _patch_if_interpreting,
)

_patch_if_interpreting()  # Triton's interpreter (the kernels on CPU tensors, the tests) on NumPy 2.4
