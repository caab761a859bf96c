"""Time native CPU decode steps alone (``DecodeModel.decode``, no scheduler, sampler or Python
runtime around it) and where they go.

    python bench/cpu_native_step.py [--threads 2] [--rows 1] [--dtype float32] [--steps 100]

Loads the default model (or ``--model``) as ``LLM`` would on CPU, registers it with the native
decode kernels over a random KV cache of ``--rows`` sequences, and times ``--steps`` decode steps
at contexts of 64-127 tokens: median, 10th percentile and minimum step time, then the phase
timer's mean per phase (``DecodeModel.phase_times``). Prints the 1-minute load average; to
compare two engine builds, alternate processes with each build on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--dtype", default=None, choices=[None, "float32"])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--compare-backoff", type=int, default=0, metavar="ROUNDS",
                   help="instead: ROUNDS rounds of --steps steps each with the contention back-off on, off, "
                        "and on one thread, interleaved in this process (median step time per round)")
    args = p.parse_args()
    import torch
    from deepinfer.runtime.loading.model_loader import load_model, resolve_model_path
    from deepinfer.runtime.worker.native_decode import build_native_decode

    torch.set_num_threads(args.threads)
    loaded = load_model(resolve_model_path(args.model), device=torch.device("cpu"), dtype=torch.float32,
                        keep_quantized=args.dtype is None, max_positions=1024)
    cfg = loaded.model.config
    bs, width, rows = 16, 8, args.rows
    rng = np.random.default_rng(0)
    kv = [torch.from_numpy((rng.standard_normal((2, rows * width, bs, cfg.num_key_value_heads, cfg.head_dim))
                            * 0.5).astype(np.float32)) for _ in range(cfg.num_hidden_layers)]
    nd = build_native_decode(loaded.model, loaded.gguf, kv, args.threads)
    if nd is None:
        raise SystemExit("the native decode path is off or not built (DEEPINFER_CPU_NATIVE, _cpu_kernels)")
    tables = rng.permutation(rows * width).reshape(rows, width).astype(np.int64)
    ids = rng.integers(100, 1000, rows).astype(np.int64)

    def step(pos: int) -> None:
        p = np.full(rows, pos, np.int64)
        nd.native.decode(ids, p, tables[:, pos // bs] * bs + pos % bs, p + 1, tables)

    for pos in range(64, 72):  # warm-up
        step(pos)
    if args.compare_backoff:
        compare_backoff(args, step, nd, build_native_decode(loaded.model, loaded.gguf, kv, 1))
        return
    times = []
    for i in range(args.steps):
        t = time.perf_counter()
        step(64 + i % 64)
        times.append(time.perf_counter() - t)
    ms = np.array(times) * 1e3
    print(f"{nd.kind} isa={nd.native.isa} threads={args.threads} rows={rows}: median {np.median(ms):.2f} ms "
          f"p10 {np.percentile(ms, 10):.2f} min {ms.min():.2f} ({rows * 1e3 / np.median(ms):.0f} tok/s) "
          f"solo_steps={getattr(nd.native, 'solo_steps', '?')} load_avg={os.getloadavg()[0]:.2f}")
    nd.native.profiling = True
    for i in range(args.steps):
        step(64 + i % 64)
    phases = nd.native.phase_times()
    nd.native.profiling = False
    print("phases (ms/step): " + "  ".join(f"{k}={v * 1e3:.2f}" for k, v in phases.items()))


def compare_backoff(args: argparse.Namespace, step: Any, nd: Any, single: Any) -> None:
    """Rounds of steps with the back-off on, off and on one thread, interleaved (the machine's
    drift hits all three alike); median step time of each round, and the ratios."""
    pooled = nd.native

    def run(model: Any) -> float:
        nd.native = model
        times = []
        for i in range(args.steps):
            t = time.perf_counter()
            step(64 + i % 64)
            times.append(time.perf_counter() - t)
        return float(np.median(times)) * 1e3

    rows: dict[str, list[float]] = {"back-off on": [], "back-off off": [], "one thread": []}
    solo = []
    for _ in range(args.compare_backoff):
        pooled.contention_backoff = True
        before = pooled.solo_steps
        rows["back-off on"].append(run(pooled))
        solo.append(pooled.solo_steps - before)
        pooled.contention_backoff = False
        rows["back-off off"].append(run(pooled))
        rows["one thread"].append(run(single.native))
    pooled.contention_backoff = True
    for name, ms in rows.items():
        print(f"{name:13s} median step ms per round: " + ", ".join(f"{m:.2f}" for m in ms))
    print("steps run alone per round (back-off on): " + ", ".join(map(str, solo)))
    on, off = np.array(rows["back-off on"]), np.array(rows["back-off off"])
    print("off / on time ratio per round: " + ", ".join(f"{r:.2f}" for r in off / on)
          + f"; load_avg={os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
