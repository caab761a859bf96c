"""Startup of the default model on CPU: seconds from process start to import, model ready, first token.

    python bench/startup_bench.py [--rounds 3] [--compare OTHER_SRC] [--threads 2]

Each measurement is a fresh ``python`` process that imports ``deepinfer``, builds ``LLM()`` (the
embedded SmolLM2 GGUF, default dtype) and generates one greedy token; the parent stamps the time
it spawned the child and the child prints wall-clock stamps at each milestone. ``--compare``
names another ``deepinfer-meta/src`` folder (e.g. an older checkout) run in the same rounds,
alternating with this one. The 1-minute load average is printed beside each figure. The engine
package (``deepinfer_engine``) is taken from the current ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, os, sys, time
stamps = {}
import torch
torch.set_num_threads(int(os.environ["BENCH_THREADS"]))
from deepinfer import LLM, SamplingParams
stamps["import"] = time.time()
llm = LLM()
stamps["model ready"] = time.time()
llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
stamps["first token"] = time.time()
print("STAMPS" + json.dumps(stamps))
"""


def run_once(src: str, threads: int) -> dict[str, float]:
    paths = [src] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and "deepinfer-meta" not in p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), BENCH_THREADS=str(threads))
    start = time.time()
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True).stdout
    stamps = json.loads(out.split("STAMPS", 1)[1])
    return {k: v - start for k, v in stamps.items()}


def main() -> None:
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deepinfer-meta", "src")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compare", default=None, help="another deepinfer-meta/src folder to time alongside")
    args = parser.parse_args()
    sources = [("this tree", here)] + ([("compare", args.compare)] if args.compare else [])
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in sources}
    for r in range(args.rounds):
        for name, src in (sources if r % 2 == 0 else sources[::-1]):
            t = run_once(src, args.threads)
            results[name].append(t)
            print(f"round {r + 1}  {name:10s} " + "  ".join(f"{k} {v:6.2f}s" for k, v in t.items())
                  + f"   load avg {os.getloadavg()[0]:.2f}", flush=True)
    print(f"\nmedians (threads={args.threads}):")
    for name, runs in results.items():
        print(f"  {name:10s} " + "  ".join(f"{k} {statistics.median(r[k] for r in runs):6.2f}s" for k in runs[0]))


if __name__ == "__main__":
    main()
