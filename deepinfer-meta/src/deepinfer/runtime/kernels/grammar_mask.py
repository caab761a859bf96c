"""Structured outputs' token bitmask applied on the GPU: one copy up and one launch per step.

The grammar's allowed tokens come as a packed int32 bitmask (bit ``t % 32`` of word ``t // 32``
set = token ``t`` allowed, xgrammar's layout), one row per structured sample row. Unpacking it
with torch ops costs about ten launches a step (and a [G, W, 32] bool temporary); these kernels
read the packed words directly. What a step sends up is one flat int32 buffer (``packed``):

    [count, row_0 .. row_{capacity-1}, mask words of rows 0 .. count-1 (``words`` each)]

so the rows and their masks go in one host-to-device copy, and a buffer of fixed ``capacity``
serves any ``count <= capacity`` (programs past ``count`` do nothing).

- ``masked_argmax_``: for a greedy step, each structured row's argmax over its allowed tokens,
  written into the step's token tensor in place (the other rows keep the plain argmax);
- ``MaskedArgmaxGraphs``: the same kernel captured once per decode graph (its logits and token
  buffers are static), replayed for the price of one graph launch: a Triton launch from Python
  costs several times more host time, which a batch-1 step of a small model cannot hide;
- ``mask_logits_``: for a sampled step, the tokens a row does not allow set to -inf in place.

Ties go to the lowest token id, as ``torch.argmax``; a row that allows nothing gets token 0 (as
``torch.argmax`` of an all -inf row). CPU tensors take the torch path in ``sampling.sampler``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import triton
import triton.language as tl

BLOCK = 2048  # vocabulary tokens per loop iteration (64 packed words)
_log = logging.getLogger(__name__)


@triton.jit
def _masked_argmax_kernel(logits_ptr, stride_l, tokens_ptr, packed_ptr, vocab, words, capacity,
                          BLOCK: tl.constexpr):
    g = tl.program_id(0)
    if g < tl.load(packed_ptr):
        row = tl.load(packed_ptr + 1 + g).to(tl.int64)
        mask_ptr = packed_ptr + 1 + capacity + g.to(tl.int64) * words
        best = tl.full((), float("-inf"), tl.float32)
        best_id = tl.full((), 0, tl.int64)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < vocab
            w = tl.load(mask_ptr + cols // 32, mask=inside, other=0)
            allowed = ((w >> (cols % 32)) & 1) != 0
            x = tl.load(logits_ptr + row * stride_l + cols, mask=inside & allowed, other=float("-inf")).to(tl.float32)
            m = tl.max(x, axis=0)
            i = tl.argmax(x, axis=0, tie_break_left=True)  # first maximum within the block
            take = m > best  # strictly greater: an earlier block keeps a tie
            best_id = tl.where(take, (start + i).to(tl.int64), best_id)
            best = tl.where(take, m, best)
        tl.store(tokens_ptr + row, best_id.to(tokens_ptr.dtype.element_ty))


@triton.jit
def _mask_logits_kernel(logits_ptr, stride_l, rows_ptr, mask_ptr, stride_m, vocab, BLOCK: tl.constexpr):
    g = tl.program_id(0)
    row = tl.load(rows_ptr + g).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    words = tl.load(mask_ptr + g * stride_m + cols // 32, mask=inside, other=-1)
    refused = inside & (((words >> (cols % 32)) & 1) == 0)
    ninf = tl.full((BLOCK,), float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_l + cols, ninf, mask=refused)


def packed_size(capacity: int, count: int, words: int) -> int:
    """int32 words of a packed buffer of ``capacity`` row slots holding ``count`` masks."""
    return 1 + capacity + count * words


def _check_logits(logits: torch.Tensor, words: int) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"grammar mask: logits must be [R, V] with contiguous rows, got {tuple(logits.shape)}")
    if words * 32 < logits.shape[1]:
        raise ValueError(f"grammar mask: a bitmask of {words} words covers fewer than the "
                         f"{logits.shape[1]} tokens of the logits")


def masked_argmax_(tokens: torch.Tensor, logits: torch.Tensor, packed: torch.Tensor, capacity: int,
                   words: int) -> torch.Tensor:
    """``tokens[row_g]`` = the argmax of ``logits[row_g]`` over the tokens mask g allows, for each
    of the ``packed`` buffer's rows (layout in the module docstring); ``tokens`` [R] (any integer
    dtype) is changed in place and returned. The rows must be < R (the caller's)."""
    _check_logits(logits, words)
    if packed.dtype != torch.int32 or packed.dim() != 1 or packed.shape[0] < 1 + capacity:
        raise ValueError(f"grammar mask: packed must be a flat int32 buffer of at least {1 + capacity} words, "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    if capacity:
        _masked_argmax_kernel[(capacity,)](logits, logits.stride(0), tokens, packed, logits.shape[1], words, capacity,
                                           BLOCK=BLOCK, num_warps=8)
    return tokens


class MaskedArgmaxGraphs:
    """``masked_argmax_`` captured once per (logits, tokens) pair of static buffers (a decode
    graph's outputs), each with its own static packed buffer of ``capacity`` = the graph's rows.
    A pair whose capture fails is launched directly from then on (logged once): slower, never
    wrong, and never a failed step."""

    def __init__(self) -> None:
        self._graphs: dict[tuple[int, int, int], tuple[Any, torch.Tensor] | None] = {}

    def __len__(self) -> int:
        return sum(1 for g in self._graphs.values() if g is not None)

    def run(self, tokens: torch.Tensor, logits: torch.Tensor, host_packed: torch.Tensor, words: int) -> torch.Tensor:
        """Copy ``host_packed`` (capacity = ``logits.shape[0]`` rows) up and replay the capture."""
        capacity = int(logits.shape[0])
        key = (logits.data_ptr(), tokens.data_ptr(), capacity)
        if key not in self._graphs:
            try:
                self._graphs[key] = self._capture(tokens, logits, capacity, words)
            except Exception as exc:  # noqa: BLE001 - any capture failure: launch directly instead
                _log.warning("grammar mask: capturing the masked argmax for %d rows failed (%s: %s); "
                             "it is launched directly", capacity, type(exc).__name__, exc)
                self._graphs[key] = None
        hit = self._graphs[key]
        if hit is None:
            return masked_argmax_(tokens, logits, host_packed.to(logits.device, non_blocking=True), capacity, words)
        graph, static = hit
        n = int(host_packed.shape[0])
        if n > static.shape[0]:
            raise ValueError(f"grammar mask: {n} packed words for a capture of {static.shape[0]}")
        static[:n].copy_(host_packed, non_blocking=True)
        graph.replay()
        return tokens

    @staticmethod
    def _capture(tokens: torch.Tensor, logits: torch.Tensor, capacity: int, words: int) -> tuple[Any, torch.Tensor]:
        static = torch.zeros(packed_size(capacity, capacity, words), dtype=torch.int32, device=logits.device)
        masked_argmax_(tokens, logits, static, capacity, words)  # compiles the kernel (count 0: writes nothing)
        stream = torch.cuda.Stream(logits.device)
        stream.wait_stream(torch.cuda.current_stream(logits.device))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            masked_argmax_(tokens, logits, static, capacity, words)
        torch.cuda.current_stream(logits.device).wait_stream(stream)
        return graph, static


def mask_logits_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits[rows[g], t]`` = -inf for every token t that ``bitmask[g]`` does not allow, in place."""
    _check_logits(logits, int(bitmask.shape[-1]))
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32 or bitmask.stride(1) != 1:
        raise ValueError(f"grammar mask: bitmask must be int32 [G, W] with contiguous rows, got "
                         f"{bitmask.dtype} {tuple(bitmask.shape)}")
    if rows.dim() != 1 or rows.shape[0] != bitmask.shape[0]:
        raise ValueError(f"grammar mask: {tuple(rows.shape)} rows for a bitmask of {bitmask.shape[0]} rows")
    if rows.numel():
        grid = (rows.shape[0], triton.cdiv(logits.shape[1], BLOCK))
        _mask_logits_kernel[grid](logits, logits.stride(0), rows, bitmask, bitmask.stride(0), logits.shape[1],
                                  BLOCK=BLOCK, num_warps=4)
    return logits
