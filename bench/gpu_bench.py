"""GPU throughput of DeepInfer (CUDA graphs, and eager) against transformers ``generate``, in one run.

    python bench/gpu_bench.py --shape smollm2-135m --batch 256 --input-len 128 --output-len 256 [--runs 3]
    python bench/gpu_bench.py --shape llama3-8b --batch 1 --input-len 128 --output-len 128
    python bench/gpu_bench.py --workload nanovllm        # Qwen3-0.6B shape, DeepInfer only
    python bench/gpu_bench.py --shape llama3-8b --batch 1 --contenders deepinfer --quantization none,fp8

Random bf16 weights of the named shape (tests/runtime/gpu_shapes.py), EOS ignored, greedy.
``--weights q4_0|q4_1|q8_0|q4_k_m``: the projections and LM head quantized on the GPU to that GGUF
scheme (tests/runtime/gguf_quantizer.py, seconds for 8B) and run by the GGUF kernels.
``--workload nanovllm`` is nano-vllm's published benchmark (its bench.py): on the Qwen3-0.6B shape,
256 sequences with input and output lengths uniform in [100, 1024] and token ids in [0, 10000]
drawn with Python's ``random`` seeded 0 in nano-vllm's order, temperature 0.6, EOS ignored,
``max_model_len=4096``; output tok/s is the sum of the max_tokens over the wall time.
Every contender gets one warm-up call (transformers: of 4 new tokens), then ``--runs`` timed calls
(DeepInfer's each with new token ids of the same lengths, so that no prompt comes from its prefix
cache: before 2026-12-06 the timed calls repeated the first call's prompts, which made their
prompt steps nearly free); prints each run and the
median with the spread (min-max) of output tok/s. DeepInfer's runs also print the
``deepinfer bench`` report (TTFT/TPOT, GPU idle fraction, MFU); ``--profile`` adds one run with
the GraphTimer on (region times inside the decode graphs).

The random weights are made on the GPU directly (model built on the meta device, then
initialised in place): the runtime's dummy-weight loader goes through a float32 host copy,
which for an 8B shape takes minutes.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "runtime"))


WEIGHTS = "bf16"  # --weights: "bf16", or a GGUF scheme the projections are quantized to (gguf_quantizer)
BUDGET: int | None = None  # --max-num-batched-tokens (None: 8192, or 16384 with a fixed max_model_len)


def _load_on_device(path, *, device, dtype, dummy_weights=False, max_positions=None, seed=0, **_ignored):  # type: ignore[no-untyped-def]
    from deepinfer.runtime.loading.model_loader import LoadedModel, model_class, read_config
    from deepinfer.runtime.models.rotary import RotaryEmbedding

    cfg = read_config(path)
    with torch.device("meta"):  # LlamaForCausalLM, or the MoE / MLA model of the shape
        model = model_class(cfg)(cfg, max_positions=max_positions).to(dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.rotary = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta,
                                   cfg.rope_scaling).to(device)
    if WEIGHTS != "bf16":
        from gguf_quantizer import quantize_model_projections

        t0 = time.perf_counter()
        counts = quantize_model_projections(model, WEIGHTS)
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        print(f"  weights quantized to {WEIGHTS} ({counts}) in {time.perf_counter() - t0:.1f} s", flush=True)
    return LoadedModel(model=model.eval(), config=cfg, path=path)


def _summary(name: str, values: list[float]) -> str:
    return (f"{name}: median {statistics.median(values):,.0f} output tok/s (spread {min(values):,.0f}-"
            f"{max(values):,.0f}, {100 * (max(values) - min(values)) / statistics.median(values):.1f} %, "
            f"{len(values)} runs)")


def _kv_cache_line(llm) -> str:  # type: ignore[no-untyped-def]
    """The engine's KV cache: its block count, bytes per token, and for an MLA model how many
    tokens the same bytes would hold as an MHA cache of its heads (keys nope + rope, values v)."""
    from deepinfer.runtime.worker.kv_cache import bytes_per_block

    r = llm.runner
    if not hasattr(r, "num_blocks"):
        return f"KV cache: no block count on {type(r).__name__}"
    cfg, per_block = r.config, bytes_per_block(r.config, r.block_size, llm.dtype)
    per_token = per_block / r.block_size
    line = (f"KV cache: {r.num_blocks} blocks of {r.block_size} tokens ({r.num_blocks * r.block_size:,} tokens, "
            f"{r.num_blocks * per_block / 2**30:.1f} GiB), {per_token / 1024:.1f} KiB per token")
    if cfg.mla is not None:
        m = cfg.mla
        mha = cfg.num_hidden_layers * cfg.num_attention_heads * (m.qk_head_dim + m.v_head_dim) * llm.dtype.itemsize
        line += (f"; an MHA cache of its {cfg.num_attention_heads} heads: {mha / 1024:.1f} KiB per token, "
                 f"{r.num_blocks * per_block // (mha * r.block_size):,} blocks in the same bytes: MLA holds "
                 f"{mha / per_token:.1f}x the tokens")
    return line


def run_transformers(shape_dir: str, prompts: list[list[int]], out_len: int, runs: int) -> list[float]:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(shape_dir)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(cfg).eval()
    torch.set_default_dtype(torch.float32)
    ids = torch.tensor(prompts, device="cuda")
    mask = torch.ones_like(ids)
    rates = []
    for i in range(runs + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n_new = out_len if i else min(out_len, 4)  # a short warm-up: a large MoE's full call takes minutes
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                              do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        n = (out.shape[1] - ids.shape[1]) * out.shape[0]
        if i:
            rates.append(n / dt)
            print(f"  transformers run {i}: {n / dt:,.0f} output tok/s ({dt:.2f} s)", flush=True)
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return rates


def nanovllm_workload() -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py: prompts, then each sequence's max_tokens, from random.seed(0)."""
    from random import randint, seed

    seed(0)
    num_seqs, max_input_len, max_output_len = 256, 1024, 1024
    prompts = [[randint(0, 10000) for _ in range(randint(100, max_input_len))] for _ in range(num_seqs)]
    max_tokens = [randint(100, max_output_len) for _ in range(num_seqs)]
    return prompts, max_tokens


def run_deepinfer(shape_dir: str, prompts: list[list[int]], out_len: int | list[int], runs: int, *, eager: bool,
                  profile: bool, temperature: float = 0.0, max_model_len: int | None = None,
                  overlap: bool = True, quantization: str | None = None) -> list[float]:
    import deepinfer.runtime.loading.model_loader as ml
    from deepinfer import LLM, SamplingParams
    from deepinfer.runtime.bench_metrics import measure_generate

    ml.load_model = _load_on_device  # type: ignore[assignment]
    lens = out_len if isinstance(out_len, list) else [out_len] * len(prompts)
    max_len = max_model_len or max(len(p) for p in prompts) + max(lens) + 16
    t0 = time.perf_counter()
    llm = LLM(shape_dir, dtype="bfloat16", dummy_weights=True, max_num_seqs=max(len(prompts), 1),
              max_model_len=max_len,
              max_num_batched_tokens=BUDGET or max(16384 if max_model_len else 8192, max_len),
              enforce_eager=eager, gpu_memory_utilization=0.85, overlap_scheduling=overlap and not eager,
              quantization=quantization)
    print(f"  {llm!r} ready in {time.perf_counter() - t0:.1f} s", flush=True)
    print("  " + _kv_cache_line(llm), flush=True)
    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True) for n in lens]
    vocab = llm.model_config.vocab_size

    def batch(call: int) -> list[dict[str, list[int]]]:
        # new ids every call (the same lengths): a repeated prompt would come from the prefix cache,
        # which transformers does not have and a new request does not get
        return [{"prompt_token_ids": [(t + 7919 * call) % vocab for t in p]} for p in prompts]

    # the first call, untimed in the rates: it shows what a fresh process's first requests wait
    # for (kernel compiles the start-up warm-up did not do; DEEPINFER_WARMUP=0 to compare)
    first = measure_generate(llm, batch(0), params)
    print("  first call (not in the rates): " + "\n    ".join(first.lines()), flush=True)
    rates = []
    for i in range(runs):
        rep = measure_generate(llm, batch(i + 1), params)
        rates.append(rep.output_tok_s)
        mode = "eager" if eager else ("graphs+ZOS" if overlap else "graphs, ZOS off")
        mode += f", weights {quantization}" if quantization else ""
        print(f"  deepinfer {mode} run {i + 1}: " + "\n    ".join(rep.lines()), flush=True)
    if profile and not eager:
        rep = measure_generate(llm, batch(runs + 1), params, profile=True)
        print("  profiled run (GraphTimer on): " + "\n    ".join(rep.lines()), flush=True)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return rates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--hf-runs", type=int, default=None,
                   help="timed transformers calls (default --runs; a large MoE's call takes minutes)")
    p.add_argument("--contenders", default="transformers,deepinfer",
                   help="deepinfer (graphs + overlap scheduling), nozos (graphs, overlap scheduling off), eager, "
                        "transformers")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--quantization", default="none",
                   help="weights of DeepInfer's runs, comma-separated, each run in turn: none (bf16), fp8 "
                        "(LLM(quantization='fp8')); e.g. none,fp8 compares them in one process")
    p.add_argument("--weights", default="bf16",
                   help="bf16, or the projections and LM head quantized to a GGUF scheme on the GPU: q4_0, q4_1, q8_0, "
                        "q4_k_m (llama.cpp's Q4_K/Q6_K choice per tensor), run by the GGUF kernels (DeepInfer only); "
                        "a comma list runs each in turn in this process")
    p.add_argument("--workload", choices=("fixed", "nanovllm"), default="fixed",
                   help="nanovllm: nano-vllm's benchmark on the Qwen3-0.6B shape (DeepInfer only)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="DeepInfer's step budget (default 8192, or 16384 with a fixed max_model_len: prompts in few "
                        "steps); 512 makes every step a step graph (worker/step_graph_runner.py)")
    args = p.parse_args()
    global BUDGET
    BUDGET = args.max_num_batched_tokens
    schemes = args.weights.split(",")
    if any(w not in ("bf16", "q4_0", "q4_1", "q8_0", "q4_k_m") for w in schemes):
        p.error(f"--weights {args.weights!r}: each of bf16, q4_0, q4_1, q8_0, q4_k_m")
    for w in schemes:
        run_shape(args, w)


def run_shape(args: argparse.Namespace, weights: str) -> None:
    global WEIGHTS
    WEIGHTS = weights
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from gpu_shapes import SHAPES, write_shape_dir

    if args.workload == "nanovllm":
        shape_dir = write_shape_dir(tempfile.mkdtemp(prefix="shape-"), "qwen3-0.6b")
        prompts, max_tokens = nanovllm_workload()
        print(f"== nano-vllm workload: qwen3-0.6b bf16 random weights, 256 sequences, {sum(map(len, prompts))} "
              f"input and {sum(max_tokens)} output tokens, temperature 0.6, on {torch.cuda.get_device_name()} "
              f"(torch {torch.__version__})", flush=True)
        rates = run_deepinfer(shape_dir, prompts, max_tokens, args.runs, eager=False, profile=args.profile,
                              temperature=0.6, max_model_len=4096)
        print(_summary("nanovllm qwen3-0.6b deepinfer", rates), flush=True)
        return

    shape_dir = write_shape_dir(tempfile.mkdtemp(prefix="shape-"), args.shape)
    vocab = SHAPES[args.shape]["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, vocab - 100, (args.batch, args.input_len), generator=g).tolist()
    print(f"== {args.shape} {WEIGHTS} random weights, {args.batch} x ({args.input_len} in, {args.output_len} out) on "
          f"{torch.cuda.get_device_name()} (torch {torch.__version__})", flush=True)
    results = {}
    for who in args.contenders.split(","):
        if who == "transformers":
            results[who] = run_transformers(shape_dir, prompts, args.output_len,
                                            args.runs if args.hf_runs is None else args.hf_runs)
        elif who in ("deepinfer", "nozos", "eager"):
            for quant in args.quantization.split(","):
                name = who if quant == "none" else f"{who} {quant}"
                results[name] = run_deepinfer(shape_dir, prompts, args.output_len, 1 if who == "eager" else args.runs,
                                              eager=who == "eager", profile=args.profile and who == "deepinfer",
                                              overlap=who == "deepinfer",
                                              quantization=None if quant == "none" else quant)
    for who, rates in results.items():
        print(_summary(f"{args.shape} {WEIGHTS} b{args.batch} {who}", rates), flush=True)
    if "deepinfer" in results and "transformers" in results:
        print(f"ratio deepinfer/transformers: {statistics.median(results['deepinfer']) / statistics.median(results['transformers']):.2f}x")


if __name__ == "__main__":
    main()
