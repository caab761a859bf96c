"""The CUDA Triton kernel equals the torch paged attention (run in Triton's CPU interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_triton_kernel_matches_torch_paged_attention():
    pytest.importorskip("triton", reason="Triton is not installed (it ships with torch's CUDA wheels)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    here = os.path.dirname(__file__)
    out = subprocess.run([sys.executable, os.path.join(here, "triton_check.py")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
