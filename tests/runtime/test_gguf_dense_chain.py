"""``DEEPINFER_GGUF_DENSE_ROWS``' weights decoded ahead (``models.gguf_dense_chain``): a chain of
four GGUF projections, run as a forward pass, in and out of order, against gguf's dequantization
in float64 (``gguf_dense_chain_check.py``: under Triton's interpreter on the CPU, in a subprocess
because it must be set before triton loads; on CUDA also captured in a graph and replayed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf", reason="gguf is not installed")
HERE = Path(__file__).parent


def _run(device: str, interpret: bool) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, str(HERE / "gguf_dense_chain_check.py"), device], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("ok"), proc.stdout[-2000:]
    return proc.stdout


def test_chain_decodes_each_weight_ahead_in_its_turn():
    out = _run("cpu", interpret=True)
    # 2 passes x (4 products + 1 count) + 4 out of order
    assert out.count("ok  ") == 14, out
    assert out.count("3 weights decoded ahead, 0 left pending") == 2, out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_chain_on_cuda_and_in_a_cuda_graph():
    out = _run("cuda", interpret=False)
    assert "a pass captured in a CUDA graph and replayed equals the eager pass" in out, out


def test_chain_refuses_a_projection_twice():
    from deepinfer.runtime.kernels.gguf_layout import regroup
    from deepinfer.runtime.models.gguf_dense_chain import DenseChain
    from deepinfer.runtime.models.gguf_linear import GGUFLinearCUDA
    from gguf_gpu_check import random_blocks

    layer = GGUFLinearCUDA([regroup(torch.from_numpy(random_blocks("Q4_0", 4, 64, seed=0)), "Q4_0")])
    with pytest.raises(ValueError, match="DenseChain: a projection appears twice in the chain"):
        DenseChain([layer, layer])
