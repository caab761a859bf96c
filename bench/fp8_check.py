"""FP8 weight-only quantization on the GPU (issue 28): kernels, accuracy and speed in one run.

    python bench/fp8_check.py [--part kernels|model|all] [--out-len 128]

1. kernels: ``fp8_gemv`` (plain, RMSNorm prologue, residual epilogue, SiLU·mul input) and the
   several-row products (``fp8_gemm``, ``torch._scaled_mm``) on the Llama-3-8B projection shapes
   against a float64 product of the dequantized weights; then each kernel's time and achieved
   bandwidth next to the bf16 GEMV / cuBLAS and the device's copy bandwidth.
2. model: Llama-3-8B shape, random weights (seed 0, N(0, 0.02)): logits of a 64-token prompt with
   the fp8 projections vs bf16 (relative error of the logits, top-1 agreement per position),
   greedy agreement over 32 generated tokens of 4 prompts (decode graphs), and output tok/s at
   batch 1 and 32 concurrent sequences, bf16 then fp8, in one process.

Random weights of the 8B shape are made on the GPU directly (bench/gpu_bench.py's loader).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time

import torch  # before any deepinfer native module

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "runtime"))

SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _time_us(fn, reps: int = 30) -> float:  # type: ignore[no-untyped-def]
    from triton.testing import do_bench

    return 1e3 * float(do_bench(fn, warmup=10, rep=reps))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def kernels() -> None:
    import torch.nn.functional as F
    from deepinfer.runtime.kernels.fp8_act import fp8_scaled_mm
    from deepinfer.runtime.kernels.fp8_gemv import fp8_gemm, fp8_gemv
    from deepinfer.runtime.kernels.gemv import gemv
    from deepinfer.runtime.models.fp8_linear import dequantize_fp8, quantize_fp8

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    copy_us = _time_us(big.clone)
    copy_gbs = 2 * big.numel() / copy_us / 1e3
    del big
    print(f"device copy bandwidth (1 GiB clone, read+write): {copy_gbs:,.0f} GB/s", flush=True)
    worst = 0.0
    for name, (n, k) in SHAPES_8B.items():
        w = torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
        q, s = quantize_fp8(w)
        wd = dequantize_fp8(q, s, torch.float64)
        kin = 2 * k if name == "down" else k
        x = torch.randn(1, kin, device=dev, generator=g, dtype=torch.bfloat16)
        res = torch.randn(1, n, device=dev, generator=g, dtype=torch.bfloat16)
        nw = torch.rand(k, device=dev, generator=g, dtype=torch.bfloat16) + 0.5
        errs = []
        if name == "down":  # SiLU·mul input + residual epilogue
            a = F.silu(x[:, :k]) * x[:, k:]
            ref = (a.double() @ wd.T) + res.double()
            got = fp8_gemv(x, q, s, silu_mul=True, residual=res)
            errs.append(("silu_mul+residual", _rel(got, ref)))
        else:
            ref = x.double() @ wd.T
            errs.append(("plain", _rel(fp8_gemv(x, q, s), ref)))
            xf = x.float()
            normed = (nw.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype).float())
            errs.append(("norm", _rel(fp8_gemv(x, q, s, norm=(nw, 1e-5)), normed.double() @ wd.T)))
            errs.append(("residual", _rel(fp8_gemv(x, q, s, residual=res), ref + res.double())))
        for rows in (2, 7, 32, 64, 333):
            xm = torch.randn(rows, k, device=dev, generator=g, dtype=torch.bfloat16)
            refm = xm.double() @ wd.T
            errs.append((f"gemm {rows}", _rel(fp8_gemm(xm, q, s), refm)))
            errs.append((f"scaled_mm {rows}", _rel(fp8_scaled_mm(xm, q, s), refm)))
        worst = max(worst, *(e for label, e in errs if not label.startswith("scaled_mm")))
        print(f"{name} [{n}x{k}] rel. error vs float64 of the dequantized weight: "
              + ", ".join(f"{lbl} {e:.2e}" for lbl, e in errs), flush=True)
        # speed: one row
        x1 = x[:, :k].contiguous()
        t_bf = _time_us(lambda x1=x1, w=w: gemv(x1, w, None))
        t_f8 = _time_us(lambda x1=x1, q=q, s=s: fp8_gemv(x1, q, s))
        t_cub = _time_us(lambda x1=x1, w=w: F.linear(x1, w))
        print(f"  1 row: bf16 GEMV {t_bf:.1f} us ({2 * n * k / t_bf / 1e3:,.0f} GB/s), cuBLAS bf16 {t_cub:.1f} us, "
              f"fp8 GEMV {t_f8:.1f} us ({(n * k + 4 * n) / t_f8 / 1e3:,.0f} GB/s = "
              f"{100 * (n * k + 4 * n) / t_f8 / 1e3 / copy_gbs:.0f} % of copy), speed-up {t_bf / t_f8:.2f}x", flush=True)
        for rows in (8, 32, 2048):
            xm = torch.randn(rows, k, device=dev, generator=g, dtype=torch.bfloat16)
            tb = _time_us(lambda xm=xm, w=w: F.linear(xm, w))
            tg = _time_us(lambda xm=xm, q=q, s=s: fp8_gemm(xm, q, s))
            ts = _time_us(lambda xm=xm, q=q, s=s: fp8_scaled_mm(xm, q, s))
            print(f"  {rows} rows: cuBLAS bf16 {tb:.1f} us, fp8 Triton GEMM {tg:.1f} us, _scaled_mm (+act quant) "
                  f"{ts:.1f} us -> best {min((tb, 'bf16'), (tg, 'triton'), (ts, 'scaled_mm'))[1]}", flush=True)
    print(f"KERNELS worst relative error (fp8 weight-only paths): {worst:.2e} "
          f"({'OK' if worst < 1e-2 else 'FAIL'}: bound 1e-2)", flush=True)


SWEEP = ((2, 2048, 4, 3), (4, 2048, 8, 2), (1, 4096, 4, 3), (4, 1024, 4, 3), (8, 1024, 8, 2), (2, 4096, 8, 2))


def sweep() -> None:
    """One-row fp8 GEMV tiles (BLOCK_N, BLOCK_K, warps, stages) on each Llama-3-8B projection."""
    from deepinfer.runtime.kernels.fp8_gemv import fp8_gemv
    from deepinfer.runtime.models.fp8_linear import quantize_fp8

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    for name, (n, k) in SHAPES_8B.items():
        q, s = quantize_fp8(torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * 0.02)
        x = torch.randn(1, k, device=dev, generator=g, dtype=torch.bfloat16)
        times = {cfg: _time_us(lambda cfg=cfg, x=x, q=q, s=s: fp8_gemv(x, q, s, config=cfg), reps=25) for cfg in SWEEP}
        best = min(times, key=lambda c: times[c])
        print(f"SWEEP {name} [{n}x{k}]: " + ", ".join(f"{c} {t:.1f} us" for c, t in times.items())
              + f" -> best {best} ({(n * k + 4 * n) / times[best] / 1e3:,.0f} GB/s)", flush=True)


def _attention(q, k, v, cache, meta, scale):  # type: ignore[no-untyped-def]
    # one causal sequence, no cache: enough for a prefill's logits
    import torch.nn.functional as F

    rep = q.shape[1] // k.shape[1]
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
                                       v.repeat_interleave(rep, 1).transpose(0, 1), is_causal=True, scale=scale)
    return o.transpose(0, 1)


def model(out_len: int) -> None:
    import deepinfer.runtime.loading.model_loader as ml
    from deepinfer import LLM, SamplingParams
    from deepinfer.runtime.bench_metrics import measure_generate
    from deepinfer.runtime.models.fp8_linear import quantize_model
    from gpu_bench import _load_on_device
    from gpu_shapes import write_shape_dir

    dev = torch.device("cuda")
    shape_dir = write_shape_dir(tempfile.mkdtemp(prefix="shape-"), "llama3-8b")
    # logits: the torch forward (prefill: the several-row fp8 GEMM)
    loaded = _load_on_device(shape_dir, device=dev, dtype=torch.bfloat16, max_positions=256)
    m = loaded.model
    ids = torch.randint(100, 128000, (64,), generator=torch.Generator().manual_seed(1)).to(dev)
    pos = torch.arange(64, device=dev)
    with torch.no_grad():
        ref = m.compute_logits(m.forward(ids, pos, [None] * len(m.layers), None, _attention))  # type: ignore[arg-type]
        quantize_model(m, "fp8")
        got = m.compute_logits(m.forward(ids, pos, [None] * len(m.layers), None, _attention))  # type: ignore[arg-type]
    rel = _rel(got, ref)
    top1 = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    print(f"MODEL llama3-8b random weights, 64-token prompt: logits rel. error fp8 vs bf16 {rel:.3e} "
          f"(max abs {float((got - ref).abs().max()):.3e}, logits std {float(ref.std()):.3e}), "
          f"top-1 agreement {100 * top1:.1f} % of positions", flush=True)
    del m, loaded, ref, got
    gc.collect()
    torch.cuda.empty_cache()

    ml.load_model = _load_on_device  # type: ignore[assignment]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 128000, (32, 128), generator=g).tolist()
    tokens: dict[str, list[list[int]]] = {}
    rates: dict[tuple[str, int], float] = {}
    for quant in ("fp8", None):  # fp8 first: under a tight time limit its figures come out first
        label = quant or "bf16"
        t0 = time.perf_counter()
        llm = LLM(shape_dir, dtype="bfloat16", dummy_weights=True, max_num_seqs=32, max_model_len=512,
                  max_num_batched_tokens=8192, gpu_memory_utilization=0.5, quantization=quant)
        print(f"  {label}: {llm!r} ready in {time.perf_counter() - t0:.1f} s", flush=True)
        from deepinfer.runtime.worker.native_decode import kernel_paths

        for line in kernel_paths(llm.runner.model, None):
            print(f"    {line}", flush=True)
        greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], greedy, use_tqdm=False)
        tokens[label] = [list(o.outputs[0].token_ids) for o in outs]
        for batch in (1, 32):
            params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
            reqs = [{"prompt_token_ids": p} for p in prompts[:batch]]
            llm.generate(reqs, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)  # warm-up at this batch (graphs are captured at load)
            rep = measure_generate(llm, reqs, params)
            rates[(label, batch)] = rep.output_tok_s
            print(f"  {label} batch {batch}: " + "\n      ".join(rep.lines()), flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    same = sum(a == b for x, y in zip(tokens["bf16"], tokens["fp8"], strict=True)
               for a, b in zip(x, y, strict=True))
    first = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), 32)
             for x, y in zip(tokens["bf16"], tokens["fp8"], strict=True)]
    print(f"MODEL greedy agreement fp8 vs bf16: {same}/{4 * 32} tokens; first divergence per prompt {first}",
          flush=True)
    weights_fp8 = 32 * (4096 * 6144 + 4096 * 4096 + 4096 * 28672 + 14336 * 4096) + 2 * 128256 * 4096
    weights_bf16 = 2 * 32 * (4096 * 6144 + 4096 * 4096 + 4096 * 28672 + 14336 * 4096) + 2 * 128256 * 4096
    for batch in (1, 32):
        b, f = rates[("bf16", batch)], rates[("fp8", batch)]
        extra = ""
        if batch == 1:
            extra = (f"; weight stream bf16 {b * weights_bf16 / 1e9:,.0f} GB/s, fp8 {f * weights_fp8 / 1e9:,.0f} "
                     f"GB/s")
        print(f"SPEED llama3-8b batch {batch}: bf16 {b:,.1f} tok/s, fp8 {f:,.1f} tok/s, fp8/bf16 {f / b:.2f}x{extra}",
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("kernels", "model", "sweep", "all"), default="all")
    p.add_argument("--out-len", type=int, default=128)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(f"== fp8 check on {torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()}, "
          f"torch {torch.__version__})", flush=True)
    if args.part in ("kernels", "all"):
        kernels()
    if args.part in ("model", "all"):
        model(args.out_len)
    if args.part == "sweep":
        sweep()


if __name__ == "__main__":
    main()
