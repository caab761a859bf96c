"""numpy reference of Engram's compressed ids and n-gram hash indices (see csrc/step/engram.h)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

K1 = 0x9E3779B97F4A7C15
K2 = 0xC2B2AE3D27D4EB4F
K3 = 0x100000001B3
PAD = 0xFFFFFFFF


@dataclass
class EngramRef:
    orders: list[int]
    heads: int
    seeds: list[int]
    table_sizes: list[int]

    @property
    def num_columns(self):
        return len(self.seeds) * len(self.orders) * self.heads


def engram_rows(tokens, positions, cfg: EngramRef, table):
    """Hash-index rows of `positions` of a sequence whose token ids are `tokens`, vectorised over
    positions with numpy uint64 arithmetic (wrapping, like the C++)."""
    positions = np.asarray(list(positions), np.int64)
    if positions.size == 0:
        return []
    comp = np.asarray(table, np.uint64)[np.asarray(tokens, np.int64)]
    cols = []
    with np.errstate(over="ignore"):
        for seed in cfg.seeds:
            for n, size in zip(cfg.orders, cfg.table_sizes):
                for h in range(cfg.heads):
                    init = (seed + n * K1 + (h + 1) * K2) % (1 << 64)
                    x = np.full(positions.shape, init, np.uint64)
                    for i in range(n):
                        q = positions - n + 1 + i
                        c = np.where(q >= 0, comp[np.maximum(q, 0)], np.uint64(PAD))
                        x = (x ^ c) * np.uint64(K3)
                    x ^= x >> np.uint64(31)
                    cols.append((x % np.uint64(size)).astype(np.int64))
    return np.stack(cols, axis=1).astype(np.int32).tolist()
