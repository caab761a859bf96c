"""Programmatic dependent launch (PDL) for the decode kernels: each kernel's launch and start-up
overlap the tail of the kernel before it.

A replayed decode step of one sequence is a chain of a few hundred short kernels; between two of
them the GPU drains the first grid, then launches and ramps up the next. With PDL (Hopper and
later) a kernel launched with ``launch_pdl=True`` may start while its predecessor still runs:
every kernel here first waits for its predecessor's completion (``gdc_wait``: all of its memory
writes are then visible) and then lets its own successor launch (``gdc_launch_dependents``), so
what overlaps is launch latency and block scheduling, never a read of unfinished data. CUDA graph
capture keeps such launches as programmatic edges (cuBLAS launches its GEMMs the same way).

``DEEPINFER_PDL=0`` turns it off (to measure against, or to rule it out).

Prefetch before the wait. What a kernel loads before ``gdc_wait`` overlaps its predecessor's run,
so the one-row GEMVs load their whole weight tile there, the GGUF word GEMV its first chunk of
code words, the small-batch MoE down kernel its experts' rows (the router, two kernels back, has
written their ids), the rotary kernel its positions and cos/sin rows, and the decode attention
its lengths, block tables and the cached keys and values of earlier steps (the rows this step
stores are read after the wait: ``decode_attention``'s ``new_rows``). The rule that keeps it exact: before the wait a kernel reads
only what no kernel of the step writes (weights, the step's inputs) or what a kernel at least two
launches back wrote. That kernel has finished by then, because the kernel in between lets its
successor launch only after its own wait. It is off by default: measured on the H200 it loses
(Qwen3-30B-A3B batch 1: 318 against 365 output tok/s; guide 08). ``DEEPINFER_PDL_PREFETCH=1``
turns it on; off, the one-row GEMVs preload their first weight tile as before. Triton's
interpreter checks both forms in CI, and tests/runtime/test_sm90_compile.py compiles them for
sm_90.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from deepinfer.runtime import switches

try:  # Triton >= 3.4 (torch 2.8's and later)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL stays off
    gdc_wait = gdc_launch_dependents = None


@triton.jit
def pdl_begin(PDL: tl.constexpr):
    """At a kernel's start: wait for the previous kernel, then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


# Bytes a thread may hold preloaded (a program's tile / its threads), at most: 32 registers (64
# bf16 weights, 32 GGUF code words); beyond it the registers cost more occupancy than the
# overlap wins back (a guess until measured).
PREFETCH_MAX_BYTES_PER_THREAD = 128


def prefetch_enabled() -> bool:
    """``DEEPINFER_PDL_PREFETCH``: whether kernels preload before their wait what they may."""
    return switches.enabled("DEEPINFER_PDL_PREFETCH")


def prefetch_fits(nbytes: int, num_warps: int) -> bool:
    """Whether a program that would preload ``nbytes`` before its wait does: the switch is on and
    they fit in PREFETCH_MAX_BYTES_PER_THREAD a thread."""
    return prefetch_enabled() and nbytes <= PREFETCH_MAX_BYTES_PER_THREAD * 32 * num_warps


_ENABLED: dict[int, bool] = {}


def pdl_enabled(device: torch.device) -> bool:
    """True where the kernels launch with PDL: a CUDA device of compute capability >= 9, a Triton
    that has the grid-dependency ops, not Triton's CPU interpreter, and ``DEEPINFER_PDL`` not 0."""
    if device.type != "cuda" or gdc_wait is None or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if not switches.enabled("DEEPINFER_PDL"):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _ENABLED:
        _ENABLED[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _ENABLED[index]


def pdl_launch(device: torch.device) -> dict[str, Any]:
    """The constexpr and launch option of a PDL kernel on ``device``: ``kernel[grid](..., **pdl_launch(dev))``."""
    on = pdl_enabled(device)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}
