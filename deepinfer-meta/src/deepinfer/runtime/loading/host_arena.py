"""One block of host memory for a CPU model's parameters, on 2 MiB pages where the OS allows.

A CPU decode step streams every weight once per token: with 4 KiB pages the default model's
float32 weights are ~130,000 pages per token, each a TLB miss and a page-table walk, and the
hardware prefetcher stops at every page boundary. With the weights on 2 MiB transparent huge
pages the native float32 step measured ~12 % faster (rounds interleaved in one process; see
docs/guide/05). Linux only: a private anonymous mapping with ``MADV_HUGEPAGE`` (honoured when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``); pages are given
on first write, so parameters that are never written (replaced by quantized layers) cost nothing.
Elsewhere, or with ``DEEPINFER_CPU_HUGE_PAGES=0``, ``host_arena_tensors`` returns None and the
caller allocates as usual.

The first write of a 2 MiB page costs the kernel a 2 MiB clear, and on some VMs the host backs
the page on first use (~2.4 ms a page measured on the 2-core VM of docs/guide/05: a float32 load
of the default model 0.7 -> 2.2 s there; the page-clearing cost alone is ~0.1 s).
"""

from __future__ import annotations

import math
import mmap
import sys

import torch

from deepinfer.runtime import switches

ENV_SWITCH = "DEEPINFER_CPU_HUGE_PAGES"
HUGE_PAGE = 2 << 20
_ALIGN = 64  # bytes, as torch's own CPU allocator


def host_arena_tensors(shapes: list[torch.Size], dtype: torch.dtype) -> list[torch.Tensor] | None:
    """Uninitialised CPU tensors of ``shapes`` in ``dtype``, views of one huge-page-backed mapping
    (kept alive by the views), or None where that is not available."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    if not switches.enabled(ENV_SWITCH):
        return None
    itemsize = dtype.itemsize
    offsets, end = [], 0
    for shape in shapes:
        end = -(-end // _ALIGN) * _ALIGN
        offsets.append(end)
        end += math.prod(shape) * itemsize
    if end < HUGE_PAGE:
        return None
    try:
        # one spare huge page: the views start at the first 2 MiB boundary of the mapping
        buf = mmap.mmap(-1, end + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return None
    raw = torch.frombuffer(buf, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    out = []
    for shape, off in zip(shapes, offsets, strict=True):
        nbytes = math.prod(shape) * itemsize
        out.append(raw[start + off:start + off + nbytes].view(dtype).view(shape))
    return out
