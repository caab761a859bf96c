"""The engine's per-step input buffers, laid out in one host allocation (pinned on CUDA).

``prepare_*`` writes a step's inputs into numpy views of this allocation. The CUDA graph runner
keeps a device twin with the same byte layout, so a decode step's inputs reach the device in one
host-to-device copy (the token arrays first, the block-table rows of the batch last).
"""

from __future__ import annotations

import numpy as np
import torch

# name -> (dtype, per-row count kind): "t" token rows, "s" sequence rows, "s1" sequence rows + 1
_TOKEN_ARRAYS = (("input_ids", np.int32), ("positions", np.int32), ("slot_mapping", np.int64),
                 ("logits_indices", np.int32), ("zos_source_index", np.int32))
_SEQ_ARRAYS = (("query_start_loc", np.int32, 1), ("seq_lens", np.int32, 0))


def _align(n: int, a: int = 64) -> int:
    return -(-n // a) * a


class StepBuffers:
    """Host buffers for ``max_tokens`` token rows and ``max_seqs`` sequences of ``width`` block-table
    entries. ``arrays`` holds the numpy views (the PrepareArgs buffers); ``offsets`` their byte
    offsets; ``host`` the whole allocation as a uint8 tensor (pinned when ``pin``)."""

    def __init__(self, max_tokens: int, max_seqs: int, width: int, pin: bool = False) -> None:
        self.max_tokens, self.max_seqs, self.width = max_tokens, max_seqs, width
        layout: list[tuple[str, np.dtype, tuple[int, ...]]] = []
        for tname, tdt in _TOKEN_ARRAYS:
            layout.append((tname, np.dtype(tdt), (max_tokens,)))
        for sname, sdt, extra in _SEQ_ARRAYS:
            layout.append((sname, np.dtype(sdt), (max_seqs + extra,)))
        layout.append(("block_tables", np.dtype(np.int32), (max_seqs, width)))  # last: copied by rows
        self.offsets: dict[str, int] = {}
        self.layout = layout
        pos = 0
        for name, dt, shape in layout:
            self.offsets[name] = pos
            pos = _align(pos + dt.itemsize * int(np.prod(shape)))
        self.nbytes = pos
        self.host = torch.zeros(pos, dtype=torch.uint8, pin_memory=pin)
        raw = self.host.numpy()
        self.arrays: dict[str, np.ndarray] = {}
        for name, dt, shape in layout:
            n = int(np.prod(shape)) * dt.itemsize
            self.arrays[name] = raw[self.offsets[name]:self.offsets[name] + n].view(dt).reshape(shape)

    def bytes_for_batch(self, rows: int) -> int:
        """Bytes from the start that hold every array plus the first ``rows`` block-table rows."""
        return self.offsets["block_tables"] + rows * self.width * 4

    def device_views(self, dev: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of a device uint8 tensor of the same layout, one per array, with the array's dtype."""
        tdt = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}
        views = {}
        for name, dt, shape in self.layout:
            n = int(np.prod(shape)) * dt.itemsize
            views[name] = dev[self.offsets[name]:self.offsets[name] + n].view(tdt[dt]).view(shape)
        return views


def step_buffer_dims(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                     block_size: int) -> tuple[int, int, int]:
    """(token rows, sequences, block-table width) of the engine's step buffers: every rank's
    worker and the engine loop size them with this one function (a replayed decode graph's
    bytes are rank 0's buffers copied into the other ranks')."""
    return (max(max_num_batched_tokens, max_num_seqs), max_num_seqs, -(-max_model_len // block_size))
