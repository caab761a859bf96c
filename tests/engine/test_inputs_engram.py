"""Engram: lookup table, encode_compressed and the builders' n-gram hash indices vs numpy."""

from __future__ import annotations

import random

import numpy as np
import pytest
from deepinfer_engine import _engine as E
from inputs_helpers import make_args, make_buffers, pool_of
from inputs_reference.engram import EngramRef, engram_rows
from inputs_reference.layout import RefRow, reference_layout
from test_inputs_prepare import check_against_reference

VOCAB = 500


@pytest.fixture
def table():
    rng = np.random.default_rng(0)
    t = rng.integers(0, 120, VOCAB)  # many tokens share a compressed id
    E.set_engram_lookup_table(t, VOCAB)
    yield t
    E.set_engram_lookup_table(None, 1)


def test_encode_compressed_matches_numpy(table):
    ids = np.random.default_rng(1).integers(0, VOCAB, 1000)
    np.testing.assert_array_equal(E.encode_compressed(ids), table[ids])
    np.testing.assert_array_equal(E.encode_compressed(ids.astype(np.int32).tolist()), table[ids])
    out = np.full(1200, -1, np.int32)
    assert E.encode_compressed(ids, out) is out
    np.testing.assert_array_equal(out[:1000], table[ids])
    assert (out[1000:] == -1).all()


def test_encode_compressed_bad_input_writes_nothing(table):
    out = np.full(3, -1, np.int32)
    with pytest.raises(ValueError, match=r"token_ids\[1\]"):
        E.encode_compressed([1, VOCAB, 2], out)
    assert (out == -1).all()
    with pytest.raises(ValueError, match="out"):
        E.encode_compressed([1, 2, 3, 4], out)
    with pytest.raises(TypeError, match="token_ids"):
        E.encode_compressed(np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match="out"):
        E.encode_compressed([1], np.zeros(3, np.int64))


def test_table_validation_keeps_previous_table(table):
    with pytest.raises(ValueError, match="table"):
        E.set_engram_lookup_table(np.arange(VOCAB - 1), VOCAB)
    with pytest.raises(ValueError, match=r"table\[3\]"):
        E.set_engram_lookup_table([0, 1, 2, VOCAB, 4], 5)
    with pytest.raises(TypeError, match="table"):
        E.set_engram_lookup_table(np.zeros(VOCAB, np.float32), VOCAB)
    np.testing.assert_array_equal(E.encode_compressed([5, 6]), table[[5, 6]])  # unchanged
    E.set_engram_lookup_table(None, 1)
    with pytest.raises(ValueError, match="no Engram lookup table"):
        E.encode_compressed([1])


CFG = EngramRef(orders=[2, 3], heads=2, seeds=[11, 2**63 + 5], table_sizes=[1009, 65521])


def engram_args(bufs, **kw):
    return make_args(bufs, engram_ngram_orders=CFG.orders, engram_heads_per_order=CFG.heads,
                     engram_layer_seeds=CFG.seeds, engram_table_sizes=CFG.table_sizes, **kw)


def test_hash_indices_across_chunk_and_step_boundaries(table):
    rng = random.Random(2)
    prompt = [rng.randrange(VOCAB) for _ in range(50)]
    whole = engram_rows(prompt, range(50), CFG, table)
    bufs = make_buffers(max_tokens=64, max_seqs=4, width=8, engram_cols=CFG.num_columns)
    args = engram_args(bufs)
    assert args.engram_num_columns == CFG.num_columns == 8
    got = []
    for start, end in [(0, 7), (7, 8), (8, 31), (31, 50)]:
        E.prepare_prompt_v4(args, pool_of([RefRow(1, "a", prompt, 50, start, end - start, [0, 1, 2, 3])]))
        got.extend(bufs["engram_indices"][: end - start].tolist())
    assert got == whole
    # Decode steps continue the history; first position uses padding.
    toks = prompt + [rng.randrange(VOCAB)]
    E.prepare_decode_v4(args, pool_of([RefRow(1, "a", toks, 50, 50, 1, [0, 1, 2, 3])]))
    assert bufs["engram_indices"][0].tolist() == engram_rows(toks, [50], CFG, table)[0]
    assert whole[0] != whole[1]


@pytest.mark.parametrize("seed", range(10))
def test_random_batches_with_engram_match_reference(seed, table):
    rng = random.Random(50 + seed)
    rows = []
    for i in range(rng.randint(1, 8)):
        P = rng.randint(2, 60)
        toks = [rng.randrange(VOCAB) for _ in range(P)]
        if rng.random() < 0.5:
            start = rng.randrange(0, P - 1)
            r = RefRow(i, f"r{i}", toks, P, start, rng.randint(1, P - start), list(range(8)))
        else:
            drafts = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 3))]
            r = RefRow(i, f"r{i}", toks, max(1, P - 5), P - 1, 1 + len(drafts), list(range(8)), drafts=drafts,
                       is_prompt=False)
        rows.append(r)
    bufs = make_buffers(max_tokens=512, max_seqs=8, width=8, engram_cols=CFG.num_columns)
    args = engram_args(bufs, block_size=16)
    n = E.prepare_prompt_v4(args, pool_of(rows))
    ref = reference_layout(rows, block_size=16, width=8, engram=CFG, engram_table=table)
    check_against_reference(args, bufs, rows, ref, n)
