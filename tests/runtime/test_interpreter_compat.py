"""``kernels/interpreter_compat.py``: a scalar of Triton's interpreter indexes as its one element on
every Triton (3.6's ``int(array)`` fails on NumPy 2.4: the GPU machine's interpreter runs failed)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("triton", reason="Triton is not installed")


def _scalar(data: np.ndarray) -> SimpleNamespace:
    return SimpleNamespace(handle=SimpleNamespace(data=data))


def test_index_reads_the_one_element_of_any_shape():
    from deepinfer.runtime.kernels.interpreter_compat import _index

    assert _index(_scalar(np.array([7], np.int32))) == 7  # what the interpreter holds: shape (1,)
    assert _index(_scalar(np.array(-3, np.int64))) == -3
    assert _index(_scalar(np.array([[5]], np.int64))) == 5
    assert range(10)[_index(_scalar(np.array([4], np.int32)))] == 4


def test_patch_sets_the_index_after_tritons_own_and_is_idempotent():
    from deepinfer.runtime.kernels.interpreter_compat import _index, patch_interpreter
    from triton.runtime import interpreter

    assert patch_interpreter() is True
    wrapped = interpreter._patch_lang_tensor
    assert patch_interpreter() is True and interpreter._patch_lang_tensor is wrapped  # not wrapped twice
    set_attrs: list[tuple[str, object]] = []
    scope = SimpleNamespace(set_attr=lambda obj, name, value: set_attrs.append((name, value)))
    wrapped(type("FakeTensor", (), {}), scope)
    index = [value for name, value in set_attrs if name == "__index__"]
    assert index and index[-1] is _index  # Triton's own first, ours last: ours is what stays


def test_a_kernel_looping_to_a_minimum_runs_in_the_interpreter():
    """A loop bound from ``tl.minimum`` (as ``_gguf_gemm_kernel``'s K split), run under
    ``TRITON_INTERPRET=1`` in a fresh process, where importing the kernels applies the patch."""
    code = r"""
import torch, triton, triton.language as tl
import deepinfer.runtime.kernels  # noqa: F401  (applies the patch under the interpreter)

@triton.jit
def total(x_ptr, out_ptr, n, split, BLOCK: tl.constexpr):
    lo = tl.program_id(0) * split
    acc = tl.zeros([BLOCK], tl.float32)
    for k in range(lo, tl.minimum(n, lo + split), BLOCK):
        c = k + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + c, mask=c < n, other=0.0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))

x = torch.arange(100, dtype=torch.float32)
out = torch.zeros(4)
total[(4,)](x, out, 100, 32, BLOCK=8)
want = [float(x[i * 32:min(100, i * 32 + 32)].sum()) for i in range(4)]
assert out.tolist() == want, (out.tolist(), want)
print("ok")
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-2000:]
