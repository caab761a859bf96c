"""Issue 30's GPU path for mixture-of-experts and MLA models: the Triton routing, the one-program
sort by expert, the MLA decode kernel over the latent cache (Triton's interpreter on CPU, against
torch and float64 references: ``moe_mla_kernels_check.py``), and the decode graphs' forward of
tiny Qwen3-MoE / DeepSeek-V2 / DeepSeek-V3 models against the eager step."""

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
    proc = subprocess.run([sys.executable, os.path.join(HERE, "moe_mla_kernels_check.py"), "cpu", "float32", part],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    oks = [line for line in proc.stdout.splitlines() if line.endswith((": ok", "(ok)"))]
    assert len(oks) == expect and "FAIL" not in proc.stdout, proc.stdout


def test_routing_sort_by_expert_and_mla_decode_kernels_in_tritons_interpreter():
    """Routing (softmax / sigmoid, renormalised or not, scaled; ties to the lower index; one expert
    taking every token) equals ``models.moe.route``; the one-program sort by expert equals the torch
    version bit for bit (experts without tokens, every token to one pair of experts, E up to 257);
    the experts' combine with the residual folded in (the decode graphs' stream) matches a float64
    reference with either sort; the MLA decode kernel is within 1e-5 of a float64 reference (block tables, ragged lengths,
    head counts not a multiple of the head block, context splits)."""
    _interpreted("kernels", 7 + 18 + 6 + 4)


def test_decode_graph_forwards_equal_the_eager_step_in_tritons_interpreter():
    """What the decode graphs capture (Qwen3-MoE: the fused Llama forward with MoE layers;
    DeepSeek-V2/V3: their own forward with the MLA decode kernel) gives the eager step's logits,
    with a padding row (slot -1) in the batch."""
    pytest.importorskip("transformers", reason="transformers (the tiny checkpoints) is not installed")
    _interpreted("models", 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_mla_kernels_on_the_gpu(dtype):
    from moe_mla_kernels_check import main

    assert main("cuda", dtype) == 0


def test_moe_and_mla_models_capture_decode_graphs():
    from deepinfer.runtime.models.deepseek_v2 import DeepseekV2ForCausalLM
    from deepinfer.runtime.models.moe import MoeForCausalLM

    assert MoeForCausalLM.supports_decode_graphs and DeepseekV2ForCausalLM.supports_decode_graphs


def test_kernel_entry_points_refuse_bad_input():
    pytest.importorskip("triton", reason="triton is not installed")
    from deepinfer.runtime.attention.triton_mla import mla_decode
    from deepinfer.runtime.kernels.fused_moe import align_by_expert_triton, route_greedy

    with pytest.raises(ValueError, match="top_k must be in"):
        route_greedy(torch.zeros(2, 4), 5, False, True)
    with pytest.raises(TypeError, match="int32 or int64"):
        align_by_expert_triton(torch.zeros(2, 2), 4, 16)
    q, lens, bt = torch.zeros(2, 4, 40), torch.ones(2, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="cache must be"):
        mla_decode(q, torch.zeros(1, 4, 16, 1, 36), bt, lens, 32, 1.0)
    with pytest.raises(ValueError, match="kv_lora_rank must be"):
        mla_decode(q, torch.zeros(1, 4, 16, 1, 40), bt, lens, 40, 1.0)
    with pytest.raises(ValueError, match="2 queries"):
        mla_decode(q, torch.zeros(1, 4, 16, 1, 40), bt[:1], lens, 32, 1.0)
    with pytest.raises(ValueError, match="num_splits"):
        mla_decode(q, torch.zeros(1, 4, 16, 1, 40), bt, lens, 32, 1.0, 0)


@pytest.mark.parametrize("shared", [False, True])
def test_moe_block_adds_the_residual_it_is_given(shared):
    """SparseMoe(h, residual=r) == r + SparseMoe(h) (the decode graphs hand the residual stream
    to the block; on CUDA it is added in the experts' combine kernel), with and without a shared
    expert."""
    from deepinfer.runtime.models.config import MoeSpec
    from deepinfer.runtime.models.moe import SparseMoe

    torch.manual_seed(0)
    spec = MoeSpec(num_experts=6, top_k=2, expert_intermediate_size=8, moe_layers=(0,), norm_topk_prob=True,
                   shared_intermediate_size=12 if shared else 0, shared_expert_gate=shared)
    block = SparseMoe(16, spec)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    h, r = torch.randn(5, 16), torch.randn(5, 16)
    torch.testing.assert_close(block(h, residual=r), r + block(h), atol=1e-6, rtol=1e-6)
