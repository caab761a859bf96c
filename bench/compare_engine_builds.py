"""Every figure of engine_bench.py and engine_inputs_bench.py for two or more engine builds,
interleaved in one run: per figure the median of each build, the ratio of the medians and the
median of the per-round ratios (a round runs every build once, in alternating order).

Each build is a folder with an importable deepinfer_engine (what scripts/devbuild.sh lays out in
<build>/pkg). Every round runs each build from a fresh copy of its folder, at paths of equal
length: byte-identical copies of one build differ by up to 13 % on some figures (which physical
pages the page cache gave the file), so a build kept in one place for the whole run can look
faster or slower than it is. The benchmarks' own figures are medians over many steps; this takes
the median over rounds on top, so use many rounds on a busy machine (the load average is printed).

Run: python bench/compare_engine_builds.py --rounds 20 before=/path/a/pkg after=build/dev/deepinfer-engine/pkg
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))

# Runs in a child process whose PYTHONPATH holds one build; prints the figures as JSON.
CHILD = r"""
import json, statistics, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import engine_bench as eb, engine_inputs_bench as ib
res = {}
rng = np.random.default_rng(0)
for B in (64, 256, 1024):
    step, step_cpu, build, build_cpu = eb.bench_steps(B, 400, rng)
    res[f"engine B={B} step ns/seq"] = step / B
    res[f"engine B={B} step cpu ns/seq"] = step_cpu / B
    res[f"engine B={B} outputs ns/out"] = build / B
    res[f"engine B={B} outputs cpu ns/out"] = build_cpu / B
runs = [eb.bench_admission(rng) for _ in range(5)]
res["engine admission ms"] = statistics.median(r[0] for r in runs)
res["engine admission cpu ms"] = statistics.median(r[1] for r in runs)
rng = np.random.default_rng(0)
for B in (64, 256, 1024):
    for label, kw in (("incremental", {}), ("full", {"penalty_counts": "full"}), ("no-pen", {"penalties": False})):
        r = ib.bench_batch(B, 60, rng, **kw)
        p = f"inputs B={B} {label}"
        res[f"{p} unchanged ns/seq"] = r["unchanged_inputs"] / B
        res[f"{p} steady ns/seq"] = r["steady_inputs"] / B
        res[f"{p} ZOS ns/seq"] = r["zos_inputs"] / B
        res[f"{p} build ns/seq"] = r["steady_build"] / B
        res[f"{p} whole step ns/seq"] = r["whole_step"] / B
        res[f"{p} sched+upd ns/seq"] = r["schedule_update"] / B
res["inputs prefill ns/token"] = ib.bench_prefill(rng, 15) / 8192
print("FIGURES" + json.dumps(res))
"""


def run_build(pkg: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=pkg)
    done = subprocess.run([sys.executable, "-c", CHILD, BENCH_DIR], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"benchmark failed with {pkg}:\n{done.stderr}")
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("FIGURES"))
    return json.loads(line[len("FIGURES"):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("builds", nargs="+", help="NAME=FOLDER (a folder holding deepinfer_engine); the first is the baseline")
    ap.add_argument("--rounds", type=int, default=10, help="rounds (each runs every build once)")
    ap.add_argument("--filter", default="", help="print only figures whose name contains this")
    ap.add_argument("--limit", type=float, default=1.05, help="mark figures whose ratio exceeds this")
    args = ap.parse_args()
    builds = [b.split("=", 1) for b in args.builds]
    if len(builds) < 2 or any(len(b) != 2 or not os.path.isdir(b[1]) for b in builds):
        ap.error("give at least two NAME=FOLDER builds (existing folders)")
    names = [n for n, _ in builds]
    data: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="engine-builds-") as tmp:
        for r in range(args.rounds):
            order = list(enumerate(builds)) if r % 2 == 0 else list(enumerate(builds))[::-1]
            for i, (name, folder) in order:
                copy = os.path.join(tmp, f"r{r:04d}", f"b{i:02d}")  # a new folder: new pages
                shutil.copytree(folder, copy, symlinks=False)
                data[name].append(run_build(copy))
            loads.append(os.getloadavg()[0])
            print(f"round {r + 1}/{args.rounds}: load average {loads[-1]:.2f}", file=sys.stderr, flush=True)
    base = names[0]
    print(f"{args.rounds} rounds, {os.cpu_count()} cores, load average {min(loads):.2f}-{max(loads):.2f}; "
          f"ratio = median / {base}'s median, paired = median of the per-round ratios")
    header = f"{'figure':<40}" + "".join(f"{n:>11}" for n in names)
    header += "".join(f"{n + ' ratio':>14}{'paired':>8}" for n in names[1:])
    print(header)
    for key in data[base][0]:
        if args.filter not in key:
            continue
        medians = [statistics.median(d[key] for d in data[n]) for n in names]
        line = f"{key:<40}" + "".join(f"{m:>11.2f}" for m in medians)
        worst = 0.0
        for n, m in zip(names[1:], medians[1:]):
            ratio = m / medians[0]
            paired = statistics.median(x[key] / y[key] for x, y in zip(data[n], data[base]))
            worst = max(worst, ratio, paired)
            line += f"{ratio:>14.3f}{paired:>8.3f}"
        print(line + (f"  > {args.limit}" if worst > args.limit else ""))


if __name__ == "__main__":
    main()
