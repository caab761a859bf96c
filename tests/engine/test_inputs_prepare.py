"""prepare_prompt_v4 / prepare_decode_v4 against the pure-Python layout reference."""

from __future__ import annotations

import random

import numpy as np
import pytest
from deepinfer_engine import _engine as E
from inputs_helpers import make_args, make_buffers, pool_of, random_row
from inputs_reference.layout import RefRow, reference_layout


def check_against_reference(args, bufs, rows, ref, n_tokens):
    assert n_tokens == args.num_tokens == len(ref["input_ids"])
    T, R, G = args.num_tokens, args.num_rows, args.num_logits
    assert R == ref["num_rows"] and args.num_seqs == len(rows)
    assert G == len(ref["logits_indices"])
    np.testing.assert_array_equal(bufs["input_ids"][:T], ref["input_ids"])
    np.testing.assert_array_equal(bufs["positions"][:T], ref["positions"])
    np.testing.assert_array_equal(bufs["slot_mapping"][:T], ref["slot_mapping"])
    np.testing.assert_array_equal(bufs["query_start_loc"][: R + 1], ref["query_start_loc"])
    np.testing.assert_array_equal(bufs["seq_lens"][:R], ref["seq_lens"])
    np.testing.assert_array_equal(bufs["block_tables"][:R], ref["block_tables"])
    np.testing.assert_array_equal(bufs["logits_indices"][:G], ref["logits_indices"])
    if "yoco_kept_rows" in ref:
        K = args.num_yoco_rows
        np.testing.assert_array_equal(bufs["yoco_kept_rows"][:K], ref["yoco_kept_rows"])
        np.testing.assert_array_equal(bufs["yoco_cu_seqlens"][: R + 1], ref["yoco_cu_seqlens"])
    if "engram_indices" in ref and T:
        np.testing.assert_array_equal(bufs["engram_indices"][:T], ref["engram_indices"])


def test_hand_computed_mixed_step():
    # Block size 4. Row 0: prompt [10, 11, 12, 13, 14] first chunk of 3 tokens, blocks [7, 9].
    # Row 1: decode of a 6-token sequence (prompt 4), blocks [2, 5]: position 5 -> block 5 slot 1.
    bufs = make_buffers(max_tokens=16, max_seqs=4, width=3)
    args = make_args(bufs, block_size=4)
    rows = [RefRow(1, "a", [10, 11, 12, 13, 14], 5, 0, 3, [7, 9]),
            RefRow(2, "b", [1, 2, 3, 4, 5, 6], 4, 5, 1, [2, 5])]
    assert E.prepare_prompt_v4(args, pool_of(rows)) == 4
    assert bufs["input_ids"][:4].tolist() == [10, 11, 12, 6]
    assert bufs["positions"][:4].tolist() == [0, 1, 2, 5]
    assert bufs["slot_mapping"][:4].tolist() == [28, 29, 30, 21]
    assert bufs["query_start_loc"][:3].tolist() == [0, 3, 4]
    assert bufs["seq_lens"][:2].tolist() == [3, 6]
    assert bufs["block_tables"][:2].tolist() == [[7, 9, 0], [2, 5, 0]]
    # Row 0's chunk does not reach the prompt end: only the decode row has logits.
    assert args.num_logits == 1 and bufs["logits_indices"][0] == 3


def test_hand_computed_decode_padding():
    bufs = make_buffers(max_tokens=16, max_seqs=8, width=2)
    args = make_args(bufs, block_size=4, graph_batch_sizes=[1, 2, 4, 8])
    rows = [RefRow(i, f"r{i}", [5, 6, 7], 2, 2, 1, [i + 1]) for i in range(3)]
    assert E.prepare_decode_v4(args, pool_of(rows)) == 4
    assert (args.num_seqs, args.num_rows, args.num_logits) == (3, 4, 4)
    assert bufs["slot_mapping"][:4].tolist() == [6, 10, 14, -1]
    assert bufs["positions"][:4].tolist() == [2, 2, 2, 0]
    assert bufs["seq_lens"][:4].tolist() == [3, 3, 3, 1]
    assert bufs["query_start_loc"][:5].tolist() == [0, 1, 2, 3, 4]
    assert bufs["logits_indices"][:4].tolist() == [0, 1, 2, 3]
    assert args.row_seq_ids.tolist() == [0, 1, 2, -1]


@pytest.mark.parametrize("seed", range(40))
def test_random_mixed_batches_match_reference(seed):
    rng = random.Random(seed)
    rows = [random_row(rng, i, 16) for i in range(rng.randint(1, 12))]
    # A fork: a child sharing the parent's full blocks.
    if rng.random() < 0.3:
        parent = rows[0]
        child = RefRow(**{**parent.__dict__, "seq_id": 999, "request_id": parent.request_id})
        child.block_table = list(parent.block_table[:-1]) + [77_777]
        rows.append(child)
    bufs = make_buffers(max_tokens=4096, max_seqs=32, width=32)
    args = make_args(bufs)
    n = E.prepare_prompt_v4(args, pool_of(rows))
    check_against_reference(args, bufs, rows, reference_layout(rows, block_size=16, width=32), n)


@pytest.mark.parametrize("seed", range(20))
def test_random_decode_batches_pad_to_graph_sizes(seed):
    rng = random.Random(100 + seed)
    spec = rng.random() < 0.4
    k = rng.randint(1, 3)
    rows = []
    for i in range(rng.randint(1, 20)):
        r = random_row(rng, i, 8, kind="decode")
        if spec:
            r.drafts = [rng.randrange(1000) for _ in range(k)]
            r.num_new = 1 + k
            r.block_table += [rng.randrange(10_000)]
        rows.append(r)
    sizes = [1, 2, 4, 8, 16]
    bufs = make_buffers(max_tokens=1024, max_seqs=32, width=48)
    args = make_args(bufs, block_size=8, graph_batch_sizes=sizes)
    n = E.prepare_decode_v4(args, pool_of(rows))
    ref = reference_layout(rows, block_size=8, width=48, graph_sizes=sizes, pad=True)
    check_against_reference(args, bufs, rows, ref, n)


@pytest.mark.parametrize("mode", ["LAST_TOKEN", "LOGITS_ROWS"])
@pytest.mark.parametrize("seed", range(8))
def test_yoco_kept_rows(mode, seed):
    rng = random.Random(200 + seed)
    rows = [random_row(rng, i, 16) for i in range(rng.randint(1, 10))]
    bufs = make_buffers(max_tokens=4096, max_seqs=16, width=32, yoco=True)
    args = make_args(bufs, yoco_mode=getattr(E.YocoPrefillTruncationMode, mode))
    n = E.prepare_prompt_v4(args, pool_of(rows))
    check_against_reference(args, bufs, rows, reference_layout(rows, block_size=16, width=32, yoco=mode), n)


def test_block_table_rows_rewritten_only_when_changed():
    rng = random.Random(7)
    bufs = make_buffers(max_tokens=256, max_seqs=8, width=16)
    args = make_args(bufs, block_size=4)
    rows = [random_row(rng, i, 4, kind="decode", max_len=30) for i in range(6)]
    E.prepare_decode_v4(args, pool_of(rows))
    assert args.num_block_rows_written == 6
    E.prepare_decode_v4(args, pool_of(rows))  # nothing changed
    assert args.num_block_rows_written == 6
    # Row 2 grows by a block, row 4 is replaced by another sequence with fewer blocks.
    rows[2].tokens.append(1)
    rows[2].start += 1
    rows[2].block_table.append(4242)
    rows[4] = RefRow(50, "x", [1, 2, 3], 2, 2, 1, [31])
    n = E.prepare_decode_v4(args, pool_of(rows))
    assert args.num_block_rows_written == 8
    check_against_reference(args, bufs, rows, reference_layout(rows, block_size=4, width=16), n)
    # Fewer rows then more again: the stale rows come back zero-padded correctly.
    E.prepare_decode_v4(args, pool_of(rows[:2]))
    n = E.prepare_decode_v4(args, pool_of(rows))
    check_against_reference(args, bufs, rows, reference_layout(rows, block_size=4, width=16), n)


def test_buffers_may_be_torch_tensor_views_written_in_place():
    torch = pytest.importorskip("torch", reason="torch is needed to make tensor views (not installed)")
    T, S, W = 64, 4, 8
    tensors = dict(input_ids=torch.zeros(T, dtype=torch.int32), positions=torch.zeros(T, dtype=torch.int32),
                   slot_mapping=torch.zeros(T, dtype=torch.int64), query_start_loc=torch.zeros(S + 1, dtype=torch.int32),
                   seq_lens=torch.zeros(S, dtype=torch.int32), block_tables=torch.full((S, W), 9, dtype=torch.int32),
                   logits_indices=torch.zeros(T, dtype=torch.int32))
    args = E.PrepareArgs(block_size=4, max_model_len=64, **{k: v.numpy() for k, v in tensors.items()})
    rows = [RefRow(1, "a", [10, 11, 12, 13, 14], 5, 0, 5, [3, 4])]
    E.prepare_prompt_v4(args, pool_of(rows))
    assert tensors["input_ids"][:5].tolist() == [10, 11, 12, 13, 14]
    assert tensors["slot_mapping"][:5].tolist() == [12, 13, 14, 15, 16]
    assert tensors["block_tables"][0].tolist() == [3, 4, 0, 0, 0, 0, 0, 0]
    # A transposed (non-contiguous) view is refused, not copied.
    with pytest.raises(ValueError, match="block_tables"):
        E.PrepareArgs(block_size=4, max_model_len=64,
                      **{**{k: v.numpy() for k, v in tensors.items()},
                         "block_tables": torch.zeros(W, S, dtype=torch.int32).t().numpy()})
