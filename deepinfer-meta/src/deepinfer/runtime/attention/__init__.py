"""Paged attention backends: torch on CPU (and any device), Triton on CUDA."""

import os as _os

if _os.environ.get("TRITON_INTERPRET") == "1":  # the Triton kernels on CPU tensors (the tests)
    from deepinfer.runtime.kernels.interpreter_compat import patch_interpreter as _patch_interpreter

    _patch_interpreter()
