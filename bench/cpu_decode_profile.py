"""Where a CPU batch-1 decode step of the default model goes (one process, one thread count).

    python bench/cpu_decode_profile.py [--threads 2] [--dtype float32] [--steps 64] [--native 0|1]

Loads the default model (or ``--model``) as ``LLM`` would on CPU, prefills a 64-token prompt
through ``ModelRunner`` and times ``--steps`` decode steps: the mean step time; on the native
decode path the mean time of each phase of its steps (``DecodeModel.phase_times``: norms and
activation quantization, q/k/v, attention, ...); with ``--profile`` torch.profiler's table of
the ops (self CPU time). ``--native 0`` turns the native decode kernels off
(``DEEPINFER_CPU_NATIVE=0``). Prints the 1-minute load average beside it.
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
    p.add_argument("--native", default=None, choices=["0", "1"])
    p.add_argument("--profile", action="store_true")
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
    bs, n_prompt = 16, 64
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


if __name__ == "__main__":
    main()
