"""Triton's interpreter (``TRITON_INTERPRET=1``: the kernels on CPU tensors, as the tests run them)
on the NumPy versions that refuse ``int()`` of a one-element 1-d array.

The interpreter holds a kernel's scalars as one-element arrays. Triton 3.6's makes a scalar's
``__index__`` (``range(k_lo, tl.minimum(...), BLOCK)`` in a kernel) with ``int(array)``, which
NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"); Triton 3.9's
squeezes the array first. ``patch_interpreter`` makes every version's do what 3.9's does. Compiled
kernels never see this (a scalar is a register there), so it is applied only under the interpreter.
"""

from __future__ import annotations

import os
from typing import Any

_PATCHED = "_deepinfer_index_squeezed"


def _index(self: Any) -> int:
    return int(self.handle.data.reshape(-1)[0]) if self.handle.data.size == 1 else int(self.handle.data)


def patch_interpreter() -> bool:
    """Wrap the interpreter's tensor patching so a scalar's ``__index__`` reads its one element.
    Returns whether it is in place (False: this Triton has no such hook, nothing changed)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return False
    if getattr(original, _PATCHED, False):
        return True

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _index)

    setattr(patch_lang_tensor, _PATCHED, True)
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True


def patch_if_interpreting() -> None:
    """``patch_interpreter`` when ``TRITON_INTERPRET=1`` (the packages holding Triton kernels call
    this on import); nothing otherwise."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        patch_interpreter()
