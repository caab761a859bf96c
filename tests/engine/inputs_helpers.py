"""Shared helpers of the step-builder tests: buffers, random batches."""

from __future__ import annotations

import random

import numpy as np
from deepinfer_engine import _engine as E
from inputs_reference.layout import RefRow

BUFFER_NAMES = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables",
                "logits_indices")


def make_buffers(max_tokens=512, max_seqs=32, width=64, yoco=False, engram_cols=0, zos=False):
    b = dict(
        input_ids=np.full(max_tokens, -7, np.int32), positions=np.full(max_tokens, -7, np.int32),
        slot_mapping=np.full(max_tokens, -7, np.int64), query_start_loc=np.full(max_seqs + 1, -7, np.int32),
        seq_lens=np.full(max_seqs, -7, np.int32), block_tables=np.full((max_seqs, width), -7, np.int32),
        logits_indices=np.full(max_tokens, -7, np.int32),
    )
    if yoco:
        b["yoco_kept_rows"] = np.full(max_tokens, -7, np.int32)
        b["yoco_cu_seqlens"] = np.full(max_seqs + 1, -7, np.int32)
    if engram_cols:
        b["engram_indices"] = np.full((max_tokens, engram_cols), -7, np.int32)
    if zos:
        b["zos_source_index"] = np.full(max_tokens, -7, np.int32)
    return b


def make_args(bufs, block_size=16, max_model_len=4096, **kw):
    return E.PrepareArgs(block_size=block_size, max_model_len=max_model_len, **bufs, **kw)


def snapshot(bufs):
    return {k: v.copy() for k, v in bufs.items()}


def pool_of(rows):
    pool = E.SequenceMetadataPool()
    for r in rows:
        r.add_to(pool)
    return pool


def random_row(rng: random.Random, seq_id, block_size, kind=None, vocab=1000, max_len=300, next_block=None):
    """One random row: 'prefill' (first chunk, maybe prefix hit), 'chunk' (middle/last chunk),
    'decode', 'spec' (decode with drafts)."""
    kind = kind or rng.choice(["prefill", "chunk", "decode", "decode", "spec"])
    P = rng.randint(2, max_len)
    if kind in ("prefill", "chunk"):
        tokens = [rng.randrange(vocab) for _ in range(P)]
        start = 0 if kind == "prefill" and rng.random() < 0.5 else rng.randrange(0, P - 1)
        num_new = rng.randint(1, P - start)
        drafts = []
    else:
        outs = rng.randint(1, 40)
        tokens = [rng.randrange(vocab) for _ in range(P + outs)]
        drafts = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))] if kind == "spec" else []
        start = len(tokens) - 1
        num_new = 1 + len(drafts)
    end = start + num_new
    nblocks = -(-end // block_size) + rng.randint(0, 2)
    table = [next_block() for _ in range(nblocks)] if next_block else rng.sample(range(10_000), nblocks)
    sampling = {}
    if rng.random() < 0.5:
        sampling = dict(temperature=rng.choice([0.0, 0.7, 1.0]), top_k=rng.choice([-1, 5, 50]),
                        top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.1]),
                        seed=rng.choice([None, rng.randrange(1 << 30)]))
    return RefRow(seq_id=seq_id, request_id=f"req-{seq_id}", tokens=tokens, num_prompt=P, start=start,
                  num_new=num_new, block_table=table, drafts=drafts,
                  prompt_logprobs=rng.choice([-1, -1, -1, 2]) if kind in ("prefill", "chunk") else -1,
                  sampling=sampling)
