"""2 MiB pages for a CPU model's parameters, on and off, in one process (rounds interleaved).

    python bench/cpu_huge_pages.py [--dtype float32] [--rounds 7]

Loads the default model (or ``--model``) twice as ``LLM`` on CPU: once as usual (a dense load
puts its parameters on 2 MiB transparent huge pages, ``runtime/loading/host_arena.py``) and once with
the arena turned off (4 KiB pages), then alternates one batch-1 generation (64-token prompt, 128
greedy tokens) on each. Prints each load time, tok/s per round and the per-round ratio, with the
load average. Both models in one process see the same machine drift.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    import deepinfer.runtime.loading.host_arena as host_arena
    from deepinfer import LLM, SamplingParams

    def load() -> tuple[LLM, float]:
        t = time.perf_counter()
        llm = LLM(args.model, device="cpu", dtype=args.dtype, max_model_len=1024, enable_prefix_caching=False)
        return llm, time.perf_counter() - t

    huge, t_huge = load()
    os.environ[host_arena.ENV_SWITCH] = "0"
    small, t_small = load()
    print(f"load: 2 MiB pages {t_huge:.2f} s, 4 KiB pages {t_small:.2f} s")
    prompt = [int(x) for x in np.random.default_rng(0).integers(100, 1000, 64)]
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)

    def tok_s(llm: LLM) -> float:
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return 128 / (time.perf_counter() - t)

    tok_s(huge), tok_s(small)  # warm-up
    a, b = [], []
    for _ in range(args.rounds):
        a.append(tok_s(huge))
        b.append(tok_s(small))
    ratios = np.array(a) / np.array(b)
    print("2 MiB pages tok/s: " + " ".join(f"{x:.1f}" for x in a))
    print("4 KiB pages tok/s: " + " ".join(f"{x:.1f}" for x in b))
    print("ratio per round:   " + " ".join(f"{r:.2f}" for r in ratios)
          + f"  (median {np.median(ratios):.2f}x)  load_avg={os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
