"""Kernel times of one replayed decode graph (torch.profiler), bf16 random weights of a named shape.

    python bench/decode_profile.py --shape llama3-8b --batch 1 --context 256
    python bench/decode_profile.py --variants "pdl off:DEEPINFER_PDL=0|no qkv:DEEPINFER_ONE_ROW_GEMV=o,gate_up,down"
    python bench/decode_profile.py --shape qwen3-30b-a3b --prompt 128
    python bench/decode_profile.py --weights q4_0 --variants "o quant:DEEPINFER_GGUF_O_QUANT_IN_ATTENTION=1"
    python bench/decode_profile.py --quantization fp8 --variants "f32:DEEPINFER_FP8_ONE_ROW_MATH=f32"
    python bench/decode_profile.py --weights q4_0 --variants "no attention:-attention|no quantization:-quantize"

Runs a short generate to fill the KV cache, then profiles ``--steps`` replays of the decode graph
of ``--batch`` rows and prints each kernel's device time per step (grouped by kernel name), the
sum, and the step's wall time between CUDA events. ``--variants`` then captures the graphs again
under each named set of environment switches (``DEEPINFER_PDL``, ``DEEPINFER_ONE_ROW_GEMV``,
``DEEPINFER_FOLD_MERGE``, ``DEEPINFER_ONE_ROW_TILES``; several joined by ``&``) and prints each one's replay time beside the default's.
A variant may also name parts to leave out of the captured step, ``-attention``, ``-rotary`` or
``-quantize`` (the decode attention, the rotary/KV-store kernel, the GGUF dp4a GEMV's activation
quantization): the replay then computes garbage, and the difference to the default is what that part
really costs inside the graph (with PDL a kernel's profiled duration includes its wait for the one
before it, so the profiler's times overstate the small kernels). Timing only.

``--prompt N`` profiles prompt steps instead: ``--steps`` one-token requests of N fresh tokens
each (no prefix-cache hit), and prints each call's wall time, the kernels' device time, the
device's idle share, the kernel launches and the host calls that wait on the device
(synchronisations, copies to the host): where an eager step loses time to its launches. Prompts
of up to 512 tokens replay step graphs (``worker/step_graph_runner.py``);
``DEEPINFER_STEP_GRAPH_TOKENS=0`` profiles the eager step.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "runtime"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--weights", default="bf16", choices=("bf16", "q4_0", "q4_1", "q8_0", "q4_k_m"),
                   help="the projections quantized on the GPU to this GGUF scheme (as gpu_bench.py --weights)")
    p.add_argument("--quantization", default="none", choices=("none", "fp8"),
                   help="LLM(quantization=...): fp8 quantizes the bf16 projections to E4M3 at load")
    p.add_argument("--variants", default="", help="'name:VAR=VALUE&VAR=VALUE|name2:...' (recaptured, timed only)")
    p.add_argument("--prompt", type=int, default=0, help="profile eager prompt steps of this many tokens")
    p.add_argument("--cprofile", action="store_true", help="with --prompt: also the host's Python time by function")
    args = p.parse_args()
    import deepinfer.runtime.loading.model_loader as ml
    import gpu_bench
    from deepinfer import LLM, SamplingParams
    from gpu_bench import _load_on_device
    from gpu_shapes import write_shape_dir

    gpu_bench.WEIGHTS = args.weights
    ml.load_model = _load_on_device  # type: ignore[assignment]
    shape_dir = write_shape_dir(tempfile.mkdtemp(prefix="shape-"), args.shape)
    llm = LLM(shape_dir, dtype="bfloat16", dummy_weights=True, max_num_seqs=args.batch,
              max_model_len=max(args.context, args.prompt) + 64, gpu_memory_utilization=0.85,
              quantization=None if args.quantization == "none" else args.quantization)
    if args.prompt:
        profile_prompts(llm, args.prompt, args.steps, args.cprofile)
        return
    prompts = [[100 + i] * (args.context - 8) for i in range(args.batch)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    graphs = llm.runner.graphs
    rows = min(b for b in graphs.batch_sizes if b >= args.batch)
    step_ms = replay_ms(graphs, rows, args.steps)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            graphs.replay(rows)
        torch.cuda.synchronize()
    per_kernel: dict[str, list[float]] = collections.defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[ev.name].append(ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total)
    total = sum(sum(v) for v in per_kernel.values()) / args.steps
    weights = args.weights if args.quantization == "none" else args.quantization
    print(f"== {args.shape} {weights} batch {args.batch} (graph {rows}), context {args.context}: replay "
          f"{step_ms * 1000:.0f} us per step (CUDA events), kernels sum to {total:.0f} us per step, "
          f"{sum(len(v) for v in per_kernel.values()) / args.steps:.0f} kernels per step")
    for name, times in sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:25]:
        print(f"  {sum(times) / args.steps:8.1f} us/step  {len(times) / args.steps:5.0f}x  "
              f"mean {sum(times) / len(times):7.2f} us  {name[:110]}")
    if args.variants:
        compare_variants(llm, rows, args.steps, args.variants, step_ms)


# Host calls that block until the device catches up: each one drains the launch queue of an eager step.
_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense",
          "cudaMemcpy", "aten::nonzero")


def profile_prompts(llm, tokens: int, calls: int, python_profile: bool) -> None:  # type: ignore[no-untyped-def]
    """Wall time, kernel time and host waits of one-token requests of ``tokens`` fresh prompt tokens
    (``python_profile``: then cProfile's 25 costliest functions, by own time and by cumulative time)."""
    import time

    from deepinfer import SamplingParams
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def prompt(i: int) -> list[int]:  # distinct first tokens: no two calls share a cached block
        return [1000 + 7 * i] + [100 + (i * 31 + j) % 20000 for j in range(tokens - 1)]

    for i in range(3):
        llm.generate([prompt(10_000 + i)], params, use_tqdm=False)
    walls = []
    for i in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate([prompt(i)], params, use_tqdm=False)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1000)
    walls.sort()
    print(f"== prompt {tokens} tokens, {calls} calls: wall median {walls[len(walls) // 2]:.2f} ms "
          f"(min {walls[0]:.2f}, max {walls[-1]:.2f})")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for i in range(calls):
            llm.generate([prompt(calls + i)], params, use_tqdm=False)
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1000 / calls
    per_kernel: dict[str, list[float]] = collections.defaultdict(list)
    host: dict[str, list[float]] = collections.defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[ev.name].append(ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total)
        elif any(w in ev.name for w in _WAITS) or ev.name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"):
            host[ev.name].append(ev.cpu_time_total)
    kernel_ms = sum(sum(v) for v in per_kernel.values()) / calls / 1000
    print(f"  under the profiler: {wall_ms:.2f} ms per call, kernels {kernel_ms:.2f} ms "
          f"({sum(len(v) for v in per_kernel.values()) / calls:.0f} per call), device idle {1 - kernel_ms / wall_ms:.0%}")
    for name, times in sorted(host.items(), key=lambda kv: -sum(kv[1])):
        print(f"  host {len(times) / calls:6.0f}x per call  {sum(times) / calls / 1000:7.2f} ms  {name}")
    for name, times in sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:25]:
        print(f"  {sum(times) / calls / 1000:8.3f} ms/call  {len(times) / calls:5.0f}x  "
              f"mean {sum(times) / len(times):8.2f} us  {name[:100]}")
    if python_profile:
        import cProfile
        import pstats

        prof_py = cProfile.Profile()
        prof_py.enable()
        for i in range(calls):
            llm.generate([prompt(2 * calls + i)], params, use_tqdm=False)
        torch.cuda.synchronize()
        prof_py.disable()
        for key in ("tottime", "cumulative"):
            print(f"  -- cProfile over {calls} calls, by {key}")
            pstats.Stats(prof_py, stream=sys.stdout).sort_stats(key).print_stats(25)


def replay_ms(graphs, rows: int, steps: int) -> float:  # type: ignore[no-untyped-def]
    """Milliseconds per replay of the graph of ``rows``: the best of 3 runs of ``steps`` replays."""
    for _ in range(5):
        graphs.replay(rows)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(steps):
            graphs.replay(rows)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / steps)
    return best


def _without(part: str) -> tuple[object, str, object]:
    """(module, attribute, stand-in) that leaves ``part`` out of a captured decode step: the stand-in
    launches nothing and returns a tensor of the right shape (its values are garbage)."""
    import deepinfer.runtime.kernels.gguf_gemv as gguf_gemv
    import deepinfer.runtime.models.llama_fused_decode as fused

    def no_attention(q, *args, **kwargs):  # type: ignore[no-untyped-def]
        return q

    def no_rotary(qkv, positions, cos, sin, slot_mapping, kv_cache, num_heads, *args, **kwargs):  # type: ignore[no-untyped-def]
        head_dim = kv_cache.shape[-1]
        return qkv[:, :num_heads * head_dim].unflatten(1, (num_heads, head_dim))

    made: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def no_quantize(x, k, *args, **kwargs):  # type: ignore[no-untyped-def]
        key = (k, str(x.device))
        if key not in made:  # (allocated once, kept, never written: torch.empty launches nothing in a capture)
            made[key] = (torch.empty(k, dtype=torch.int8, device=x.device),
                         torch.empty(3 * (k // 16), dtype=torch.float32, device=x.device))
        return made[key]

    parts = {"attention": (fused, "decode_attention", no_attention), "rotary": (fused, "rotary_kv_write", no_rotary),
             "quantize": (gguf_gemv, "quantize_activations", no_quantize)}
    if part not in parts:
        raise SystemExit(f"--variants: no part {part!r} to leave out (parts: {', '.join(parts)})")
    return parts[part]


def compare_variants(llm, rows: int, steps: int, spec: str, default_ms: float) -> None:  # type: ignore[no-untyped-def]
    from deepinfer.runtime.worker.cuda_graph_runner import capture_decode_graphs

    old = llm.runner.graphs
    sizes, max_len = old.batch_sizes, old.max_model_len
    results = [("default", replay_ms(old, rows, steps))]
    for item in spec.split("|"):
        name, _, assigns = item.partition(":")
        saved = dict(os.environ)
        items = [a for a in assigns.split("&") if a]
        os.environ.update(dict(a.split("=", 1) for a in items if not a.startswith("-")))
        patches = [_without(a[1:]) for a in items if a.startswith("-")]
        originals = [(module, attr, getattr(module, attr)) for module, attr, _ in patches]
        for module, attr, stand_in in patches:
            setattr(module, attr, stand_in)
        try:
            llm.runner.graphs = None
            del old
            torch.cuda.empty_cache()
            old = capture_decode_graphs(llm.runner, llm.engine.step_buffers, sizes, max_len)
            results.append((name, replay_ms(old, rows, steps)))
        except (RuntimeError, ValueError) as exc:  # a variant that fails to capture or run: say so, go on
            print(f"  variant {name}: {type(exc).__name__}: {str(exc)[:300]}")
            old = None
        finally:
            os.environ.clear()
            os.environ.update(saved)
            for module, attr, original in originals:
                setattr(module, attr, original)
    print(f"  (first replay timing above: {default_ms * 1000:.0f} us)")
    for name, ms in results:  # (a failed variant has no line here)
        print(f"  variant {name:24s} replay {ms * 1000:7.0f} us per step ({ms / results[0][1]:.3f} of default)")


if __name__ == "__main__":
    main()
