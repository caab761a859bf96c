"""Speculative verify steps replayed from CUDA graphs.

A verify step (each sequence's last token and its k drafts) is replayed as a decode graph over
one row per query token (``verify_rows``: per-row context lengths give the causal mask inside
the k + 1 queries). The graphs are ordinary ``CudaGraphRunner`` decode graphs over a StepBuffers
of their own, sized for B x (k + 1) rows, captured for the decode graph sizes times k + 1 only
(``verify_rows.verify_graph_sizes``). A step whose shape has no graph (more rows than the
largest size, a sequence with more than k + 1 queries) runs eagerly, as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from deepinfer.runtime.host_to_device import host_to_device
from deepinfer.runtime.worker.cuda_graph_runner import CudaGraphRunner
from deepinfer.runtime.worker.step_buffers import StepBuffers
from deepinfer.runtime.worker.verify_rows import (
    expand_verify_rows,
    padded_size,
    verify_graph_sizes,
    verify_row_count,
)

if TYPE_CHECKING:
    from deepinfer.runtime.worker.model_runner import ModelRunner


class VerifyGraphRunner:
    """Verify graphs of ``runner`` for ``k`` drafts per sequence (``sizes``: padded row counts)."""

    def __init__(self, runner: ModelRunner, block_table_width: int, k: int, sizes: list[int],
                 max_model_len: int | None = None) -> None:
        if not sizes:
            raise ValueError("VerifyGraphRunner: no capture sizes")
        self.runner, self.k, self.sizes = runner, k, sorted(set(sizes))
        most = self.sizes[-1]
        self.buffers = StepBuffers(most, most, block_table_width, pin=runner.device.type == "cuda")
        # a row's context ends with up to k + 1 keys and values that this step stores
        self.graphs = CudaGraphRunner(runner, self.buffers, self.sizes, fused=True, timer=None,
                                      max_model_len=max_model_len, new_rows=k + 1)
        self.num_replays = 0

    def capture(self) -> None:
        self.graphs.capture()

    def rows_for(self, args: Any, arrays: dict[str, np.ndarray]) -> tuple[int, int] | None:
        """(real rows T, padded size) of the step, or None when no graph takes it."""
        n = int(args.num_rows) or int(args.num_seqs)
        t = verify_row_count(arrays["query_start_loc"], arrays["seq_lens"], n, self.k + 1)
        if t is None or t != int(args.num_tokens):
            return None
        p = padded_size(t, self.sizes)
        return None if p is None else (t, p)

    def try_replay(self, args: Any, arrays: dict[str, np.ndarray]) -> torch.Tensor | None:
        """The step's logits rows (``logits_indices``; model dtype, device tensors the next
        replay overwrites) from a verify graph, or None when no graph takes the step."""
        return self.replay_arrays(int(args.num_rows) or int(args.num_seqs), int(args.num_tokens), arrays,
                                  arrays["logits_indices"][:int(args.num_logits)])

    def replay_arrays(self, num_seqs: int, num_tokens: int, arrays: dict[str, np.ndarray],
                      logits_indices: np.ndarray) -> torch.Tensor | None:
        """``try_replay`` for a step given as arrays (the StepBuffers names: ``input_ids``,
        ``positions``, ``slot_mapping``, ``query_start_loc``, ``seq_lens``, ``block_tables``)."""
        t = verify_row_count(arrays["query_start_loc"], arrays["seq_lens"], num_seqs, self.k + 1)
        if t is None or t != num_tokens:
            return None
        p = padded_size(t, self.sizes)
        if p is None:
            return None
        expand_verify_rows(arrays, num_seqs, self.buffers.arrays, p)
        logits, _ = self.graphs.replay(p)
        self.num_replays += 1
        li = np.asarray(logits_indices)
        if len(li) == t and np.array_equal(li, np.arange(t)):
            return logits[:t]
        return logits[host_to_device(li, logits.device)]


def capture_verify_graphs(runner: ModelRunner, block_table_width: int, k: int, decode_sizes: list[int],
                          max_rows: int, max_model_len: int | None = None, *, draft: bool = False
                          ) -> VerifyGraphRunner | None:
    """Capture the verify graphs of ``runner`` (which must have its decode graphs) and install
    them as ``runner.verify_graphs``; None (eager verify steps) when the runner has no decode graphs.

    ``draft``: ``runner`` is a draft model's (no decode graphs of its own): its catch-up forwards
    (up to k + 1 tokens a sequence) and one-token forwards both replay these graphs, captured for
    the decode sizes too (a one-token forward of B sequences pads to B rows, not B x (k + 1))."""
    if draft:
        if not getattr(runner.model, "supports_decode_graphs", True):
            return None
        try:
            import triton  # noqa: F401
        except ImportError:
            return None
        sizes = sorted({s for s in decode_sizes if s <= max_rows} | set(verify_graph_sizes(decode_sizes, k, max_rows)))
    elif getattr(runner, "graphs", None) is None:
        return None
    else:
        sizes = verify_graph_sizes(decode_sizes, k, max_rows)
    vg = VerifyGraphRunner(runner, block_table_width, k, sizes, max_model_len=max_model_len)
    vg.capture()
    runner.verify_graphs = vg
    return vg
