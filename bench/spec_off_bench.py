""""No slowdown when speculation is off": DeepInfer on the CPU from two source trees, in pairs.

    python bench/spec_off_bench.py --before /tmp/before --before-engine /tmp/before/build/dev/deepinfer-engine/pkg \
        [--after .] [--after-engine build/dev/deepinfer-engine/pkg] [--pairs 48] [--processes 6] [--threads 2]

One long-lived child process per tree, each with its tree's ``deepinfer-meta/src`` and its own
engine build on ``PYTHONPATH``, each loading bench/cpu_vs_llamacpp.py's DeepInfer contender once
(``dq``: the default model with its quantization kept, no ``speculative_config``). The parent
then asks them in turn for one measurement at a time: batch-1 decode of a 64-token prompt + 128
new tokens (new tokens / wall time) and 16 concurrent requests of 64 + 64 (total new tokens /
wall time), greedy, EOS ignored, no prefix caching. A pair is the two trees measured back to
back (the order alternates), so load that drifts over seconds on a shared machine falls on both
sides of a pair; rounds of separate processes a minute apart moved 0.76-1.52x here. A process
also keeps its own speed for its whole life (memory placement, we think: one comparison gave a
median of 0.997 over 40 pairs in one run and 0.955 (95 % interval 0.938-0.983) over 100 in
the next), so ``--processes P`` starts P fresh pairs of children, in alternating start order, and
shares the pairs between them. Prints the median after / before
ratio of the pairs with a distribution-free 95 % interval (the issue asks for within 3 %), each
process pair's median and their interval, and tokens per second of the child's CPU time beside
wall time.

Use it for main against the parent of the commit that added ``runtime/speculative``
(``git log --oneline -- deepinfer-meta/src/deepinfer/runtime/speculative | tail -1``), checked out
with ``git worktree add`` and built with ``scripts/devbuild.sh`` when its C++ differs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT_LEN, NEW_TOKENS, CONC, CONC_NEW = 64, 128, 16, 64
WORKLOADS = ("decode1", "concurrent16")


def child(threads: int) -> None:
    """Load this process's deepinfer (whatever PYTHONPATH gives), then answer one JSON line per
    workload name read from stdin: new tokens per wall second and per second of this process's
    CPU time (all threads, user + system)."""
    import torch  # first, as on the GPU machines (before any deepinfer native module)

    torch.set_num_threads(threads)
    import numpy as np
    from deepinfer import LLM, SamplingParams

    llm = LLM(device="cpu", max_model_len=1024, enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    prompts = {"decode1": [rng.integers(100, 1000, PROMPT_LEN).tolist()],
               "concurrent16": rng.integers(100, 1000, (CONC, PROMPT_LEN)).tolist()}
    new = {"decode1": NEW_TOKENS, "concurrent16": CONC_NEW}
    print("READY", flush=True)
    for line in sys.stdin:
        name = line.strip()
        params = SamplingParams(temperature=0.0, max_tokens=new[name], ignore_eos=True)
        reqs = [{"prompt_token_ids": p} for p in prompts[name]]
        t, c = time.perf_counter(), time.process_time()
        llm.generate(reqs, params, use_tqdm=False)
        tokens = len(reqs) * new[name]
        print("RESULT " + json.dumps({"wall": tokens / (time.perf_counter() - t),
                                      "cpu": tokens / (time.process_time() - c)}), flush=True)


class Tree:
    """A child process serving measurements of one source tree."""

    def __init__(self, name: str, tree: str, engine: str, threads: int) -> None:
        self.name = name
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=os.pathsep.join(
            [os.path.abspath(engine), os.path.join(os.path.abspath(tree), "deepinfer-meta", "src")]))
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", "--threads", str(threads)],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):]
        raise SystemExit(f"{self.name}: the child ended (exit {self.proc.wait()}) before {prefix.strip()}")

    def measure(self, workload: str) -> dict[str, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(workload + "\n")
        self.proc.stdin.flush()
        return dict(json.loads(self._expect("RESULT ")))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", help="the source tree before speculative decoding (required)")
    p.add_argument("--before-engine", help="its engine build's pkg folder, scripts/devbuild.sh (required)")
    p.add_argument("--after", default=os.path.dirname(HERE))
    p.add_argument("--after-engine", default=None, help="default: AFTER/build/dev/deepinfer-engine/pkg")
    p.add_argument("--pairs", type=int, default=40)
    p.add_argument("--processes", type=int, default=1,
                   help="start fresh child processes this many times, the pairs shared between them (a process's "
                        "memory placement can move its speed by a few percent for its whole life)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured measurements of each workload per tree")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="of " + ", ".join(WORKLOADS))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.threads)
        return
    if not args.before or not args.before_engine:
        p.error("--before and --before-engine are required")
    workloads = [w for w in args.workloads.split(",") if w]
    if not workloads or set(workloads) - set(WORKLOADS):
        p.error(f"--workloads must name some of {', '.join(WORKLOADS)}, got {args.workloads!r}")
    after_engine = args.after_engine or os.path.join(args.after, "build", "dev", "deepinfer-engine", "pkg")
    print(f"== DeepInfer CPU, default model, {args.threads} threads; after = {args.after}, before = {args.before}; "
          f"{args.pairs} pairs a workload over {args.processes} process pairs, load average {os.getloadavg()[0]:.1f}", flush=True)
    got: dict[str, dict[str, list[dict[str, float]]]] = {w: {"after": [], "before": []} for w in workloads}
    per_process: dict[str, list[float]] = {w: [] for w in workloads}  # each process pair's median wall ratio
    pairs = max(1, args.pairs // args.processes)
    for proc in range(args.processes):
        # fresh processes: their memory placement (and so cache behaviour) is drawn anew, once per
        # process; the start order alternates too
        specs = [("after", args.after, after_engine), ("before", args.before, args.before_engine)]
        trees = [Tree(name, tree, engine, args.threads) for name, tree, engine in
                 (specs if proc % 2 == 0 else specs[::-1])]
        trees.sort(key=lambda t: t.name)  # "after" first in the pairs' alternation
        try:
            for tree in trees:
                for w in workloads:
                    for _ in range(args.warmup):
                        tree.measure(w)
            mine: dict[str, list[float]] = {w: [] for w in workloads}
            for i in range(pairs):
                for w in workloads:
                    m = {tree.name: tree.measure(w) for tree in (trees if i % 2 == 0 else trees[::-1])}
                    for name in m:
                        got[w][name].append(m[name])
                    mine[w].append(m["after"]["wall"] / m["before"]["wall"])
        finally:
            for tree in trees:
                tree.close()
        for w in workloads:
            per_process[w].append(statistics.median(mine[w]))
        print(f"  processes {proc + 1}: {pairs} pairs, median after / before (wall) "
              + ", ".join(f"{w} {per_process[w][-1]:.3f}" for w in workloads)
              + f"; load average {os.getloadavg()[0]:.1f}", flush=True)
    for w in workloads:
        for clock in ("wall", "cpu"):
            a = [x[clock] for x in got[w]["after"]]
            b = [x[clock] for x in got[w]["before"]]
            ratios = [x / y for x, y in zip(a, b, strict=True)]
            lo, hi, level = median_interval(ratios)
            print(f"{w} ({clock} clock): after {statistics.median(a):.1f}, before {statistics.median(b):.1f} tok/s "
                  f"(medians; before's range {min(b):.1f}-{max(b):.1f}); after / before per pair: median "
                  f"{statistics.median(ratios):.3f}, {level:.0%} interval {lo:.3f}-{hi:.3f}, quartiles "
                  f"{statistics.quantiles(ratios, n=4)[0]:.3f}-{statistics.quantiles(ratios, n=4)[2]:.3f}", flush=True)
        if args.processes > 1:
            lo, hi, level = median_interval(per_process[w])
            print(f"{w}: the {args.processes} process pairs' medians (wall) "
                  f"{', '.join(f'{x:.3f}' for x in per_process[w])}: median {statistics.median(per_process[w]):.3f}, "
                  f"{level:.0%} interval {lo:.3f}-{hi:.3f}", flush=True)


def median_interval(xs: list[float]) -> tuple[float, float, float]:
    """A distribution-free interval for the median of ``xs``: the order statistics j and n - j + 1
    with the largest j whose binomial coverage is at least 95 % (the whole range when none is)."""
    s, n = sorted(xs), len(xs)
    best = (s[0], s[-1], 1.0 - 2 * 0.5 ** n)
    for j in range(1, n // 2 + 1):  # coverage of [s[j-1], s[n-j]] is 1 - 2 P(Binomial(n, 1/2) < j)
        cover = 1.0 - 2 * sum(math.comb(n, i) for i in range(j)) / 2 ** n
        if cover < 0.95:
            break
        best = (s[j - 1], s[n - j], cover)
    return best


if __name__ == "__main__":
    main()
