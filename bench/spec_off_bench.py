""""No slowdown when speculation is off": DeepInfer on the CPU from two source trees, interleaved.

    python bench/spec_off_bench.py --before /tmp/before --before-engine /tmp/before/build/dev/deepinfer-engine/pkg \
        [--after .] [--after-engine build/dev/deepinfer-engine/pkg] [--rounds 3] [--threads 2]

Each round runs one child process per tree (``--after`` first in odd rounds, ``--before`` first
in even ones), each with its tree's ``deepinfer-meta/src`` and its own engine build on
``PYTHONPATH``. A child measures bench/cpu_vs_llamacpp.py's DeepInfer contender (``dq``: the
default model with its quantization kept, no ``speculative_config``): batch-1 decode of a
64-token prompt + 128 new tokens (new tokens / wall time) and 16 concurrent requests of 64 + 64
(total new tokens / wall time), each the median of ``--repeats`` runs after a warm-up, greedy,
EOS ignored, no prefix caching. Prints every figure with the 1-minute load average and the
after / before ratio per round and over the rounds' medians (the issue asks for within 3 %).

Use it for main against the parent of the commit that added ``runtime/speculative``
(``git log --oneline -- deepinfer-meta/src/deepinfer/runtime/speculative | tail -1``), checked out
with ``git worktree add`` and built with ``scripts/devbuild.sh`` when its C++ differs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT_LEN, NEW_TOKENS, CONC, CONC_NEW = 64, 128, 16, 64


def child(threads: int, repeats: int, concurrent: bool = True) -> None:
    """Measure this process's deepinfer (whatever PYTHONPATH gives) and print one JSON line."""
    import torch  # first, as on the GPU machines (before any deepinfer native module)

    torch.set_num_threads(threads)
    import numpy as np
    from deepinfer import LLM, SamplingParams

    llm = LLM(device="cpu", max_model_len=1024, enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    one = [rng.integers(100, 1000, PROMPT_LEN).tolist()]
    many = rng.integers(100, 1000, (CONC, PROMPT_LEN)).tolist()

    def rate(prompts: list[list[int]], n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        reqs = [{"prompt_token_ids": p} for p in prompts]
        llm.generate(reqs, params, use_tqdm=False)  # warm-up
        rates = []
        for _ in range(repeats):
            t = time.perf_counter()
            llm.generate(reqs, params, use_tqdm=False)
            rates.append(len(prompts) * n / (time.perf_counter() - t))
        return statistics.median(rates)

    out = {"decode1": rate(one, NEW_TOKENS), "load1": os.getloadavg()[0]}
    out["concurrent16"] = rate(many, CONC_NEW) if concurrent else float("nan")
    out["load2"] = os.getloadavg()[0]
    print("RESULT " + json.dumps(out), flush=True)


def run_tree(tree: str, engine: str, threads: int, repeats: int, concurrent: bool = True) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=f"{os.path.abspath(engine)}:{os.path.join(os.path.abspath(tree), 'deepinfer-meta', 'src')}",
               OMP_NUM_THREADS=str(threads))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--threads", str(threads),
                           "--repeats", str(repeats)] + ([] if concurrent else ["--no-concurrent"]), env=env, capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{tree}: the child failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return dict(json.loads(lines[-1][len("RESULT "):]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", help="the source tree before speculative decoding (required)")
    p.add_argument("--before-engine", help="its engine build's pkg folder, scripts/devbuild.sh (required)")
    p.add_argument("--after", default=os.path.dirname(HERE))
    p.add_argument("--after-engine", default=None, help="default: AFTER/build/dev/deepinfer-engine/pkg")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-concurrent", action="store_true", help="batch-1 decode only (the 16 requests' "
                   "prefill on torch takes most of a child's time)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.threads, args.repeats, not args.no_concurrent)
        return
    if not args.before or not args.before_engine:
        p.error("--before and --before-engine are required")
    after_engine = args.after_engine or os.path.join(args.after, "build", "dev", "deepinfer-engine", "pkg")
    trees = {"after": (args.after, after_engine), "before": (args.before, args.before_engine)}
    results: dict[str, list[dict[str, float]]] = {"after": [], "before": []}
    ratios: dict[str, list[float]] = {"decode1": []} if args.no_concurrent else {"decode1": [], "concurrent16": []}
    print(f"== DeepInfer CPU, default model, {args.threads} threads; after = {args.after}, before = {args.before}; "
          f"{args.rounds} rounds, each figure the median of {args.repeats} runs", flush=True)
    for r in range(args.rounds):
        order = ["after", "before"] if r % 2 == 0 else ["before", "after"]
        got = {}
        for name in order:
            got[name] = run_tree(*trees[name], args.threads, args.repeats, not args.no_concurrent)
            results[name].append(got[name])
            g = got[name]
            conc = "" if args.no_concurrent else f", 16 concurrent {g['concurrent16']:.1f} tok/s (load {g['load2']:.1f})"
            print(f"  round {r + 1} {name}: batch-1 decode {g['decode1']:.1f} tok/s (load {g['load1']:.1f}){conc}",
                  flush=True)
        for m in ratios:
            ratios[m].append(got["after"][m] / got["before"][m])
        print(f"  round {r + 1} after / before: " + ", ".join(f"{m} {ratios[m][-1]:.3f}" for m in ratios), flush=True)
    for m in ratios:
        med = {n: statistics.median(x[m] for x in results[n]) for n in results}
        print(f"{m}: after {med['after']:.1f} tok/s, before {med['before']:.1f} tok/s (medians), ratio of medians "
              f"{med['after'] / med['before']:.3f}; per-round ratios {', '.join(f'{x:.3f}' for x in ratios[m])} "
              f"(median {statistics.median(ratios[m]):.3f})", flush=True)


if __name__ == "__main__":
    main()
