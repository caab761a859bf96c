"""Tensor parallelism on two CUDA devices over NCCL: TP=2 gives TP=1's greedy tokens (the first
16 of each prompt) in float32 and bfloat16, with CUDA graphs (fused decode) and eagerly.
Skipped without two CUDA devices."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA devices (torch.cuda.device_count() < 2)")
pytest.importorskip("triton", reason="Triton is not installed (it ships with torch's CUDA wheels)")

PROMPTS = [[5, 17, 33, 2, 99, 140, 7], [7, 8, 250, 3, 11, 12, 13, 14, 15, 16, 17, 18, 19], [300, 4], [9] * 40]


def _greedy(path, tp, dtype, eager):
    from deepinfer import LLM, SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with LLM(path, device="cuda", dtype=dtype, tensor_parallel_size=tp, enforce_eager=eager, max_model_len=128,
             num_kv_blocks=128, max_num_seqs=8) as llm:
        assert (llm.runner.graphs is None) == eager
        sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_gpus_give_one_gpus_greedy_tokens(tiny_model_dir, dtype, eager):
    one = _greedy(tiny_model_dir, 1, dtype, eager)
    two = _greedy(tiny_model_dir, 2, dtype, eager)
    assert two == one
    assert all(len(t) == 16 for t in one)
