"""Issue 30's few-token MoE decode path (``kernels.moe_decode``): the router in one launch, the
expert GEMVs without the sort by expert, the combine and residual fused into the down projection
(Triton's interpreter on CPU, against float64 references: ``moe_decode_check.py``), and the model
switch between it and the grouped GEMMs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(__file__)


def _interpreted(part: str, expect: int) -> None:
    pytest.importorskip("triton", reason="triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([HERE] + sys.path))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "moe_decode_check.py"), "cpu", "float32", part],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    oks = [line for line in proc.stdout.splitlines() if line.endswith("(ok)")]
    assert len(oks) == expect and "FAIL" not in proc.stdout, proc.stdout


def test_few_token_moe_kernels_match_float64_references_in_tritons_interpreter():
    """Expert GEMVs + fused combine == a float64 per-expert reference (one token, several tokens,
    every token to one expert, one expert repeated across tokens, top_k 1 and 8, with and without
    the residual and the RMSNorm prologue); the one-launch router == route_greedy over the
    float32 logits (softmax / sigmoid, renormalised or not, E up to 128, k 1..8, tied scores to the
    lower index); where the norm is fused, the experts over the router's stored normed rows give
    the in-kernel norm's bits."""
    _interpreted("kernels", 2 * 6 + 3 + 5)


def test_few_token_path_and_grouped_path_give_the_same_logits_in_tritons_interpreter():
    """Tiny float32 Qwen3-MoE (norm fused into the router at one row) and Qwen2-MoE (shared
    expert): the decode forward's logits with the few-token kernels equal the grouped GEMMs' (1e-5)."""
    pytest.importorskip("transformers", reason="transformers (the tiny checkpoints) is not installed")
    _interpreted("models", 2)


def test_few_token_kernels_refuse_bad_operands():
    pytest.importorskip("triton", reason="triton is not installed")
    from deepinfer.runtime.kernels.moe_decode import experts_small, route_small

    x = torch.zeros(2, 8)
    w13, w2 = torch.zeros(4, 12, 8), torch.zeros(4, 8, 6)
    ids, w = torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2)
    with pytest.raises(ValueError, match="shapes disagree"):
        experts_small(x, w, ids, w13, torch.zeros(4, 8, 5))
    with pytest.raises(ValueError, match="residual"):
        experts_small(x, w, ids, w13, w2, residual=torch.zeros(3, 8))
    with pytest.raises(ValueError, match="float32"):
        experts_small(x, w.half(), ids, w13, w2)
    with pytest.raises(ValueError, match="top_k"):
        route_small(x, torch.zeros(4, 8), 5, False, True)
    with pytest.raises(ValueError, match="gate_weight"):
        route_small(x, torch.zeros(4, 8, dtype=torch.float16), 2, False, True)
    with pytest.raises(ValueError, match="normed_out needs norm.*no norm was given"):
        route_small(x, torch.zeros(4, 8), 2, False, True, normed_out=torch.empty(2, 8))
    with pytest.raises(ValueError, match=r"normed_out .*\[2, 8\].*got torch.float32 \(3, 8\)"):
        route_small(x, torch.zeros(4, 8), 2, False, True, norm=(torch.ones(8), 1e-6), normed_out=torch.empty(3, 8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_few_token_moe_kernels_on_the_gpu(dtype):
    from moe_decode_check import main

    assert main("cuda", dtype, "kernels" if dtype == "bfloat16" else "all") == 0
