"""Every environment switch the runtime reads, in one place.

Most are benchmark switches: they turn one optimisation off (or pick a tile) so its effect can be
measured in the same build; the defaults are what ships. ``SWITCHES`` is the table that
docs/guide/08-gpu.md ("Environment switches") shows; a test keeps the two equal and checks that
no other runtime module reads a ``DEEPINFER_*`` variable.

A boolean switch is off for "0", "false", "no" or "off" (any case), on otherwise.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class Switch:
    name: str
    default: str
    read_by: str  # the module that acts on it
    what: str


SWITCHES: dict[str, Switch] = {s.name: s for s in (
    Switch("DEEPINFER_CPU_NATIVE", "1", "worker/native_decode.py",
           "CPU decode steps run the native C++ kernels (0: every step on torch); read at load"),
    Switch("DEEPINFER_CPU_NATIVE_PROMPTS", "0", "worker/native_decode.py",
           "1: prompt and mixed steps of up to 128 rows of an int4 GGUF model run the native kernels (8-bit "
           "activations) on CPUs below AVX-512; read at load"),
    Switch("DEEPINFER_CPU_ONEDNN", "1", "models/cpu_linear.py",
           "float32 CPU linears of several rows use oneDNN (0: F.linear / MKL)"),
    Switch("DEEPINFER_CPU_HUGE_PAGES", "1", "loading/host_arena.py",
           "a dense CPU model's parameters on 2 MiB transparent huge pages (0: ordinary allocation)"),
    Switch("DEEPINFER_PDL", "1", "kernels/pdl.py",
           "Triton kernels of the decode graph launch with programmatic dependent launch (0: off)"),
    Switch("DEEPINFER_PDL_PREFETCH", "0", "kernels/pdl.py",
           "experimental, slower on the H200 (Qwen3-30B-A3B batch 1: 318 against 365 tok/s): 1 makes the "
           "Triton decode kernels (and every step's rotary kernel) load their weights, the step's inputs "
           "and what kernels two launches back wrote before the PDL wait (0: the one-row GEMVs preload only "
           "their first weight tile)"),
    Switch("DEEPINFER_ONE_ROW_GEMV", "qkv,o,gate_up,down", "models/llama_fused_decode.py",
           "projections of a one-row step that run the fused Triton GEMV (\"none\": cuBLAS for all)"),
    Switch("DEEPINFER_ONE_ROW_TILES", "", "models/llama_fused_decode.py",
           "tile overrides of the one-row GEMVs, \"down=4,2048,8,1,2;o=...\" (benchmarks)"),
    Switch("DEEPINFER_DECODE_TILES", "", "attention/triton_decode.py",
           "tile override of the split-K decode attention, \"split=32,4\" (BLOCK_N a power of two >= 16, "
           "num_warps; benchmarks)"),
    Switch("DEEPINFER_FP8_GEMM", "auto", "models/fp8_linear.py",
           "several-row products of fp8 layers: \"auto\" (by row count), \"triton\" (weight-only), "
           "\"w8a8\" or \"scaled_mm\" (FP8 activations)"),
    Switch("DEEPINFER_SILU_IN_GATE_UP", "fp8", "models/llama_fused_decode.py",
           "where a one-row step stores SiLU(gate)·up from the gate/up GEMV's epilogue, so the down GEMV reads it "
           "ready (no SiLU in each of its programs): \"fp8\" (fp8 GEMVs), \"1\" (bf16/fp16 ones too) or \"0\"; "
           "read at capture"),
    Switch("DEEPINFER_FP8_ONE_ROW_TILES", "", "kernels/fp8_gemv.py",
           "tile overrides of the one-row fp8 GEMV per projection, \"gate_up=8,1024,8,2;down=...\" (benchmarks)"),
    Switch("DEEPINFER_FP8_ONE_ROW_MATH", "f16", "kernels/fp8_gemv.py",
           "how the one-row fp8 GEMV multiplies: \"f32\" (weights widened to float32), \"f16\" (float16 "
           "products), \"f16bits\" (float16 weights from the E4M3 bits by shifts) or \"mma\" (FP8 activation "
           "chunks on the tensor cores)"),
    Switch("DEEPINFER_FP8_LM_HEAD", "0", "models/fp8_linear.py",
           "experimental: 1 makes quantization=\"fp8\" quantize the LM head too (vLLM keeps it bf16; the logits "
           "then carry its E4M3 error as well; Llama-3-8B batch 1 305 -> 322 output tok/s on an H100)"),
    Switch("DEEPINFER_TRITON_ARGMAX_ROWS", "1", "worker/cuda_graph_runner.py",
           "decode graphs of up to this many rows whose LM head does not fold the argmax (GGUF, tensor-parallel "
           "heads) pick their tokens with kernels/argmax.py's two launches (0: torch.argmax everywhere)"),
    Switch("DEEPINFER_GGUF_TILED_SCALES", "1", "kernels/gguf_gemv.py",
           "GGUF kernels load each group's scale once and broadcast it (0: gathered per column)"),
    Switch("DEEPINFER_GGUF_WORDS", "1", "kernels/gguf_gemv.py",
           "the GGUF one-row GEMV reads codes as int32 words and scales group sums (0: bytes, each weight scaled)"),
    Switch("DEEPINFER_GGUF_GEMV_LEAN", "0", "kernels/gguf_gemv.py",
           "experimental, not yet timed: 1 runs the GGUF one-row word GEMV in its fewer-instruction form where its "
           "tiles divide the weight (no load masks, chained dp4a, shifts for divisions) with a register budget "
           "that keeps a pass's loads ahead of its products (gguf_gemv.LEAN_MAXNREG); read at every launch"),
    Switch("DEEPINFER_GGUF_GEMV_MAXNREG", "0", "kernels/gguf_gemv.py",
           "experimental, not yet timed: 1 launches the GGUF one-row word GEMV's default form with the lean form's "
           "register budget (gguf_gemv.LEAN_MAXNREG), which keeps a pass's loads ahead of its products in the two "
           "default loops that scatter them (Q4_1; Q4_0 at o and down); read at every launch"),
    Switch("DEEPINFER_GGUF_DP4A", "1", "kernels/gguf_gemv.py",
           "the GGUF word GEMV takes 8-bit activations (one scale per 16 columns) and multiplies with dp4a "
           "(0: float32 activations)"),
    Switch("DEEPINFER_GGUF_Q6K_6BIT", "0", "kernels/gguf_layout.py",
           "experimental: 1 keeps Q6_K codes at their 6 bits on the GPU (a nibble plane and a 2-bit plane; read at "
           "load): Llama-3-8B Q4_K_M 376 -> 389 output tok/s at batch 1, 4,344 -> 4,023 at 32 (H100)"),
    Switch("DEEPINFER_GGUF_Q6K_6BIT_TUNING", "packed", "kernels/gguf_gemv.py",
           "the several-row GEMM choices (tile, swap, K splits) of Q6_K at 6 bits: packed (Q4_K's, a packed type's "
           "tiles), packed-k64 (the same with K steps of 64: fewer registers at 32 rows) or byte (one-byte Q6_K's, the "
           "first measurement's); read at every launch"),
    Switch("DEEPINFER_GGUF_O_QUANT_IN_ATTENTION", "0", "models/llama_fused_decode.py",
           "experimental (Llama-3-8B Q4_0 batch 1: 414 against 422 tok/s on the H100; graph replays 0.99x there and on "
           "the H200): 1 makes the one-row "
           "decode graphs' attention store its output as the GGUF o projection's 8-bit activations too (one launch a"
           " layer fewer than the dp4a GEMV's own quantization); read at capture"),
    Switch("DEEPINFER_GGUF_MMQ_ROWS", "0", "kernels/gguf_mmq.py",
           "experimental: GGUF layers on a GPU multiply up to this many rows on the int8 tensor cores with 8-bit "
           "activations (0: the bf16 GEMM for every several-row product; slower on the H200 so far)"),
    Switch("DEEPINFER_GGUF_DENSE_ROWS", "auto", "kernels/gguf_gemv.py",
           "GGUF products of at least this many rows on a GPU decode the whole weight to the activations' dtype "
           "and multiply with cuBLAS, the next projection's weight decoded meanwhile on a side stream (auto: from "
           "64 rows for models of hidden size <= 1024, from 256 up to 4096, never above; 0: never, the GEMM "
           "decodes tiles in registers)"),
    Switch("DEEPINFER_GGUF_GEMM_SWAP_ROWS", "1024", "kernels/gguf_gemv.py",
           "GGUF products of 33 up to this many rows (of 1-32 for Q4_K/Q5_K, and Q4_0 in CUDA graphs) decode their weights as the MMA's "
           "left operand (Hopper's wgmma takes it from registers; 0: never)"),
    Switch("DEEPINFER_GGUF_GEMM_DECODE", "bf16", "kernels/gguf_gemv.py",
           "how the GGUF GEMM decodes codes (all types but Q8_0): bf16 (exact bf16 codes by PTX bit tricks, times the "
           "bf16-rounded group scale) or f32 (gguf's float32 weight, then rounded: the dequantized file's bf16 weights)"),
    Switch("DEEPINFER_GGUF_GEMM_SPLIT_K", "0", "kernels/gguf_gemv.py",
           "GGUF products of several rows split K this many ways, partial sums added in order (0: chosen "
           "from the shape and the GPU's multiprocessors inside CUDA graphs, none eagerly; 1: never)"),
    Switch("DEEPINFER_FUSED_EAGER", "1", "models/llama_fused_decode.py",
           "eager CUDA steps (prompt chunks, mixed steps) of dense and mixture-of-experts models run the fused Triton "
           "kernels (0: torch ops)"),
    Switch("DEEPINFER_STEP_GRAPH_TOKENS", "auto", "worker/step_graph_runner.py",
           "eager CUDA steps of up to this many tokens (and the step budget) replay CUDA graphs captured at start-up, "
           "one per power of two from 16 (auto: 8192 for models of hidden size up to 1024, else 2048; 0: eager); "
           "read at start-up"),
    Switch("DEEPINFER_FOLD_MERGE", "1", "models/llama_fused_decode.py",
           "the split-KV attention merge folded into the split kernel (0: a second kernel)"),
    Switch("DEEPINFER_WARMUP", "1", "worker/warm_up.py",
           "at start-up on CUDA, eager steps of a few row counts run once on dummy tokens so the first prompt "
           "does not wait for Triton's compiles (0: off)"),
    Switch("DEEPINFER_MOE_SMALL_BATCH", "4", "models/moe.py",
           "tokens up to which a CUDA MoE layer runs the few-token kernels, no sort by expert (one token for "
           "experts of 64 MiB or more; 0: grouped GEMMs)"),
    Switch("DEEPINFER_MOE_TILES", "", "kernels/moe_decode.py",
           "tile overrides of the few-token MoE kernels, \"gate_up=1,2048,4;down=2,1024,4;router=1,2048,2\" "
           "(BLOCK_N or BLOCK_E, BLOCK_K, num_warps; benchmarks)"),
    Switch("DEEPINFER_MOE_DOWN_ONE_SUM", "0", "kernels/moe_decode.py",
           "experimental, not yet timed: 1 makes the few-token MoE down kernel reduce every slot's products "
           "once (each slot's activations scaled by its routing weight) instead of one reduction, with its "
           "barriers, a slot before the next slot's loads; read at every launch"),
    Switch("DEEPINFER_MOE_PRENORM", "1", "models/moe.py",
           "the few-token MoE router stores the RMS-normed rows once for the experts (0: every gate/up program "
           "normalises its row again)"),
    Switch("DEEPINFER_MOE_ROUTER_IN_O", "0", "models/moe.py",
           "1: at one token the MoE router runs in the o projection's launch (logits from its inputs, the weights "
           "stored by gate/up; experimental: within 0.7 % of the default on an H100)"),
    Switch("DEEPINFER_CUDA_BLOCKING_SYNC", "0", "engine/executor.py",
           "1: the step executor waits for a step's sampled ids on blocking CUDA events (the thread sleeps "
           "until the GPU is done: half the engine core's CPU with Llama-3-8B's steps on the H200; 0: CUDA's "
           "default wait, which spins a core for the whole step)"),
    Switch("DEEPINFER_TP_TIMEOUT_S", "120", "parallel/process_group.py",
           "seconds a tensor-parallel rendezvous or collective may wait before failing"),
    Switch("DEEPINFER_CACHE", "~/.cache/deepinfer", "loading/tokenizer_loader.py",
           "where tokenizer snapshots of GGUF models are cached"),
)}

_OFF = ("0", "false", "no", "off")


def value(name: str) -> str:
    """The switch's value in the environment, or its default."""
    return os.environ.get(name, SWITCHES[name].default)


def raw(name: str) -> str | None:
    """The switch's value in the environment, or None when it is not set."""
    assert name in SWITCHES, name
    return os.environ.get(name)


def enabled(name: str) -> bool:
    """A boolean switch: off for 0/false/no/off, else on (its default when unset)."""
    return value(name).strip().lower() not in _OFF


def integer(name: str, lo: int = 0) -> int:
    """An integer switch (at least ``lo``); any other value is a ValueError naming the switch."""
    text = value(name).strip()
    try:
        number = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer (default {SWITCHES[name].default}: "
                         f"{SWITCHES[name].what})") from None
    if number < lo:
        raise ValueError(f"{name}={number} must be at least {lo}")
    return number


def integer_or_auto(name: str, lo: int = 0) -> int | None:
    """An integer switch that may also be ``auto`` (case and surrounding spaces ignored): None for
    ``auto`` (the caller's own rule decides), else as ``integer``."""
    if value(name).strip().lower() == "auto":
        return None
    return integer(name, lo)


def choice(name: str, options: Collection[str]) -> str:
    """A switch taking one of ``options`` (case and surrounding spaces ignored); any other value is a
    ValueError naming the switch and the options."""
    text = value(name).strip().lower()
    if text not in options:
        raise ValueError(f"{name} must be one of {list(options)}, got {text!r}")
    return text


def tiles(name: str, kernels: tuple[str, ...], sizes: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """A tile-override switch, ``"kernel=a,b,c;other=..."``: the tile of each named kernel (one of
    ``kernels``), each of one of ``sizes`` positive integers; anything else is a ValueError naming
    the switch. Read at every kernel launch (a benchmark may change it between captures), parsed
    once per value."""
    return dict(_parse_tiles(name, value(name), kernels, sizes))


@functools.lru_cache(maxsize=64)
def _parse_tiles(name: str, text: str, kernels: tuple[str, ...],
                 sizes: tuple[int, ...]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    out: dict[str, tuple[int, ...]] = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        key, _, text = item.partition("=")
        key = key.strip()
        try:
            tile = tuple(int(v) for v in text.split(","))
        except ValueError:
            tile = ()
        if key not in kernels or len(tile) not in sizes or min(tile) < 1:
            raise ValueError(f"{name}: {item!r} is not KERNEL=N,N,... with KERNEL one of {', '.join(kernels)} and "
                             f"{' or '.join(map(str, sizes))} positive integers ({SWITCHES[name].what})")
        out[key] = tile
    return tuple(out.items())


def native_cpu_decode_wanted() -> bool:
    """Whether the native CPU decode path may be used: not switched off by ``DEEPINFER_CPU_NATIVE=0``
    and the engine wheel has the ``_cpu_kernels`` extension."""
    if not enabled("DEEPINFER_CPU_NATIVE"):
        return False
    try:
        import deepinfer_engine._cpu_kernels  # noqa: F401
    except ImportError:
        return False
    return True
