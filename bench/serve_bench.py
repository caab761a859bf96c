"""``deepinfer serve`` vs in-process ``LLM.generate`` on the same requests (CPU or GPU).

    python bench/serve_bench.py [--clients 16 64] [--input-len 32] [--output-len 32] [--repeats 3]
        [--mode stream plain] [--client-procs 8] [--shape smollm2-135m] [--api-server-count 1 2 4]

The server runs as its own processes (``python -m deepinfer serve``: the engine core and its
front ends, the same engine settings). N concurrent clients, spread over ``--client-procs``
processes (an event loop each, uvloop where installed, whose connections' responses an
``asyncio.Protocol`` parses in bulk: light, so the figure is the server's), each
send one completion request (prompt as token ids, greedy, EOS ignored, exactly ``--output-len``
tokens), streamed (``stream``) or not (``plain``). The same N requests also go through
``LLM.generate`` in this process (one call, continuous batching). Per client count and mode:
output tokens/s of both and their ratio (median of the repeats, with each repeat's), time to
first token and inter-token latency (p50/p99) as the clients see them (and the inter-token
latency once every stream has its first token: the steady decode without the arrival burst; and
the tokens a text chunk carried on average: above 1, streams coalesced), and the server's CPU per
output token (user + system time of every server process: supervisor, engine core, front ends),
and the clients' own CPU per output token with the busiest client process's share of the time on
a CPU (near 100 %: the clients set the figure, give more ``--client-procs``). Give
``--client-procs 8 16`` to show the figure does not depend on the clients. Each row first
runs ``--warmup-rounds`` (default 1) unmeasured rounds of both contenders at its client count:
a batch of a size not seen yet pays one-time costs on either side (on the H200 the first
measured repeat of a row often read 0.4-0.8 while the others read 0.9-1.1).

Memory: on a GPU both contenders hold their own KV cache. The server starts first with
``--gpu-memory-utilization`` (default 0.4); the in-process LLM then gets the same KV share on
top of what is in use by then, so both fit (the bench sizes them, nothing to tune).

``--shape NAME`` serves random weights of a shape of tests/runtime/gpu_shapes.py
(``--dummy-weights``) instead of the default model.

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
import collections
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

#: the running server's last lines of stderr (printed when the bench fails)
SERVER_LOG: collections.deque[str] = collections.deque(maxlen=60)


def start_server(args: argparse.Namespace, max_num_seqs: int, replicas: int = 1,
                 gpu_memory_utilization: float | None = None, api_servers: int | None = None
                 ) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "deepinfer", "serve", "--port", "0", "--served-model-name", "bench",
           "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(args.max_model_len),
           "--log-level", "info", "--data-parallel-size", str(replicas)]
    util = gpu_memory_utilization if gpu_memory_utilization is not None else args.gpu_memory_utilization
    if util is not None:
        cmd += ["--gpu-memory-utilization", str(util)]
    if args.model:
        cmd += ["--model", args.model]
    if getattr(args, "shape_dir", None):
        cmd += ["--dummy-weights", "--dtype", "bfloat16"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.device:
        cmd += ["--device", args.device]
    cmd += ["--api-server-count", str(api_servers or args.api_server_count[0]),
            "--stream-interval", str(args.stream_interval)]
    cmd += getattr(args, "server_args", "").split()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    deadline = time.monotonic() + 900
    seen = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()  # type: ignore[union-attr]
        if not line:
            raise SystemExit(f"the server exited ({proc.wait()}):\n" + "".join(seen[-60:]))
        seen.append(line)
        m = re.search(r"listening on (http://\S+)", line)
        if m:  # keep draining stderr, or the server blocks on a full pipe; its last lines say why it failed
            threading.Thread(target=SERVER_LOG.extend, args=(proc.stderr,), daemon=True).start()
            return proc, m.group(1)
    raise SystemExit("the server did not start")


# ---- the clients: processes of asyncio HTTP/1.1 connections, parsed in bulk ----------------------
class ResponseReader(asyncio.Protocol):
    """One request on its own connection, its response read as it comes (``asyncio.Protocol``: no
    coroutine step per line, as ``StreamReader.readline`` takes). A stream's SSE events are found
    by splitting what arrived at its last newline; the events of one read share its timestamp.
    ``done`` gets (completion tokens, time to first token, inter-token gaps, end time, wall time of
    the first token, wall time at each gap's start)."""

    def __init__(self, request: bytes, stream: bool, t0: float, done: asyncio.Future) -> None:
        self.request, self.stream, self.t0, self.done = request, stream, t0, done
        self.buf = bytearray()
        self.head_done = False
        self.length: int | None = None
        self.tokens = 0
        self.ttft: float | None = None
        self.last: float | None = None
        self.itl: list[float] = []
        self.first_at: float | None = None
        self.gap_at: list[float] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if self.done.done():
            return
        now = time.perf_counter()
        self.buf += data
        if not self.head_done:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).split(b"\r\n")
            del self.buf[:end + 4]
            if b" 200 " not in head[0] + b" ":
                self._finish(RuntimeError(f"the server answered {head[0]!r}"))
                return
            for h in head[1:]:
                if h.lower().startswith(b"content-length:"):
                    self.length = int(h.split(b":")[1])
            self.head_done = True
        if not self.stream:
            if self.length is not None and len(self.buf) >= self.length:
                self.tokens = json.loads(bytes(self.buf[:self.length]))["usage"]["completion_tokens"]
                self.ttft = now - self.t0
                self._finish()
            return
        cut = self.buf.rfind(b"\n")
        if cut < 0:
            return
        lines = bytes(self.buf[:cut]).split(b"\n")
        del self.buf[:cut + 1]
        for line in lines:  # SSE events (and the chunked framing's size lines, skipped)
            if not line.startswith(b"data: "):
                continue
            if line.startswith(b"data: [DONE]"):
                self._finish()
                return
            if b'"usage":{' in line:
                self.tokens = json.loads(line[6:])["usage"]["completion_tokens"]
            elif b'"text":"' in line:
                if self.last is None:
                    self.ttft = now - self.t0
                    self.first_at = time.time()
                else:
                    self.itl.append(now - self.last)
                    self.gap_at.append(time.time() - (now - self.last))
                self.last = now

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self._finish(exc or RuntimeError("the server closed the connection before the response ended"))

    def _finish(self, error: BaseException | None = None) -> None:
        if error is not None:
            self.done.set_exception(error)
        else:
            self.done.set_result((self.tokens, self.ttft, self.itl, time.perf_counter(), self.first_at, self.gap_at))
        if self.transport is not None:
            self.transport.close()


async def _one(host: str, port: int, prompt: list[int], output_len: int, stream: bool
               ) -> tuple[int, float | None, list[float], float, float | None, list[float]]:
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": output_len, "temperature": 0,
                       "ignore_eos": True, "stream": stream,
                       **({"stream_options": {"include_usage": True}} if stream else {})}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % (host.encode(), len(body)) + body)
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()
    t0 = time.perf_counter()
    await loop.create_connection(lambda: ResponseReader(request, stream, t0, done), host, port)
    return await done


def _client_ready(ready: object) -> None:
    """Pool initializer: this client process is up (its imports done)."""
    ready.put(os.getpid())  # type: ignore[attr-defined]


def _client_proc(url: str, prompts: list[list[int]], output_len: int, stream: bool, start_at: float
                 ) -> dict[str, object]:
    host, port = url.removeprefix("http://").rsplit(":", 1)

    async def run() -> list[tuple[int, float | None, list[float], float, float | None, list[float]]]:
        return await asyncio.gather(*(_one(host, int(port), p, output_len, stream) for p in prompts))

    try:  # the client's own event loop as light as the server's
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    time.sleep(max(0.0, start_at - time.time()))
    t0, c0 = time.perf_counter(), os.times()
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        res = runner.run(run())
    c1 = os.times()
    return {"start": time.time() - (time.perf_counter() - t0), "end": time.time(),
            "cpu": (c1.user - c0.user) + (c1.system - c0.system), "wall": time.perf_counter() - t0,
            "tokens": sum(r[0] for r in res), "ttft": [r[1] for r in res if r[1] is not None],
            "itl": [x for r in res for x in r[2]], "first_at": [r[4] for r in res if r[4] is not None],
            "itl_at": [x for r in res for x in r[5]]}


def process_tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def cpu_seconds(pids: list[int]) -> float:
    return sum(cpu_by_pid(pids).values())


def cpu_by_pid(pids: list[int]) -> dict[int, float]:
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[p] = (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            pass
    return out


def is_core(pid: int) -> bool:
    """Whether ``pid`` is an engine-core process (its command line names deepinfer.serve.core)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"deepinfer.serve.core" in f.read()
    except OSError:
        return False


def run_clients(url: str, prompts: list[list[int]], output_len: int, stream: bool, procs: int,
                server_pid: int) -> dict[str, object]:
    parts = [prompts[i::procs] for i in range(procs) if prompts[i::procs]]
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    # Every client process is started (interpreter, imports) before the start time is set: a
    # process that came up late would start its requests late, and the time from the first
    # client's start to the last one's end would count its start-up against the server.
    with ctx.Pool(len(parts), initializer=_client_ready, initargs=(ready,)) as pool:
        for _ in parts:
            ready.get(timeout=120)
        tree = process_tree(server_pid)
        steps0 = server_steps(url)
        cpu0 = cpu_by_pid(tree)
        start_at = time.time() + 0.1
        res = pool.starmap(_client_proc, [(url, p, output_len, stream, start_at) for p in parts])
    cpu1 = cpu_by_pid(tree)
    steps = server_steps(url) - steps0
    spent = {p: cpu1[p] - cpu0.get(p, 0.0) for p in cpu1}
    cpu = sum(spent.values())
    core = sum(v for p, v in spent.items() if is_core(p))  # the engine core(s); the rest: front ends, supervisor
    tokens = sum(int(r["tokens"]) for r in res)  # type: ignore[call-overload]
    dt = max(float(r["end"]) for r in res) - min(float(r["start"]) for r in res)  # type: ignore[arg-type]
    return {"tok_s": tokens / dt, "tokens": tokens, "cpu_us_per_token": cpu / max(1, tokens) * 1e6,
            "core_us_per_token": core / max(1, tokens) * 1e6, "steps": steps,
            # the clients' own CPU (a figure of the server only while no client process is near 100 %)
            "client_us_per_token": sum(float(r["cpu"]) for r in res) / max(1, tokens) * 1e6,  # type: ignore[arg-type]
            "client_busy": max(float(r["cpu"]) / max(1e-9, float(r["wall"])) for r in res),  # type: ignore[arg-type]
            "ttft": [t for r in res for t in r["ttft"]], "itl": [t for r in res for t in r["itl"]],  # type: ignore[attr-defined]
            "itl_steady": steady_gaps(res)}


def steady_gaps(res: list[dict[str, object]]) -> list[float]:
    """The inter-token gaps that began once every stream had its first token: the steady decode,
    without the arrival burst (new requests' prompt steps and front-end work between tokens)."""
    firsts = [t for r in res for t in r["first_at"]]  # type: ignore[attr-defined]
    if not firsts:
        return []
    started = max(firsts)
    return [g for r in res for g, at in zip(r["itl"], r["itl_at"], strict=True) if at >= started]  # type: ignore[call-overload]


def run_generate(llm: object, prompts: list[list[int]], output_len: int) -> dict[str, object]:
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    steps0 = llm.engine.num_steps  # type: ignore[attr-defined]
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)  # type: ignore[attr-defined]
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    # time to first token inside the engine (from add to first token), per request
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs
            if o.metrics.get("first_token_time") and o.metrics.get("arrival_time")]
    return {"tok_s": tokens / dt, "tokens": tokens, "ttft": ttft, "cpu_us_per_token": cpu / max(1, tokens) * 1e6,
            "steps": llm.engine.num_steps - steps0}  # type: ignore[attr-defined]


def server_steps(url: str) -> int:
    """Engine steps the server has run (its ``iteration_tokens_total`` histogram's count)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("deepinfer:iteration_tokens_total_count")))


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded SmolLM2)")
    parser.add_argument("--shape", default=None, help="random weights of this shape (tests/runtime/gpu_shapes.py)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--clients", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup-rounds", type=int, default=1,
                        help="unmeasured rounds of both contenders before each row's repeats, at the row's "
                             "client count (a first batch of a new size pays one-time costs on either side)")
    parser.add_argument("--mode", nargs="+", default=["stream", "plain"], choices=["stream", "plain"])
    parser.add_argument("--client-procs", type=int, nargs="+", default=[8],
                        help="client processes (several values: each is measured, to show it does not matter)")
    parser.add_argument("--api-server-count", type=int, nargs="+", default=[1],
                        help="front-end processes of the server (several values: a server for each, "
                             "measured in turn, each against a fresh in-process LLM)")
    parser.add_argument("--server-args", default="", help="more options of the server, one string "
                        "(give it with '=': --server-args=--engine-in-process)")
    parser.add_argument("--stream-interval", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads, both sides (with replicas: per replica)")
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="N > 1: compare a server of N replicas with a one-replica server")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="the server's share of the GPU (default 0.4; the in-process LLM gets as much KV)")
    args = parser.parse_args()
    try:  # torch before any deepinfer native module (docs/troubleshooting.md: the H200's static libstdc++)
        import torch
    except ImportError:
        pass
    if args.shape:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "runtime"))
        from gpu_shapes import write_shape_dir

        args.shape_dir = write_shape_dir(tempfile.mkdtemp(prefix="serve-bench-"), args.shape)
        args.model = args.shape_dir
    if args.data_parallel_size > 1:
        compare_replicas(args)
        return
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from deepinfer import LLM

    max_seqs = max(args.clients)
    cuda = (args.device or "").startswith("cuda") or (args.device is None and _has_cuda())
    share = args.gpu_memory_utilization if args.gpu_memory_utilization is not None else 0.4
    rows: list[dict[str, object]] = []
    rng = np.random.default_rng(0)
    for count in args.api_server_count:
        proc, url = start_server(args, max_seqs, gpu_memory_utilization=share if cuda else None, api_servers=count)
        llm = None
        try:
            kwargs: dict[str, object] = {}
            if cuda:  # the server holds its share now: the LLM gets as much on top of what is in use
                import torch

                free, total = torch.cuda.mem_get_info()
                kwargs["gpu_memory_utilization"] = min(0.95, (total - free) / total + share * 0.9)
            if args.shape:
                kwargs.update(dummy_weights=True, dtype="bfloat16")
            # the server's engine settings: its step budget (--server-args, else serve's default)
            budget = re.search(r"--max-num-batched-tokens[= ](\d+)", args.server_args)
            kwargs.update(device=args.device, max_model_len=args.max_model_len, max_num_seqs=max_seqs,
                          max_num_batched_tokens=int(budget.group(1)) if budget else None)
            from deepinfer.serve.engine_defaults import serve_llm_kwargs

            kwargs = serve_llm_kwargs(kwargs)
            llm = LLM(args.model, **kwargs)
            vocab = llm.model_config.vocab_size

            def fresh(n: int, vocab: int = vocab) -> list[list[int]]:
                return [rng.integers(100, vocab - 100, args.input_len).tolist() for _ in range(n)]

            run_generate(llm, fresh(2), 4)  # warm-up both
            run_clients(url, fresh(2), 4, True, 1, proc.pid)
            print(f"deepinfer serve vs LLM.generate: {args.input_len} prompt + {args.output_len} output tokens per "
                  f"request, greedy, EOS ignored, model {args.shape or args.model or 'default'}, device {llm.device}, "
                  f"step budget {kwargs['max_num_batched_tokens'] or 'default'} tokens, "
                  f"torch threads {args.threads or 'default'}, {os.cpu_count()} cores, --api-server-count "
                  f"{count}, --stream-interval {args.stream_interval} {args.server_args}", flush=True)
            for mode in args.mode:
                for procs in args.client_procs:
                    for n in args.clients:
                        rows.append({"api": count, **measure(args, llm, url, proc.pid, fresh, n, mode, procs)})
        finally:
            proc.terminate()
            proc.wait(60)
            del llm
            if cuda:
                import gc

                import torch

                gc.collect()
                torch.cuda.empty_cache()
    print_table(rows)


def print_table(rows: list[dict[str, object]]) -> None:
    """Every measurement in one compact table (medians of the repeats)."""
    print("\n| mode | clients | client procs | front ends | serve tok/s | generate tok/s | ratio | TTFT p50 ms | "
          "TTFT p99 ms serve / generate | ITL p99 ms (all / steady) | server CPU us/tok | core us/tok | client CPU us/tok (busiest %) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['clients']} | {r['procs']} | {r['api']} | {r['serve']:.1f} | {r['generate']:.1f} | "
              f"{r['ratio']:.3f} | {r['ttft_p50']:.0f} | {r['ttft_p99']:.0f} / {r['gen_ttft_p99']:.0f} | {r['itl_p99']:.1f} / {r['itl_steady_p99']:.1f} | {r['cpu']:.1f} | {r['core_cpu']:.1f} | "
              f"{r['client_cpu']:.1f} ({100 * float(r['client_busy']):.0f}) |",  # type: ignore[arg-type]
              flush=True)


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def measure(args: argparse.Namespace, llm: object, url: str, pid: int, fresh: object, n: int, mode: str,
            procs: int) -> dict[str, object]:
    ratios, serve_tps, gen_tps, ttft, itl, itl_steady, cpu, core_cpu = [], [], [], [], [], [], [], []
    gen_cpu, serve_steps, gen_steps, gen_ttft, client_cpu, client_busy = [], [], [], [], [], []
    for _ in range(args.warmup_rounds):
        prompts = fresh(n)  # type: ignore[operator]
        run_generate(llm, prompts, args.output_len)
        run_clients(url, prompts, args.output_len, mode == "stream", min(procs, n), pid)
    for r in range(args.repeats):
        prompts = fresh(n)  # type: ignore[operator]
        order = ("generate", "serve") if r % 2 == 0 else ("serve", "generate")
        res = {}
        for who in order:
            res[who] = (run_generate(llm, prompts, args.output_len) if who == "generate"
                        else run_clients(url, prompts, args.output_len, mode == "stream", min(procs, n), pid))
        assert res["serve"]["tokens"] == res["generate"]["tokens"] == n * args.output_len, res["serve"]["tokens"]
        ratios.append(res["serve"]["tok_s"] / res["generate"]["tok_s"])
        serve_tps.append(res["serve"]["tok_s"])
        gen_tps.append(res["generate"]["tok_s"])
        cpu.append(res["serve"]["cpu_us_per_token"])
        core_cpu.append(res["serve"]["core_us_per_token"])
        gen_cpu.append(res["generate"]["cpu_us_per_token"])
        client_cpu.append(res["serve"]["client_us_per_token"])
        client_busy.append(res["serve"]["client_busy"])
        gen_ttft += res["generate"]["ttft"]
        serve_steps.append(res["serve"]["steps"])
        gen_steps.append(res["generate"]["steps"])
        ttft += res["serve"]["ttft"]
        itl += res["serve"]["itl"]
        itl_steady += res["serve"]["itl_steady"]
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    # text chunks = a first one per stream + one per gap: above 1 token a chunk, the streams coalesced
    # (a front end behind the engine, or --stream-interval), and each write carried several tokens
    tokens_per_chunk = n * args.repeats * args.output_len / max(1, len(ttft) + len(itl))
    # (the p99 first tokens: near the end of the prompt phase, after which every stream decodes)
    lat = (f"TTFT p50 {pct(ttft, 50):.0f} ms p99 {pct(ttft, 99):.0f} ms (generate's p50 "
           f"{pct(gen_ttft, 50):.0f} ms p99 {pct(gen_ttft, 99):.0f} ms); ITL p50 {pct(itl, 50):.1f} ms "
           f"p99 {pct(itl, 99):.1f} ms (once every stream has started: {len(itl_steady)} gaps, p50 "
           f"{pct(itl_steady, 50):.1f} ms p99 {pct(itl_steady, 99):.1f} ms); {tokens_per_chunk:.2f} tokens a text "
           "chunk" if mode == "stream" else f"latency p50 {pct(ttft, 50):.0f} ms")
    print(f"{mode:6s} {n:3d} clients / {procs:2d} procs: serve {statistics.median(serve_tps):8.1f} tok/s "
          f"(min {min(serve_tps):.1f} max {max(serve_tps):.1f}), generate {statistics.median(gen_tps):8.1f} "
          f"tok/s, ratio {statistics.median(ratios):.3f} (per repeat {', '.join(f'{x:.3f}' for x in ratios)}); "
          f"{lat}; server CPU {statistics.median(cpu):.1f} us/token (engine core {statistics.median(core_cpu):.1f}, "
          f"the rest {statistics.median(c - k for c, k in zip(cpu, core_cpu, strict=True)):.1f}; generate's "
          f"process {statistics.median(gen_cpu):.1f}); engine steps serve {statistics.median(serve_steps):.0f} vs "
          f"generate {statistics.median(gen_steps):.0f}; clients' CPU {statistics.median(client_cpu):.1f} us/token "
          f"(busiest client process {100 * max(client_busy):.0f} % of the time); "
          f"load average {load}", flush=True)
    return {"mode": mode, "clients": n, "procs": procs, "serve": statistics.median(serve_tps),
            "generate": statistics.median(gen_tps), "ratio": statistics.median(ratios), "ttft_p50": pct(ttft, 50),
            "ttft_p99": pct(ttft, 99), "gen_ttft_p99": pct(gen_ttft, 99),
            "itl_p99": pct(itl, 99), "itl_steady_p99": pct(itl_steady, 99), "cpu": statistics.median(cpu), "core_cpu": statistics.median(core_cpu),
            "client_cpu": statistics.median(client_cpu), "client_busy": max(client_busy)}


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
            run_clients(url, [rng.integers(100, vocab - 100, args.input_len).tolist()
                              for _ in range(2 * replicas)], 4, True, 1, proc.pid)  # warm-up every replica
            results[replicas] = {}
            for n in args.clients:
                for r in range(args.repeats):
                    prompts = [rng.integers(100, vocab - 100, args.input_len).tolist() for _ in range(n)]
                    res = run_clients(url, prompts, args.output_len, True, min(args.client_procs[0], n), proc.pid)
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
    try:
        main()
    except BaseException:
        if SERVER_LOG:
            print("the server's last lines:\n" + "".join(SERVER_LOG), file=sys.stderr)
        raise
