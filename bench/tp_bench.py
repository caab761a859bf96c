"""Tensor parallelism: output tok/s of TP=N against TP=1 on one model shape, and the all-reduce
share of a decode step, in one run.

    python bench/tp_bench.py --shape llama3-8b --tp 1,2 --batch 1 --input-len 128 --output-len 128
    python bench/tp_bench.py --shape llama3-8b --tp 1,2 --batch 256 --input-len 128 --output-len 256
    python bench/tp_bench.py --shape llama3-8b --allreduce 2 --batch 1

Random bf16 weights of the named shape (tests/runtime/gpu_shapes.py, ``dummy_weights``), greedy,
EOS ignored. Each TP size runs in its own process (one tensor-parallel LLM per process, and the
GPUs' memory starts empty for each): one warm-up call, then ``--runs`` timed calls; the last
line gives each size's median output tok/s and its ratio to the first size.

``--allreduce N``: the collectives of one decode step alone — 2 all-reduces per layer of a
[batch, hidden] bf16 tensor plus the all-gather of the [batch, vocab/N] logits, captured in a
CUDA graph over N GPUs (NCCL) and replayed — in microseconds per step. Divided by the TPOT of
the TP=N run at the same batch it is the all-reduce share of a decode step. ``--device cpu``
runs everything over gloo (a smoke test of this script; CPU figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "runtime"))


def child(args: argparse.Namespace) -> None:
    """One TP size: build the LLM, warm up, time --runs generate calls; print one JSON line."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.runtime.bench_metrics import measure_generate
    from gpu_shapes import write_shape_dir

    shape_dir = write_shape_dir(tempfile.mkdtemp(prefix="tp-bench-"), args.shape)
    max_len = args.input_len + args.output_len + 16
    t0 = time.perf_counter()
    extra = {"gpu_memory_utilization": 0.85} if args.device.startswith("cuda") else {"cpu_kv_cache_bytes": 1 << 28}
    llm = LLM(shape_dir, device=args.device, dtype=args.dtype, dummy_weights=True, max_num_seqs=max(args.batch, 1),
              max_model_len=max_len, max_num_batched_tokens=max(8192, max_len), enforce_eager=args.eager,
              tensor_parallel_size=args.child, **extra)
    print(f"  {llm!r} ready in {time.perf_counter() - t0:.1f} s", flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    vocab = llm.model_config.vocab_size

    def batch(call: int) -> list[dict[str, list[int]]]:  # new ids each call: none from the prefix cache
        return [{"prompt_token_ids": [(7 * i + 13 * j + 7919 * call) % (vocab - 3) + 3 for j in range(args.input_len)]}
                for i in range(args.batch)]

    llm.generate(batch(0), params, use_tqdm=False)
    rates, tpots = [], []
    for i in range(args.runs):
        rep = measure_generate(llm, batch(i + 1), params)
        rates.append(rep.output_tok_s)
        tpots.append(statistics.median(rep.tpot_ms) if rep.tpot_ms else float("nan"))
        print(f"  TP={args.child} run {i + 1}: " + "\n    ".join(rep.lines()), flush=True)
    llm.close()
    print("RESULT " + json.dumps({"tp": args.child, "tok_s": rates, "tpot_ms": tpots}), flush=True)


def _collectives_rank(rank: int, world: int, port: int, args: argparse.Namespace, out: object) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from gpu_shapes import SHAPES

    shape = SHAPES[args.shape]
    cuda = args.device.startswith("cuda")
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    dtype = torch.bfloat16 if cuda else torch.float32
    hidden = torch.randn(args.batch, shape["hidden_size"], dtype=dtype, device=dev)
    logits = torch.randn(args.batch, shape["vocab_size"] // world, dtype=dtype, device=dev)
    gathered = torch.empty(world * args.batch, logits.shape[1], dtype=dtype, device=dev)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def step() -> None:
        for _ in range(2 * shape["num_hidden_layers"]):
            dist.all_reduce(hidden)
        gather(gathered, logits)

    for _ in range(3):
        step()
    reps = 50
    if cuda:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream), torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1e3 / reps
    else:
        t0 = time.perf_counter()
        for _ in range(reps):
            step()
        us = (time.perf_counter() - t0) * 1e6 / reps
    if rank == 0:
        out.put(us)  # type: ignore[attr-defined]
    dist.destroy_process_group()


def collectives(args: argparse.Namespace) -> float:
    """Microseconds of one decode step's collectives over ``args.allreduce`` ranks."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_collectives_rank, args=(r, args.allreduce, port, args, out))
             for r in range(args.allreduce)]
    for p in procs:
        p.start()
    us = float(out.get(timeout=300))
    for p in procs:
        p.join(60)
    return us


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--tp", default="1,2", help="tensor-parallel sizes to compare, the first is the reference")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--allreduce", type=int, default=0, metavar="N", help="time one decode step's collectives on N ranks")
    p.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    if args.child:
        child(args)
        return
    if args.allreduce:
        us = collectives(args)
        print(f"collectives of one decode step ({args.shape}, batch {args.batch}, {args.allreduce} ranks, "
              f"{args.device}): {us:.1f} us", flush=True)
        return
    medians: dict[int, float] = {}
    tpots: dict[int, float] = {}
    for size in [int(x) for x in args.tp.split(",")]:
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", str(size)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        sys.stdout.write(proc.stdout)
        if proc.returncode != 0:
            sys.stdout.write(proc.stderr[-4000:])
            raise SystemExit(f"TP={size} failed (exit {proc.returncode})")
        result = json.loads(next(line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")))
        medians[size] = statistics.median(result["tok_s"])
        tpots[size] = statistics.median(result["tpot_ms"])
    ref = next(iter(medians))
    print(" | ".join(f"TP={n}: {v:.1f} output tok/s, TPOT {tpots[n]:.2f} ms ({v / medians[ref]:.2f}x TP={ref})"
                     for n, v in medians.items()), flush=True)


if __name__ == "__main__":
    main()
