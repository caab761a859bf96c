"""The fused Triton kernels and the split-K decode attention equal the torch ops they replace
(run in Triton's CPU interpreter; tests/cuda runs the same check on a GPU, in bf16 too)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_fused_kernels_match_torch_ops():
    pytest.importorskip("triton", reason="Triton is not installed (it ships with torch's CUDA wheels)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    here = os.path.dirname(__file__)
    out = subprocess.run([sys.executable, os.path.join(here, "fused_kernels_check.py"), "cpu"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
