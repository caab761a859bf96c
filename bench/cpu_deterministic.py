"""The cost of ``LLM(deterministic=True)`` against the default path, both in one process, rounds
interleaved (the order alternates each round), so a busy machine slows both alike.

CPU (default): every step on the native kernels, one row per token, against the default path
(prefill and mixed steps on torch). CUDA (``--device cuda``, random bfloat16 weights of a
``tests/runtime/gpu_shapes.py`` shape): eager steps on the batch-invariant Triton kernels
against the default path (CUDA graphs, cuBLAS, the fused one-row decode kernels).

    python bench/cpu_deterministic.py [--threads 2] [--rounds 7] [--dtype float32]
    python bench/cpu_deterministic.py --device cuda --shape llama3-8b [--rounds 5]

Per round and mode: a 512-token prompt (prompt tokens / time to its first token), a batch of 16
prompts of 64 tokens prefilled together, batch-1 decode (64-token prompt, 64 new tokens: new
tokens / wall), and 16 concurrent requests of 64 + 64 (total new tokens / wall). Prints each
figure's median per mode with its range, and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--dtype", default=None, choices=[None, "float32"])
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shape", default="smollm2-135m", help="CUDA: a tests/runtime/gpu_shapes.py shape")
    args = p.parse_args()
    import torch  # noqa: F401 - before the engine's module (docs/troubleshooting.md: import order)
    from deepinfer import LLM, SamplingParams

    if args.device == "cuda":
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "runtime"))
        from gpu_shapes import write_shape_dir

        model = args.model or write_shape_dir(tempfile.mkdtemp(), args.shape)
        kw = dict(device="cuda", dtype="bfloat16", dummy_weights=True, max_model_len=1024,
                  num_kv_blocks=4096, enable_prefix_caching=False)  # both LLMs share the device
    else:
        model = args.model
        kw = dict(num_threads=args.threads, dtype=args.dtype, max_model_len=1024, cpu_kv_cache_bytes=256 << 20,
                  enable_prefix_caching=False)
    llms = {"default": LLM(model, **kw), "deterministic": LLM(model, deterministic=True, **kw)}

    def prompt(i: int, n: int) -> list[int]:
        return [(17 + 31 * i + 7 * j) % 40000 + 100 for j in range(n)]  # ids valid in every shape's vocabulary

    def measures(llm: LLM, r: int) -> dict[str, float]:
        out = {}
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt(r, 512)}], one, use_tqdm=False)
        out["512-token prompt (tok/s)"] = 512 / (time.perf_counter() - t)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt(100 * r + i, 64)} for i in range(16)], one, use_tqdm=False)
        out["16 x 64-token prompts (tok/s)"] = 16 * 64 / (time.perf_counter() - t)
        sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt(r + 7, 64)}], sp, use_tqdm=False)
        out["batch-1 decode, 64 + 64 (tok/s)"] = 64 / (time.perf_counter() - t)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt(200 * r + i, 64)} for i in range(16)], sp, use_tqdm=False)
        out["16 concurrent, 64 + 64 (total tok/s)"] = 16 * 64 / (time.perf_counter() - t)
        return out

    for llm in llms.values():  # warm-up
        measures(llm, 999)
    results: dict[str, dict[str, list[float]]] = {m: {} for m in llms}
    for r in range(args.rounds):
        order = list(llms) if r % 2 == 0 else list(reversed(llms))
        for mode in order:
            for k, v in measures(llms[mode], r).items():
                results[mode].setdefault(k, []).append(v)
        print(f"round {r + 1}/{args.rounds} load {os.getloadavg()[0]:.1f}", flush=True)
    where = f"cuda shape={args.shape} bfloat16" if args.device == "cuda" else \
        f"threads={args.threads} dtype={args.dtype or 'default (quantized)'}"
    print(f"{where} rounds={args.rounds}")
    for k in results["default"]:
        a, b = results["default"][k], results["deterministic"][k]
        ratios = [y / x for x, y in zip(a, b, strict=True)]
        print(f"{k:40s} default {statistics.median(a):8.1f} [{min(a):.1f}-{max(a):.1f}]  deterministic "
              f"{statistics.median(b):8.1f} [{min(b):.1f}-{max(b):.1f}]  ratio {statistics.median(ratios):.3f} "
              f"[{min(ratios):.3f}-{max(ratios):.3f}]")


if __name__ == "__main__":
    main()
