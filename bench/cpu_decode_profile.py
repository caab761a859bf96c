"""Where a CPU batch-1 decode step of the default model goes (one process, one thread count).

    python bench/cpu_decode_profile.py [--threads 2] [--dtype float32] [--steps 64] [--native 0|1]
    python bench/cpu_decode_profile.py --verify-rows 1,2,3,5,8   # speculative verify steps
    python bench/cpu_decode_profile.py --prompt-len 400          # steps at a longer context

Loads the default model (or ``--model``) as ``LLM`` would on CPU, prefills a 64-token prompt (``--prompt-len``)
through ``ModelRunner`` and times ``--steps`` decode steps: the mean step time; on the native
decode path the mean time of each phase of its steps (``DecodeModel.phase_times``: norms and
activation quantization, q/k/v, attention, ...); with ``--profile`` torch.profiler's table of
the ops (self CPU time). ``--native 0`` turns the native decode kernels off
(``DEEPINFER_CPU_NATIVE=0``). Prints the 1-minute load average beside it.

``--verify-rows`` times speculative verify steps instead: a step of R query tokens of one
sequence (the last token + R - 1 drafts, logits of every row) on the native path as the engine
runs it with ``speculative_config``, for each R, against the one-token decode step (R = 1).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default=None, choices=[None, "float32"])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64, help="context before the timed steps (< 900)")
    p.add_argument("--native", default=None, choices=["0", "1"])
    p.add_argument("--profile", action="store_true")
    p.add_argument("--verify-rows", default=None, help="comma-separated query rows per verify step")
    args = p.parse_args()
    if args.native is not None:
        os.environ["DEEPINFER_CPU_NATIVE"] = args.native
    import torch
    from deepinfer.runtime.loading.model_loader import load_model, resolve_model_path
    from deepinfer.runtime.worker.model_runner import ModelRunner

    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    cpu = torch.device("cpu")
    loaded = load_model(path, device=cpu, dtype=torch.float32, keep_quantized=args.dtype is None,
                        max_positions=1024)
    runner = ModelRunner(loaded, num_blocks=64, block_size=16, device=cpu, dtype=torch.float32)
    bs, n_prompt = 16, args.prompt_len
    table = np.arange(64, dtype=np.int32)[None, :]
    rng = np.random.default_rng(0)
    ids = list(rng.integers(100, 1000, n_prompt))

    def step(start: int) -> int:
        new = ids[start:]
        pos = np.arange(start, len(ids))
        logits = runner.execute(input_ids=np.array(new), positions=pos, slot_mapping=table[0][pos // bs] * bs + pos % bs,
                                query_start_loc=np.array([0, len(new)]), seq_lens=np.array([len(ids)]),
                                block_tables=table, logits_indices=np.array([len(new) - 1]))
        return int(logits[0].argmax())

    if args.verify_rows:
        runner.native_verify_tokens = max(int(r) for r in args.verify_rows.split(","))
        verify(runner, ids, table, bs, [int(r) for r in args.verify_rows.split(",")], args.steps)
        return
    ids.append(step(0))
    for _ in range(8):  # warm-up
        ids.append(step(len(ids) - 1))
    t0 = time.perf_counter()
    for _ in range(args.steps):
        ids.append(step(len(ids) - 1))
    dt = (time.perf_counter() - t0) / args.steps
    native = getattr(runner, "native_decode", None) is not None
    print(f"threads={args.threads} dtype={args.dtype or 'default'} native={native} "
          f"step={dt * 1e3:.2f} ms ({1 / dt:.1f} tok/s) load_avg={os.getloadavg()[0]:.2f}")
    if runner.native_decode is not None:  # where the native step goes: its phase timer
        nd = runner.native_decode.native
        nd.profiling = True
        for _ in range(args.steps):
            ids.append(step(len(ids) - 1))
        phases = nd.phase_times()
        nd.profiling = False
        print("native phases (ms/step): " + "  ".join(f"{k}={v * 1e3:.2f}" for k, v in phases.items()))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(16):
                ids.append(step(len(ids) - 1))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def verify(runner, ids: list[int], table: np.ndarray, bs: int, counts: list[int], steps: int) -> None:  # type: ignore[no-untyped-def]
    """Verify steps of R rows at the same context (the KV past it rewritten each time), the Rs
    interleaved in rounds of 4 steps (a shared machine's load hits all alike): the median and the
    fastest round's step time of each R, and its ratio to the first R's."""
    n = len(ids)
    pos = np.arange(n)
    runner.execute(input_ids=np.array(ids), positions=pos, slot_mapping=table[0][pos // bs] * bs + pos % bs,
                   query_start_loc=np.array([0, n]), seq_lens=np.array([n]), block_tables=table,
                   logits_indices=np.array([n - 1]))
    kws = {}
    for r in counts:
        p = np.arange(n - 1, n - 1 + r)
        kws[r] = dict(input_ids=np.array(ids[-1:] + ids[:r - 1]), positions=p,
                      slot_mapping=table[0][p // bs] * bs + p % bs, query_start_loc=np.array([0, r]),
                      seq_lens=np.array([n - 1 + r]), block_tables=table, logits_indices=np.arange(r))
        for _ in range(2):
            runner.execute(**kws[r])
    times: dict[int, list[float]] = {r: [] for r in counts}
    cpu: dict[int, list[float]] = {r: [] for r in counts}
    for _ in range(max(1, steps // 4)):
        for r in counts:
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(4):
                runner.execute(**kws[r])
            times[r].append((time.perf_counter() - t0) / 4)
            cpu[r].append((time.process_time() - c0) / 4)
    med = {r: float(np.median(t)) for r, t in times.items()}
    best = {r: min(t) for r, t in times.items()}
    cmed = {r: float(np.median(t)) for r, t in cpu.items()}
    first = counts[0]
    # CPU time (all threads of the process) is what a loaded machine disturbs least: with one
    # thread it is the kernels' own cost (with more, the pool's waits count too)
    for r in counts:
        print(f"rows={r} step median={med[r] * 1e3:.2f} ms ({med[r] / med[first]:.2f}x rows={first}), "
              f"fastest={best[r] * 1e3:.2f} ms ({best[r] / best[first]:.2f}x), CPU time median "
              f"{cmed[r] * 1e3:.2f} ms ({cmed[r] / cmed[first]:.2f}x) load_avg={os.getloadavg()[0]:.2f}", flush=True)
    nd = runner.native_decode.native if runner.native_decode is not None else None
    if nd is not None:  # where each R's step goes
        for r in counts:
            nd.profiling = True
            for _ in range(steps):
                runner.execute(**kws[r])
            phases = nd.phase_times()
            nd.profiling = False
            print(f"rows={r} native phases (ms/step): " + "  ".join(f"{k}={v * 1e3:.2f}" for k, v in phases.items()))

if __name__ == "__main__":
    main()
