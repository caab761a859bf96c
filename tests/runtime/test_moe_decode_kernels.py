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
    the in-kernel norm's bits; the down kernel with its expert rows preloaded (before the PDL
    wait) matches the same reference, and so does the down kernel reducing every slot's products
    once (DEEPINFER_MOE_DOWN_ONE_SUM), with unrolled and runtime K loops; the router in the o
    projection's launch (``route_in_o``) gives the o GEMV's bits, the float64 reference's top-k
    (ties to the lower index) and, through the gate/up kernel, its routing weights and block
    output; its top-k over integer keys orders signed zeros, negatives, infinities and repeats as
    a stable sort does."""
    _interpreted("kernels", 5 * 6 + 3 + 5 + 5 + 3)


def test_few_token_path_and_grouped_path_give_the_same_logits_in_tritons_interpreter():
    """Tiny float32 Qwen3-MoE (norm fused into the router at one row, and with
    DEEPINFER_MOE_ROUTER_IN_O=1 the router in the o projection's launch) and Qwen2-MoE (shared
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
    with pytest.raises(ValueError, match="one_sum"):
        experts_small(x, w.float(), ids, w13, w2, preload=True, one_sum=True)
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


def test_router_in_o_refuses_bad_operands():
    pytest.importorskip("triton", reason="triton is not installed")
    from deepinfer.runtime.kernels.moe_decode import experts_small, route_in_o

    a, wo, x = torch.zeros(1, 16), torch.zeros(8, 16), torch.zeros(1, 8)
    wx, wa = torch.zeros(4, 8), torch.zeros(4, 16)
    tile = (2, 16, 1, 1)
    with pytest.raises(ValueError, match="one contiguous row"):
        route_in_o(torch.zeros(2, 16), wo, x, wx, wa, 2, tile)
    with pytest.raises(ValueError, match="o_weight"):
        route_in_o(a, torch.zeros(8, 12), x, wx, wa, 2, tile)
    with pytest.raises(ValueError, match="residual"):
        route_in_o(a, wo, torch.zeros(1, 9), wx, wa, 2, tile)
    with pytest.raises(ValueError, match="wa must be a contiguous float32"):
        route_in_o(a, wo, x, wx, wa.double(), 2, tile)
    with pytest.raises(ValueError, match="top_k"):
        route_in_o(a, wo, x, wx, wa, 5, tile)
    with pytest.raises(ValueError, match="split-K"):
        route_in_o(a, wo, x, wx, wa, 2, (2, 16, 1, 1, 2))
    w13, w2 = torch.zeros(4, 12, 8), torch.zeros(4, 8, 6)
    ids, w = torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 2)
    logits = torch.zeros(1, 4)
    with pytest.raises(ValueError, match="route_logits needs norm"):
        experts_small(x, w, ids, w13, w2, route_logits=(logits, False, True, 1.0))
    with pytest.raises(ValueError, match="route_logits"):
        experts_small(x, w, ids, w13, w2, norm=(torch.ones(8), 1e-6), route_logits=(logits.double(), False, True, 1.0))
    with pytest.raises(ValueError, match="preload=True"):
        experts_small(x, w, ids, w13, w2, norm=(torch.ones(8), 1e-6), route_logits=(logits, False, True, 1.0),
                      preload=True)


@pytest.mark.parametrize("shape,tokens,expected", [
    ("qwen3-30b-a3b", 1, (True, True)), ("qwen3-30b-a3b", 2, (True, True)), ("qwen3-30b-a3b", 4, (False, False)),
    ("deepseek-v2-lite", 2, (True, True)), ("mixtral-8x7b", 1, (False, False)), ("llama4-like", 1, (False, True)),
])
def test_k_loops_unroll_where_the_h200_measured_a_gain(shape, tokens, expected):
    """(gate/up, down) unrolled: Qwen3-30B-A3B and DeepSeek-V2-Lite gained at one and two tokens and
    lost at four; Mixtral-8x7B (K 4096 and 14336) lost at one (moe_decode's table). A shape with a
    wide hidden and a narrow expert unrolls only the down kernel."""
    pytest.importorskip("triton", reason="triton is not installed")
    from deepinfer.runtime.kernels.moe_decode import static_k_loops

    hidden, inter = {"qwen3-30b-a3b": (2048, 768), "deepseek-v2-lite": (2048, 1408), "mixtral-8x7b": (4096, 14336),
                     "llama4-like": (5120, 1024)}[shape]
    assert static_k_loops(tokens, hidden, inter) == expected


def test_large_experts_take_the_few_token_kernels_at_one_token_only(monkeypatch):
    """Experts of LARGE_EXPERT_BYTES or more (Mixtral's) re-read per (token, slot) pair cost more than
    the grouped path's sort: the few-token kernels run one token; smaller experts run up to the switch."""
    from deepinfer.runtime.models import moe

    monkeypatch.setattr(moe, "KERNELS_ON_CPU", True)
    monkeypatch.setattr(moe, "_triton_available", lambda: True)
    monkeypatch.delenv("DEEPINFER_MOE_SMALL_BATCH", raising=False)
    small = moe.ExpertsSwiGLU(4, 8, 16)  # (2*16*8 + 8*16) float32 values = 1,536 bytes an expert
    assert small.expert_bytes() == 1536
    assert [moe._small_batch(torch.zeros(t, 8), small) for t in (1, 2, 4, 5)] == [True, True, True, False]
    monkeypatch.setattr(moe, "LARGE_EXPERT_BYTES", 1536)
    assert [moe._small_batch(torch.zeros(t, 8), small) for t in (1, 2, 4)] == [True, False, False]
    monkeypatch.setenv("DEEPINFER_MOE_SMALL_BATCH", "0")
    assert not moe._small_batch(torch.zeros(1, 8), small)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("prefetch", ["0", "1"])  # DEEPINFER_PDL_PREFETCH: loads before the PDL wait
def test_few_token_moe_kernels_on_the_gpu(dtype, prefetch, monkeypatch):
    from moe_decode_check import main

    monkeypatch.setenv("DEEPINFER_PDL_PREFETCH", prefetch)

    assert main("cuda", dtype, "kernels" if dtype == "bfloat16" else "all") == 0
