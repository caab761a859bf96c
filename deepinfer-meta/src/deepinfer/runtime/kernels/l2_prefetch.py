"""Weights pulled into the GPU's L2 cache ahead of the kernel that reads them (experimental).

A one-sequence decode step is a chain of short kernels. Some of them read little memory and wait
on latency (the rotary kernel, the split-K attention, the MoE router), and during them the HBM is
nearly idle. The next weight-bound kernel (the o projection, the next layer's qkv, the chosen
experts' down rows) then starts cold: its first loads wait ~1 us on HBM, and it reaches the copy
bandwidth only after its first wave of programs. The H100/H200 L2 holds 50 MB, more than one of
those weights (Qwen3-30B-A3B: o 16.8 MB, qkv 21 MB, eight experts' down rows 25 MB).

Here a tiny kernel on a side stream issues ``cp.async.bulk.prefetch.L2`` (Hopper's bulk L2
prefetch: no registers, no data returned, one instruction per 16 KiB) over such a weight. In a
CUDA graph the side stream becomes a parallel branch, so the prefetch runs beside the latency-bound
kernels and the decode chain keeps its PDL edges. ``join`` makes the main stream wait for the
branch (once, at the end of the layers). The prefetches only warm the cache: no kernel depends on
them for its values, so they cannot change a result.

``DEEPINFER_L2_PREFETCH`` (default off) names what is prefetched, comma-separated: ``o`` (the o
projection, issued after the qkv GEMV), ``qkv`` (the next layer's qkv projection, issued after the
o GEMV), ``qkv_down`` (the same, issued after the gate/up kernel: beside the down projection), ``w2`` / ``w13`` (the chosen experts' down / gate-up weights, issued after the router of
a few-token MoE step), ``last`` (the lines are marked evict-last, so the streaming reads between
the prefetch and its reader evict them after others). Hopper or later only; elsewhere nothing runs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer.runtime import switches

TOKENS = ("o", "qkv", "qkv_down", "w2", "w13", "last")
CHUNK = 16384  # bytes a bulk-prefetch instruction asks for
PER_PROGRAM = 32  # instructions a program issues (one warp, one each)


def plan() -> frozenset[str]:
    """The tokens of ``DEEPINFER_L2_PREFETCH`` (read at capture); a ValueError names an unknown one."""
    text = switches.value("DEEPINFER_L2_PREFETCH").strip()
    got = frozenset(t.strip() for t in text.split(",") if t.strip()) if text and text != "0" else frozenset()
    unknown = sorted(got - set(TOKENS))
    if unknown:
        raise ValueError(f"DEEPINFER_L2_PREFETCH: unknown {', '.join(unknown)}; expected a comma-separated subset of "
                         f"{', '.join(TOKENS)}")
    return got


_SUPPORTED: dict[int, bool] = {}


def supported(device: torch.device) -> bool:
    """Bulk L2 prefetch exists: a CUDA device of compute capability >= 9, not Triton's interpreter."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SUPPORTED:
        _SUPPORTED[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _SUPPORTED[index]


@triton.jit
def _prefetch_range(base, offs, end, CHUNK: tl.constexpr, EVICT_LAST: tl.constexpr):
    # offs: [PER_PROGRAM] byte offsets from base (int8 pointer), each the start of one CHUNK;
    # the instruction is skipped (size 0) past end. Sizes are multiples of 16 (end is).
    size = tl.where(offs < end, tl.minimum(end - offs, CHUNK), 0).to(tl.int32)
    if EVICT_LAST:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b64 pol; setp.gt.s32 p, $2, 0; createpolicy.fractional.L2::evict_last.b64 pol, 1.0;"
            " @p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }",
            "=r,l,r", [base + offs, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [base + offs, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_kernel(w_ptr, start, end, PER: tl.constexpr, CHUNK: tl.constexpr, EVICT_LAST: tl.constexpr):
    base = w_ptr.to(tl.pointer_type(tl.int8))
    offs = start + tl.program_id(0).to(tl.int64) * (PER * CHUNK) + tl.arange(0, PER).to(tl.int64) * CHUNK
    _prefetch_range(base, offs, end, CHUNK, EVICT_LAST)


@triton.jit
def _prefetch_experts_kernel(w_ptr, ids_ptr, expert_bytes, PER: tl.constexpr, CHUNK: tl.constexpr,
                             EVICT_LAST: tl.constexpr):
    # grid (pair, chunks of one expert / PER): the pair's expert id, then its slice of the expert's bytes
    expert = tl.load(ids_ptr + tl.program_id(0)).to(tl.int64)
    base = w_ptr.to(tl.pointer_type(tl.int8)) + expert * expert_bytes
    offs = tl.program_id(1).to(tl.int64) * (PER * CHUNK) + tl.arange(0, PER).to(tl.int64) * CHUNK
    _prefetch_range(base, offs, expert_bytes, CHUNK, EVICT_LAST)


_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def _side(device: torch.device) -> torch.cuda.Stream:
    """The device's side stream, forked from the current one (made on first use: the graphs'
    eager warm-up runs before their capture)."""
    side = _SIDE.get(device)
    if side is None:
        side = _SIDE[device] = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    return side


def prefetch(weights: list[torch.Tensor], evict_last: bool = False) -> None:
    """Prefetch each contiguous tensor of ``weights`` into L2 on the side stream (after what the
    current stream has queued so far). Only the 16-byte-aligned interior of a tensor is asked for."""
    for w in weights:
        if not w.is_contiguous() or not supported(w.device):
            continue
        addr = w.data_ptr()
        start = -addr % 16
        end = (addr + w.numel() * w.element_size()) // 16 * 16 - addr
        if end <= start:
            continue
        per_program = PER_PROGRAM * CHUNK
        with torch.cuda.stream(_side(w.device)):
            _prefetch_kernel[(triton.cdiv(end - start, per_program),)](
                w, start, end, PER=PER_PROGRAM, CHUNK=CHUNK, EVICT_LAST=evict_last, num_warps=1)


def prefetch_experts(w: torch.Tensor, ids: torch.Tensor, evict_last: bool = False) -> None:
    """Prefetch the experts ``ids`` (any shape, integer, on ``w``'s device) of the stacked expert
    weights ``w`` [E, ...] (contiguous) into L2 on the side stream, after the current stream's work
    (the kernel that writes ``ids``). Nothing is asked for if an expert's bytes are not a multiple
    of 16 or the tensor is not 16-byte aligned."""
    expert_bytes = w[0].numel() * w.element_size()
    if (not supported(w.device) or not w.is_contiguous() or expert_bytes % 16 or w.data_ptr() % 16
            or not ids.is_contiguous()):
        return
    per_program = PER_PROGRAM * CHUNK
    with torch.cuda.stream(_side(w.device)):
        _prefetch_experts_kernel[(ids.numel(), triton.cdiv(expert_bytes, per_program))](
            w, ids, expert_bytes, PER=PER_PROGRAM, CHUNK=CHUNK, EVICT_LAST=evict_last, num_warps=1)


def join(device: torch.device) -> None:
    """The current stream waits for every prefetch queued so far (a graph's branches must end
    joined to its main stream before the capture ends)."""
    side = _SIDE.get(device)
    if side is not None:
        torch.cuda.current_stream(device).wait_stream(side)
