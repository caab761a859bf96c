"""Structured outputs' cost on the GPU: throughput at 64 requests and the per-token cost at batch 1,
each against the same requests unconstrained, interleaved in one run.

    python bench/structured_gpu.py --tokenizer DIR [--runs 3]          (CUDA)
    python bench/structured_gpu.py --batch 16 [--threads 2] [--runs 3]  (CPU: the default model)

SmolLM2-135M shape, random bf16 weights (as bench/gpu_bench.py), CUDA graphs and overlap
scheduling on, greedy. ``--tokenizer``: a folder with the default model's tokenizer (a real
byte-level vocabulary, so that the grammar has tokens to allow; saved with
``load_tokenizer(default_model_path()).save_pretrained(DIR)``). The constraint is an EBNF grammar
of a JSON array of objects that never closes, so every request runs its full ``max_tokens`` in
both modes (the same tokens counted), and every structured step masks every row. Also prints the
host time spent filling bitmasks (``StructuredOutputs.fill``) per structured step.

Without CUDA the same comparison runs on the embedded default model (its real Q4_1 weights and
tokenizer, ``--threads`` torch threads), so the CPU figure is the one a CPU user gets.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "runtime"))
sys.path.insert(0, os.path.dirname(__file__))

GRAMMAR = ('root ::= "[" items\nitems ::= obj ", " items\n'
           'obj ::= "{\\"id\\": " [0-9]+ ", \\"name\\": \\"" [a-zA-Z ]+ "\\", \\"ok\\": " ("true" | "false") "}"')


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", default=None, help="(CUDA) a folder with the default model's tokenizer")
    p.add_argument("--threads", type=int, default=2, help="(CPU) torch threads")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import deepinfer.runtime.loading.model_loader as ml
    from deepinfer import LLM, SamplingParams, StructuredOutputsParams
    from deepinfer.runtime.structured import manager
    from gpu_bench import _load_on_device
    from gpu_shapes import write_shape_dir

    n, out = args.batch, args.output_len
    if torch.cuda.is_available():
        if args.tokenizer is None:
            p.error("--tokenizer is needed on CUDA (the random-weight shape has no vocabulary of its own)")
        shape_dir = write_shape_dir(tempfile.mkdtemp(prefix="shape-"), "smollm2-135m")
        for f in os.listdir(args.tokenizer):
            shutil.copy(os.path.join(args.tokenizer, f), shape_dir)
        ml.load_model = _load_on_device  # type: ignore[assignment]
        llm = LLM(shape_dir, dtype="bfloat16", dummy_weights=True, max_num_seqs=n,
                  max_model_len=args.input_len + out + 16, max_num_batched_tokens=8192,
                  gpu_memory_utilization=0.5, overlap_scheduling=True)
        where = torch.cuda.get_device_name()
    else:  # the default model on the CPU
        llm = LLM(max_num_seqs=n, max_model_len=args.input_len + out + 16, overlap_scheduling=True,
                  num_threads=args.threads)
        where = f"cpu ({args.threads} threads, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)"
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    print(f"{llm!r} on {where} (torch {torch.__version__})", flush=True)
    host = {"s": 0.0, "calls": 0}
    orig = manager.StructuredOutputs.fill

    def timed(self, *a, **k):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return orig(self, *a, **k)
        finally:
            host["s"] += time.perf_counter() - t
            host["calls"] += 1

    manager.StructuredOutputs.fill = timed  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(0)
    so = StructuredOutputsParams(grammar=GRAMMAR)

    def run(batch: int, structured: bool) -> tuple[float, int]:
        prompts = [{"prompt_token_ids": torch.randint(100, 49000, (args.input_len,), generator=g).tolist()}
                   for _ in range(batch)]
        params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=not structured,
                                structured_outputs=so if structured else None)
        sync()
        t = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        sync()
        dt = time.perf_counter() - t
        toks = sum(len(o.outputs[0].token_ids) for o in res)
        assert all(o.outputs[0].finish_reason == "length" for o in res), "a request ended before max_tokens"
        return dt, toks

    for b in (n, 1):  # warm-up at the measured shapes (compiles the grammar, captures what it needs)
        run(b, False)
        run(b, True)
    for b in (n, 1):
        plain, struct = [], []
        host["s"], host["calls"] = 0.0, 0
        for _ in range(args.runs):
            dt, toks = run(b, False)
            plain.append((dt, toks))
            dt, toks = run(b, True)
            struct.append((dt, toks))
        per_call_us = 1e6 * host["s"] / max(host["calls"], 1)
        rate_p = [t / d for d, t in plain]
        rate_s = [t / d for d, t in struct]
        print(f"batch {b}: unconstrained tok/s {[round(r) for r in rate_p]}, structured {[round(r) for r in rate_s]}; "
              f"median ratio structured/unconstrained {statistics.median(rate_s) / statistics.median(rate_p):.3f}; "
              f"host bitmask fill {per_call_us:.0f} us per structured step", flush=True)
        if b == 1:
            step_p = statistics.median(d / t for d, t in plain)
            step_s = statistics.median(d / t for d, t in struct)
            print(f"batch 1: decode step {1e6 * step_p:.0f} us unconstrained, {1e6 * step_s:.0f} us structured; "
                  f"per-token cost {1e6 * (step_s - step_p):.0f} us = {100 * (step_s - step_p) / step_p:.1f} % "
                  "of a decode step", flush=True)


if __name__ == "__main__":
    main()
