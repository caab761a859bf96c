"""Issue 30's GPU check that the MoE / MLA decode graphs compute what the eager path does (a
script, not a test: run on the H200).

    python bench/moe_graph_check.py

Tiny random Mixtral / Qwen3-MoE / Qwen2-MoE / DeepSeek-V2 / DeepSeek-V3 checkpoints
(``tests/runtime/tiny_moe_models.py``), float32 on CUDA: greedy tokens (4 prompts plus n=2, 24
new tokens each) with decode graphs + overlap scheduling against ``enforce_eager=True``; then the
same in bf16, where a differing token is reported (a near-tie between the kernels, or not).
Exits non-zero when a float32 run differs.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests", "runtime")]
ARCHS = ["qwen3_moe", "deepseek_v2", "mixtral", "qwen2_moe", "deepseek_v3"]  # most telling first
PROMPTS = [list(range(3, 40)), [5, 9, 13, 100, 3, 200], [42], [7] * 10 + [11, 12]]


def run(path: str, dtype: str, eager: bool) -> list[list[int]]:
    from deepinfer import LLM, SamplingParams

    # a small KV budget: the previous LLM's memory may still sit in torch's cache
    llm = LLM(path, dtype=dtype, enforce_eager=eager, max_num_seqs=8, max_model_len=128, block_size=16,
              num_kv_blocks=64)
    p = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": q} for q in PROMPTS], p, use_tqdm=False)
    two = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                       SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2), use_tqdm=False)
    captured = llm.runner.graphs is not None
    llm.close()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    toks = [list(o.outputs[0].token_ids) for o in outs] + [list(c.token_ids) for c in two[0].outputs]
    return toks + [[int(captured)]]


def main() -> int:
    from gpu_shapes import write_tokenizer
    from tiny_moe_models import save_tiny_moe

    bad = 0
    for arch in ARCHS:
        d = tempfile.mkdtemp(prefix=f"tiny-{arch}-")
        save_tiny_moe(d, arch)
        write_tokenizer(d, 320)
        for dtype in ("float32", "bfloat16"):
            eager, graphs = run(d, dtype, True), run(d, dtype, False)
            same = eager[:-1] == graphs[:-1]
            diff = [i for i, (a, b) in enumerate(zip(eager[:-1], graphs[:-1], strict=True)) if a != b]
            print(f"{arch} {dtype}: graphs captured={bool(graphs[-1][0])}, tokens "
                  f"{'identical to eager' if same else f'differ from eager in rows {diff}'}", flush=True)
            if dtype == "float32":
                bad += not same or not graphs[-1][0]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
