"""Batch invariance on CUDA (issue 29): ``LLM(device="cuda", deterministic=True)`` gives a request
the same greedy and seeded tokens alone and under load.

- In CI (CPU): the batch-invariant Triton kernels in Triton's interpreter
  (``batch_invariant_check.py``: matmul and RMSNorm rows independent of the row count, attention
  rows independent of the step's make-up, each against a reference).
- On a CUDA device: 64 greedy requests of varied lengths together and one at a time, random
  bfloat16 weights of the SmolLM2 shape and a Qwen3 shape (q/k norm), and 16 seeded ones:
  0 differ. The default path's count of differences is printed beside it (cuBLAS, graphs).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")


def test_batch_invariant_kernels_in_the_triton_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (it ships with torch's CUDA wheels)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    here = os.path.dirname(__file__)
    out = subprocess.run([sys.executable, os.path.join(here, "batch_invariant_check.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)")


def _llm(shape: str, tmp_path, **kw):
    pytest.importorskip("triton", reason="Triton is not installed (it ships with torch's CUDA wheels)")
    from deepinfer import LLM
    from gpu_shapes import write_shape_dir

    llm = LLM(write_shape_dir(str(tmp_path / shape), shape), device="cuda", dtype="bfloat16", dummy_weights=True,
              max_model_len=512, num_kv_blocks=1024, max_num_seqs=64, max_num_batched_tokens=512, **kw)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # livelier than the dummy init: varied greedy tokens
        for name, p in llm.runner.model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    return llm


def _prompts(vocab: int) -> list[dict]:
    # lengths 3..130 so the 64 prompts take several (chunked) prefill steps
    return [{"prompt_token_ids": [(97 * i + 13 * j) % (vocab - 10) + 5 for j in range(3 + (37 * i) % 128)]}
            for i in range(64)]


def _together_and_alone(llm, prompts, sps):
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]
    alone = [llm.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, sps, strict=True)]
    return [i for i, (a, b) in enumerate(zip(together, alone, strict=True)) if a != b]


@gpu
@pytest.mark.parametrize("shape", ["smollm2-135m", "test-small-qwen3"])
def test_64_greedy_requests_together_equal_alone_on_cuda(shape, tmp_path):
    from deepinfer import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = _llm(shape, tmp_path, deterministic=True)
    prompts = _prompts(llm.runner.config.vocab_size)
    differ = _together_and_alone(llm, prompts, [sp] * 64)
    del llm
    default = _together_and_alone(_llm(shape, tmp_path), prompts, [sp] * 64)
    print(f"{shape}: deterministic {len(differ)} of 64 differ; default path {len(default)} of 64 differ")
    assert differ == [], f"{len(differ)} of 64 differ: {differ}"


@gpu
def test_seeded_requests_together_equal_alone_on_cuda(tmp_path):
    from deepinfer import SamplingParams

    llm = _llm("smollm2-135m", tmp_path, deterministic=True)
    prompts = _prompts(llm.runner.config.vocab_size)[:16]
    sps = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=1000 + i) for i in range(16)]
    assert _together_and_alone(llm, prompts, sps) == []


@gpu
def test_deterministic_on_cuda_runs_eager_on_the_invariant_kernels(tmp_path):
    from deepinfer.runtime.kernels.batch_invariant import InvariantLinear

    llm = _llm("test-small", tmp_path, deterministic=True)
    assert llm.worker.graph_batch_sizes is None  # no decode graphs: they run the fused one-row kernels
    layer = llm.runner.model.layers[0]
    assert isinstance(layer.qkv_proj, InvariantLinear) and layer.input_layernorm.batch_invariant


def test_deterministic_on_cuda_refuses_other_attention_backends():
    from deepinfer.runtime.worker.model_runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)
    runner.model = torch.nn.Linear(2, 2)
    runner.device = torch.device("cuda")
    with pytest.raises(ValueError, match="attention_backend='torch'"):
        runner._batch_invariant_cuda("torch", 16)
