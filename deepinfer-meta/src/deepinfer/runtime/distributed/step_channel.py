"""Rank 0 tells the other ranks what to run, step by step, over the control group.

Each message is a fixed header (int64[8]: op, four fields, payload length, payload dtype) and,
when the op carries data, one packed payload tensor, both sent with ``torch.distributed.broadcast``
from rank 0. An eager step packs the step's model inputs (the arrays ``ModelRunner.execute``
takes, block tables cut to the blocks the step reads) into one int64 tensor; a replayed decode
graph sends the used prefix of the engine's step buffers as bytes. Ranks > 0 never schedule.
"""

from __future__ import annotations

import datetime

import numpy as np
import torch
import torch.distributed as dist

from deepinfer.runtime.parallel.process_group import TensorParallelGroup

OP_EXECUTE, OP_COPY_BLOCKS, OP_REPLAY, OP_SHUTDOWN = 1, 2, 3, 4
_HEADER = 8
_DTYPES = {0: torch.int64, 1: torch.uint8}
_CODES = {v: k for k, v in _DTYPES.items()}
_EXECUTE_NAMES = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables",
                  "logits_indices")


def pack_execute(arrays: dict[str, np.ndarray], block_size: int) -> tuple[list[int], torch.Tensor]:
    """The fields (tokens, sequences, logits rows, block-table width) and the int64 payload of one
    ``ModelRunner.execute`` call."""
    seq_lens = np.asarray(arrays["seq_lens"])
    n_seqs = int(seq_lens.shape[0])
    tables = np.asarray(arrays["block_tables"])
    width = min(int(-(-int(seq_lens.max()) // block_size)), tables.shape[1]) if n_seqs else 0
    parts = [np.asarray(arrays[n]).reshape(-1) for n in _EXECUTE_NAMES]
    parts[5] = tables[:n_seqs, :width].reshape(-1)
    payload = np.concatenate([p.astype(np.int64, copy=False) for p in parts])
    fields = [int(np.asarray(arrays["input_ids"]).shape[0]), n_seqs, int(np.asarray(arrays["logits_indices"]).shape[0]),
              width]
    return fields, torch.from_numpy(payload)


def unpack_execute(fields: list[int], payload: torch.Tensor) -> dict[str, np.ndarray]:
    """The keyword arguments of ``ModelRunner.execute`` from ``pack_execute``'s output."""
    t, s, n_logits, width = fields[:4]
    sizes = (t, t, t, s + 1, s, s * width, n_logits)
    flat = payload.numpy()
    out: dict[str, np.ndarray] = {}
    pos = 0
    for name, size in zip(_EXECUTE_NAMES, sizes, strict=True):
        out[name] = flat[pos:pos + size]
        pos += size
    out["block_tables"] = out["block_tables"].reshape(s, width)
    return out


class StepChannel:
    """Broadcasts of rank 0's step messages over ``group.control_group``."""

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group
        self._header = torch.zeros(_HEADER, dtype=torch.int64)
        self._timeout = datetime.timedelta(seconds=group.timeout_s)

    def _broadcast(self, t: torch.Tensor, bounded: bool) -> None:
        work = dist.broadcast(t, 0, group=self.group.control_group, async_op=True)
        if bounded:
            work.wait(timeout=self._timeout)
        else:
            work.wait()

    def send(self, op: int, fields: list[int] | None = None, payload: torch.Tensor | None = None) -> None:
        """Rank 0: one message (``payload`` int64 or uint8, on the host)."""
        f = list(fields or [])
        n = 0 if payload is None else int(payload.numel())
        code = 0 if payload is None else _CODES[payload.dtype]
        self._header.copy_(torch.tensor([op, *f, *[0] * (4 - len(f)), n, code, 0], dtype=torch.int64))
        self._broadcast(self._header, bounded=True)
        if payload is not None and n:
            self._broadcast(payload.contiguous(), bounded=True)

    def leave(self) -> None:
        """Every rank, after OP_SHUTDOWN: wait until all got it, so that no rank tears its process
        group down while another still uses it (seen as an abort at exit under torchrun)."""
        work = dist.barrier(group=self.group.control_group, async_op=True)
        assert work is not None
        work.wait(timeout=self._timeout)

    def receive(self) -> tuple[int, list[int], torch.Tensor | None]:
        """Ranks > 0: the next message (waits as long as rank 0 stays idle)."""
        self._broadcast(self._header, bounded=False)
        h = self._header.tolist()
        op, fields, n, code = h[0], h[1:5], h[5], h[6]
        payload = None
        if n:
            payload = torch.empty(n, dtype=_DTYPES[code])
            self._broadcast(payload, bounded=True)
        return op, fields, payload

