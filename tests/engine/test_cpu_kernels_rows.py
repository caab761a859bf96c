"""``DecodeModel.decode`` over token rows (``table_rows=``, ``logit_rows=``): a prompt chunk as one
row per token against the numpy reference; a row's logits and KV entries bitwise the same
computed alone (one token per step) as in a step with any other rows (batch invariance, every
instruction set, 1-2 threads); logit_rows picks rows bitwise; bad indices are ValueErrors."""

from __future__ import annotations

import numpy as np
import pytest

# (skips this module too where the engine has no _cpu_kernels or gguf is missing)
from test_cpu_kernels import BS, ISAS, KV_HEADS, LAYERS, D, RandomModel, V


def _prompt_rows(tables, seq, start, n):
    """Rows for tokens start..start+n-1 of sequence ``seq``: positions, slots, lens, table rows."""
    pos = np.arange(start, start + n, dtype=np.int64)
    slots = tables[seq, pos // BS] * BS + pos % BS
    return pos, slots.astype(np.int64), pos + 1, np.full(n, seq, dtype=np.int64)


@pytest.mark.parametrize("kind, d", [("F32", D), ("Q8_0", D), ("Q4_1", D), ("Q4_0", D), ("F32", 64), ("Q8_0", 64)])
def test_token_rows_match_the_reference_and_are_batch_invariant(kind, d):
    """(The rows of one sequence attend together, each token's k/v loaded once for all of them
    and for the heads of a kv head: bitwise what each row gets alone.)"""
    rng = np.random.default_rng(7)
    model = RandomModel(rng, kind, d)
    blocks = 16
    tables = np.array([[3, 8, 1, 0], [5, 2, 11, 7], [9, 14, 6, 4]], dtype=np.int64)
    ids = [rng.integers(0, V, 9), rng.integers(0, V, 6), rng.integers(0, V, 11)]
    context = np.zeros((LAYERS, 2, blocks, BS, KV_HEADS, d), np.float32)
    # all three prompts in one step, rows interleaved with nothing: seq 0, 1, 2 back to back
    parts = [_prompt_rows(tables, s, 0, len(ids[s])) for s in range(3)]
    pos, slots, lens, trow = (np.concatenate([p[i] for p in parts]) for i in range(4))
    all_ids = np.concatenate(ids).astype(np.int64)
    ref = model.reference(all_ids, pos, slots, lens, tables[trow], [c.copy() for c in context])
    tol = 2e-4 if kind == "F32" else 0.05
    for isa in ISAS:
        for threads in (1, 2):
            caches = [c.copy() for c in context]
            m = model.native(caches, threads, isa)
            together = m.decode(all_ids, pos, slots, lens, tables, table_rows=trow)
            assert np.abs(together - ref).max() <= tol * np.abs(ref).max(), (kind, isa, threads)
            # logit_rows: the same rows bitwise, in the order asked
            last = np.array([8, 14, 25, 0], dtype=np.int64)
            picked = model.native([c.copy() for c in context], threads, isa).decode(
                all_ids, pos, slots, lens, tables, table_rows=trow, logit_rows=last)
            assert np.array_equal(picked, together[last])
            # alone: each token in a step of its own, sequences one after another
            alone_caches = [c.copy() for c in context]
            ma = model.native(alone_caches, threads, isa)
            alone = np.concatenate([ma.decode(all_ids[r:r + 1], pos[r:r + 1], slots[r:r + 1], lens[r:r + 1],
                                              tables[trow[r]][None]) for r in range(len(all_ids))])
            assert np.array_equal(alone, together), (kind, isa, threads)
            for a, b in zip(alone_caches, caches, strict=True):
                assert np.array_equal(a, b)


def test_no_logit_rows_gives_no_logits():
    rng = np.random.default_rng(8)
    model = RandomModel(rng, "Q8_0")
    caches = [np.zeros((2, 4, BS, KV_HEADS, D), np.float32) for _ in range(LAYERS)]
    pos, slots, lens, trow = _prompt_rows(np.array([[0, 1]], np.int64), 0, 0, 5)
    out = model.native(caches).decode(np.arange(5, dtype=np.int64), pos, slots, lens, np.array([[0, 1]], np.int64),
                                      table_rows=trow, logit_rows=np.zeros(0, np.int64))
    assert out.shape == (0, V)


def test_bad_table_rows_and_logit_rows_are_rejected():
    rng = np.random.default_rng(9)
    model = RandomModel(rng, "F32")
    caches = [np.zeros((2, 4, BS, KV_HEADS, D), np.float32) for _ in range(LAYERS)]
    m = model.native(caches)
    two = np.array([0, 1], dtype=np.int64)
    ok = dict(input_ids=two, positions=two, slot_mapping=two, seq_lens=two + 1,
              block_tables=np.zeros((1, 2), np.int64), table_rows=np.zeros(2, np.int64))
    m.decode(**ok)
    for key, value, match in [
        ("table_rows", np.array([0, 1]), r"table_rows\[1\]=1 out of range \[0, 1\)"),
        ("table_rows", np.array([-1, 0]), r"table_rows\[0\]=-1 out of range"),
        ("table_rows", np.array([0]), "table_rows: expected 2 entries"),
        ("logit_rows", np.array([2]), r"logit_rows\[0\]=2 out of range \[0, 2\)"),
        ("logit_rows", np.array([0, 1, 1]), "logit_rows: at most 2 entries"),
        ("block_tables", np.array([[9, 0]]), r"block_tables\[0, 0\]=9 out of range"),
    ]:
        with pytest.raises(ValueError, match=match):
            m.decode(**{**ok, key: value})
    with pytest.raises(TypeError, match="table_rows: expected dtype int64"):
        m.decode(**{**ok, "table_rows": np.zeros(2, np.int32)})
