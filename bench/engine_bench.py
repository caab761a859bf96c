"""Engine benchmark of the scheduler: scheduler step, request outputs, admission.

Prints a table of medians over many steps:
  (a) schedule() + update() with one sampled token per sequence, B decoding sequences with
      2048-token contexts, block size 16, no preemption: us/step and ns/seq (target <= 60 ns/seq);
  (b) build_request_outputs in delta mode: ns/output (target <= 400);
  (c) admitting 1024 prompts of 512 random tokens (prefix caching on) and scheduling them to the
      end of their prefill with an 8192-token budget and max_num_seqs 256: ms total (target <= 10).
Wall-clock medians are the figures; per-thread CPU-time medians are printed beside them because
this machine is shared (the load average is printed too): CPU time leaves out the time the
process waited for a core.
Run: python bench/engine_bench.py [--steps N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from deepinfer_engine import _engine as E

CONTEXT = 2048
BLOCK = 16
VOCAB = 32000


def decoding_scheduler(batch: int, rng: np.random.Generator) -> E.Scheduler:
    """B sequences whose 2047-token prompts were prefilled (contexts reach 2048 on the first decode)."""
    blocks = batch * ((CONTEXT + 1024) // BLOCK + 1)
    s = E.Scheduler(
        num_blocks=blocks,
        block_size=BLOCK,
        max_num_seqs=batch,
        max_num_batched_tokens=65536,
        max_model_len=CONTEXT + 4096,
        vocab_size=VOCAB,
        eos_token_id=None,
        watermark=0.0,
    )
    for i in range(batch):
        s.add_request(f"r{i}", rng.integers(0, VOCAB, CONTEXT - 1, dtype=np.int32), E.SamplingParams(max_tokens=4000, ignore_eos=True), output_kind="delta")
    while True:
        out = s.schedule()
        s.update(rng.integers(0, VOCAB, out.num_sample_rows, dtype=np.int32))
        E.build_request_outputs(s, E.RequestOutputPool(0))
        if out.num_decodes == batch:
            return s


def bench_steps(
    batch: int, steps: int, rng: np.random.Generator
) -> tuple[float, float, float, float]:
    """Medians of (step wall, step cpu, build wall, build cpu) in ns."""
    s = decoding_scheduler(batch, rng)
    tokens = rng.integers(0, VOCAB, batch, dtype=np.int32)
    pool = E.RequestOutputPool()
    step_ns, step_cpu, build_ns, build_cpu = [], [], [], []
    clock, cpu = time.perf_counter_ns, time.thread_time_ns
    for _ in range(steps):
        c0, t0 = cpu(), clock()
        out = s.schedule()
        s.update(tokens)
        t1, c1 = clock(), cpu()
        outs = E.build_request_outputs(s, pool)
        t2, c2 = clock(), cpu()
        assert out.num_decodes == batch and len(outs) == batch and not out.preempted_seq_ids.size
        del outs
        step_ns.append(t1 - t0)
        step_cpu.append(c1 - c0)
        build_ns.append(t2 - t1)
        build_cpu.append(c2 - c1)
    med = statistics.median
    return med(step_ns), med(step_cpu), med(build_ns), med(build_cpu)


def bench_admission(rng: np.random.Generator) -> tuple[float, float]:
    prompts = [rng.integers(0, VOCAB, 512, dtype=np.int32) for _ in range(1024)]
    params = E.SamplingParams(max_tokens=1)  # one object for every request, as LLM.generate passes it
    tokens = np.zeros(256, dtype=np.int32)
    s = E.Scheduler(
        num_blocks=40000,
        block_size=BLOCK,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=2048,
        vocab_size=VOCAB,
        eos_token_id=None,
        enable_prefix_caching=True,
    )
    c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
    for i, p in enumerate(prompts):
        s.add_request(f"p{i}", p, params)
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update(tokens[: out.num_sample_rows])
    t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
    return (t1 - t0) / 1e6, (c1 - c0) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400, help="measured steps per batch size")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(
        "engine scheduler — schedule()+update(), build_request_outputs (delta); medians over "
        f"{args.steps} steps; contexts {CONTEXT}, block size {BLOCK}; load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print(
        f"{'B':>6} {'step us':>9} {'ns/seq':>8} {'cpu ns/seq':>11} {'<=60':>5} "
        f"{'out ns/out':>11} {'cpu ns/out':>11} {'<=400':>6}"
    )
    for batch in (64, 256, 1024):
        step, step_cpu, build, build_cpu = bench_steps(batch, args.steps, rng)
        print(
            f"{batch:>6} {step / 1e3:>9.2f} {step / batch:>8.1f} {step_cpu / batch:>11.1f} "
            f"{'ok' if step / batch <= 60 else 'SLOW':>5} {build / batch:>11.1f} {build_cpu / batch:>11.1f} "
            f"{'ok' if build / batch <= 400 else 'SLOW':>6}"
        )
    runs = [bench_admission(rng) for _ in range(5)]
    ms = statistics.median(r[0] for r in runs)
    cpu_ms = statistics.median(r[1] for r in runs)
    print(
        f"admission: 1024 prompts x 512 tokens to end of prefill (budget 8192, max_num_seqs 256): "
        f"{ms:.2f} ms wall, {cpu_ms:.2f} ms cpu (medians of 5; target <= 10) {'ok' if ms <= 10 else 'SLOW'}"
    )


if __name__ == "__main__":
    main()
