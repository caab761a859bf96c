"""Test helper: make Triton's CPU interpreter run kernels with tensor loop bounds on NumPy 2.4."""

from __future__ import annotations

import numpy as np


def interpreter_loop_bounds_compat() -> None:
    """Triton's CPU interpreter before 3.7 turns a tensor loop bound (``range(start, end)``) into a
    Python int with ``int(array of shape (1,))``, which NumPy 2.4 refuses ("only 0-dimensional
    arrays can be converted to Python scalars"): the device's triton 3.6 failed here while CI's
    newer triton passed. Apply the conversion Triton 3.7+ uses (squeeze first); the compiled GPU
    kernels are untouched by this."""
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None:
        return
    try:
        int(np.zeros(1, dtype=np.int32))
        return  # this NumPy still converts size-1 arrays
    except TypeError:
        pass

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched
