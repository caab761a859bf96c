"""``deepinfer serve`` vs in-process ``LLM.generate`` on the same requests (CPU or GPU).

    python bench/serve_bench.py [--clients 16 64] [--input-len 32] [--output-len 32] [--repeats 2]

The server runs as its own process (``python -m deepinfer serve``, the same engine settings);
N concurrent streaming ``AsyncOpenAI`` clients each send one completion request (prompt as
token ids, greedy, EOS ignored, exactly ``--output-len`` tokens). The same N requests then go
through ``LLM.generate`` in this process (one call, continuous batching). Output tokens/s of both
and their ratio; time to first token and inter-token latency (p50/p99) as the clients see them.

With ``--data-parallel-size N`` (N > 1) the contenders are instead a server of N replicas and a
one-replica server (``deepinfer serve --data-parallel-size N`` vs plain ``deepinfer serve``) on
the same requests; they run one after the other (each holds its GPUs' memory), every client
count and repeat on each, and the ratio printed is N replicas / one replica:

    python bench/serve_bench.py --device cuda --data-parallel-size 2 --clients 64 256 --output-len 128

Fairness on a shared, noisy machine: each repeat measures both contenders back to back on fresh
prompts (no prefix-cache hits for either), in an order that alternates from repeat to repeat;
the ratio printed is the median of the per-repeat ratios; the load average is printed beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import threading
import time

import numpy as np


def start_server(args: argparse.Namespace, max_num_seqs: int, replicas: int = 1) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "deepinfer", "serve", "--port", "0", "--served-model-name", "bench",
           "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(args.max_model_len),
           "--log-level", "info", "--data-parallel-size", str(replicas)]
    if args.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.model:
        cmd += ["--model", args.model]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.device:
        cmd += ["--device", args.device]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        line = proc.stderr.readline()  # type: ignore[union-attr]
        if not line:
            raise SystemExit(f"the server exited ({proc.wait()})")
        m = re.search(r"listening on (http://\S+)", line)
        if m:  # keep draining stderr (the access log), or the server blocks on a full pipe
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
            return proc, m.group(1)
    raise SystemExit("the server did not start")


async def run_clients(url: str, prompts: list[list[int]], output_len: int) -> dict[str, object]:
    import openai

    ttft: list[float] = []
    itl: list[float] = []
    tokens = 0

    async def one(client: openai.AsyncOpenAI, prompt: list[int]) -> None:
        nonlocal tokens
        t0 = time.perf_counter()
        last = None
        stream = await client.completions.create(model="bench", prompt=prompt, max_tokens=output_len,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True},
                                                 stream_options={"include_usage": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                tokens += chunk.usage.completion_tokens
            if not chunk.choices or not chunk.choices[0].text:
                continue
            if last is None:
                ttft.append(now - t0)
            else:
                itl.append(now - last)
            last = now

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=3600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, p) for p in prompts))
        dt = time.perf_counter() - t0
    return {"tok_s": tokens / dt, "ttft": ttft, "itl": itl, "tokens": tokens}


def run_generate(llm: object, prompts: list[list[int]], output_len: int) -> dict[str, object]:
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)  # type: ignore[attr-defined]
    dt = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tok_s": tokens / dt, "tokens": tokens}


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded SmolLM2)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--clients", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads, both sides (with replicas: per replica)")
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="N > 1: compare a server of N replicas with a one-replica server")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None, help="passed to the servers")
    args = parser.parse_args()
    if args.data_parallel_size > 1:
        compare_replicas(args)
        return
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from deepinfer import LLM

    max_seqs = max(args.clients)
    proc, url = start_server(args, max_seqs)
    try:
        llm = LLM(args.model, device=args.device, max_model_len=args.max_model_len, max_num_seqs=max_seqs)
        vocab = llm.model_config.vocab_size
        rng = np.random.default_rng(0)

        def fresh(n: int) -> list[list[int]]:
            return [rng.integers(100, vocab - 100, args.input_len).tolist() for _ in range(n)]

        run_generate(llm, fresh(2), 4)  # warm-up both
        asyncio.run(run_clients(url, fresh(2), 4))
        print(f"deepinfer serve vs LLM.generate: {args.input_len} prompt + {args.output_len} output tokens per "
              f"request, greedy, EOS ignored, device {llm.device}, torch threads "
              f"{args.threads or 'default'}, {os.cpu_count()} cores")
        for n in args.clients:
            ratios, serve_tps, gen_tps, ttft, itl = [], [], [], [], []
            for r in range(args.repeats):
                prompts = fresh(n)
                order = ("generate", "serve") if r % 2 == 0 else ("serve", "generate")
                res = {}
                for who in order:
                    res[who] = (run_generate(llm, prompts, args.output_len) if who == "generate"
                                else asyncio.run(run_clients(url, prompts, args.output_len)))
                assert res["serve"]["tokens"] == res["generate"]["tokens"] == n * args.output_len
                ratios.append(res["serve"]["tok_s"] / res["generate"]["tok_s"])
                serve_tps.append(res["serve"]["tok_s"])
                gen_tps.append(res["generate"]["tok_s"])
                ttft += res["serve"]["ttft"]
                itl += res["serve"]["itl"]
            load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
            print(f"{n:3d} clients: serve {statistics.median(serve_tps):8.1f} tok/s, generate "
                  f"{statistics.median(gen_tps):8.1f} tok/s, ratio {statistics.median(ratios):.3f} "
                  f"(per repeat {', '.join(f'{x:.3f}' for x in ratios)}); TTFT p50 {pct(ttft, 50):.0f} ms "
                  f"p99 {pct(ttft, 99):.0f} ms; ITL p50 {pct(itl, 50):.1f} ms p99 {pct(itl, 99):.1f} ms; "
                  f"load average {load}")
    finally:
        proc.terminate()
        proc.wait(60)


def compare_replicas(args: argparse.Namespace) -> None:
    """A server of N replicas vs a one-replica server on the same requests, one after the other."""
    from deepinfer.runtime.loading.model_loader import read_config, resolve_model_path

    vocab = read_config(resolve_model_path(args.model)).vocab_size
    max_seqs = max(args.clients)
    n_rep = args.data_parallel_size
    results: dict[int, dict[tuple[int, int], dict[str, object]]] = {}
    for replicas in (1, n_rep):
        rng = np.random.default_rng(0)  # the same prompts for both servers
        proc, url = start_server(args, max_seqs, replicas)
        try:
            asyncio.run(run_clients(url, [rng.integers(100, vocab - 100, args.input_len).tolist()
                                          for _ in range(2 * replicas)], 4))  # warm-up every replica
            results[replicas] = {}
            for n in args.clients:
                for r in range(args.repeats):
                    prompts = [rng.integers(100, vocab - 100, args.input_len).tolist() for _ in range(n)]
                    res = asyncio.run(run_clients(url, prompts, args.output_len))
                    assert res["tokens"] == n * args.output_len
                    results[replicas][(n, r)] = res
        finally:
            proc.terminate()
            proc.wait(120)
    print(f"deepinfer serve, {n_rep} replicas vs 1: {args.input_len} prompt + {args.output_len} output tokens per "
          f"request, greedy, EOS ignored, device {args.device or 'default'}, torch threads "
          f"{args.threads or 'default'}, {os.cpu_count()} cores")
    for n in args.clients:
        one = [results[1][(n, r)] for r in range(args.repeats)]
        many = [results[n_rep][(n, r)] for r in range(args.repeats)]
        ratios = [float(m["tok_s"]) / float(o["tok_s"]) for m, o in zip(many, one, strict=True)]  # type: ignore[arg-type]
        ttft = [t for res in many for t in res["ttft"]]  # type: ignore[attr-defined]
        itl = [t for res in many for t in res["itl"]]  # type: ignore[attr-defined]
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"{n:3d} clients: {n_rep} replicas {statistics.median(float(m['tok_s']) for m in many):8.1f} tok/s, "
              f"1 replica {statistics.median(float(o['tok_s']) for o in one):8.1f} tok/s, ratio "
              f"{statistics.median(ratios):.3f} (per repeat {', '.join(f'{x:.3f}' for x in ratios)}); "
              f"{n_rep} replicas: TTFT p50 {pct(ttft, 50):.0f} ms p99 {pct(ttft, 99):.0f} ms; ITL p50 "
              f"{pct(itl, 50):.1f} ms p99 {pct(itl, 99):.1f} ms; load average {load}")


if __name__ == "__main__":
    main()
