"""Bad input: every borrowed buffer and every row check raises an exception naming the argument,
and a rejected call writes nothing."""

from __future__ import annotations

import numpy as np
import pytest
from deepinfer_engine import _engine as E
from inputs_helpers import BUFFER_NAMES, make_args, make_buffers, pool_of, snapshot
from inputs_reference.layout import RefRow

ONE_D = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "logits_indices")


def bad_variants(name, arr):
    """(description, replacement, exception) for one buffer."""
    other = np.float32 if arr.dtype != np.float32 else np.int32
    yield "dtype", arr.astype(other), TypeError
    yield "int64-vs-32", arr.astype(np.int64 if arr.dtype == np.int32 else np.int32), TypeError
    yield "ndim", arr.reshape(1, *arr.shape) if arr.ndim == 1 else arr.reshape(-1), ValueError
    big = np.zeros((arr.shape[0] * 2,) + arr.shape[1:], arr.dtype)
    yield "strided", big[::2], ValueError
    ro = arr.copy()
    ro.flags.writeable = False
    yield "readonly", ro, ValueError
    if arr.ndim == 1 and name != "input_ids":
        yield "small", arr[: arr.shape[0] // 2].copy(), ValueError
    yield "list", arr.tolist(), TypeError


@pytest.mark.parametrize("name", BUFFER_NAMES + ("yoco_kept_rows", "yoco_cu_seqlens", "engram_indices",
                                                 "zos_source_index"))
def test_each_buffer_validated_and_nothing_written(name):
    kw = dict(yoco_mode=E.YocoPrefillTruncationMode.LAST_TOKEN, engram_ngram_orders=[2],
              engram_layer_seeds=[1], engram_table_sizes=[97])
    bufs = make_buffers(max_tokens=32, max_seqs=4, width=4, yoco=True, engram_cols=1, zos=True)
    for what, bad, exc in bad_variants(name, bufs[name]):
        trial = dict(bufs)
        trial[name] = bad
        before = snapshot(bufs)
        with pytest.raises(exc, match=name):
            make_args(trial, **kw)
        for k in bufs:
            np.testing.assert_array_equal(bufs[k], before[k], err_msg=f"{name}/{what} wrote {k}")
    make_args(bufs, **kw)  # the originals are fine
    assert (bufs["block_tables"] == 0).all()  # zero-filled once accepted


def test_engram_columns_must_match_config():
    bufs = make_buffers(max_tokens=8, max_seqs=2, width=2, engram_cols=3)
    with pytest.raises(ValueError, match="engram_indices"):
        make_args(bufs, engram_ngram_orders=[2, 3], engram_heads_per_order=2, engram_layer_seeds=[1],
                  engram_table_sizes=[7, 7])


@pytest.mark.parametrize("kw, name", [
    (dict(block_size=0), "block_size"),
    (dict(max_model_len=0), "max_model_len"),
    (dict(graph_batch_sizes=[0]), "graph_batch_sizes"),
    (dict(graph_batch_sizes=[999]), "graph_batch_sizes"),
    (dict(graph_batch_sizes=[1.5]), "graph_batch_sizes"),
    (dict(yoco_mode=E.YocoPrefillTruncationMode.LOGITS_ROWS), "yoco_kept_rows"),
    (dict(engram_ngram_orders=[0], engram_layer_seeds=[1], engram_table_sizes=[7]), "engram_ngram_orders"),
    (dict(engram_ngram_orders=[2], engram_layer_seeds=[1], engram_table_sizes=[7, 9]), "engram_table_sizes"),
    (dict(engram_ngram_orders=[2], engram_table_sizes=[7]), "engram_layer_seeds"),
    (dict(engram_ngram_orders=[2], engram_heads_per_order=0, engram_layer_seeds=[1], engram_table_sizes=[7]),
     "engram_heads_per_order"),
])
def test_bad_configuration(kw, name):
    bufs = make_buffers(max_tokens=8, max_seqs=2, width=2)
    before = snapshot(bufs)
    with pytest.raises((ValueError, TypeError), match=name):
        make_args(bufs, **kw)
    for k in bufs:
        np.testing.assert_array_equal(bufs[k], before[k])


def good_row(seq_id=1):
    return RefRow(seq_id, "a", [1, 2, 3, 4, 5], 5, 0, 5, [0, 1])


@pytest.mark.parametrize("builder, rows, match", [
    ("prompt", [RefRow(1, "a", [1, 2, 3, 4, 5], 5, 0, 5, [0])], "needed"),                      # table too short
    ("prompt", [RefRow(1, "a", list(range(40)), 40, 0, 40, list(range(10)))], "max_model_len"),
    ("prompt", [RefRow(1, "a", list(range(20)), 20, 0, 20, list(range(5)))], "block_tables width"),
    ("prompt", [good_row(i) for i in range(5)], "block_tables rows"),
    ("prompt", [RefRow(i, "a", list(range(10)), 10, 0, 10, [0, 1, 2]) for i in (1, 2)], "input_ids"),  # 25 > 16 rows
    ("decode", [good_row()], "prompt chunk"),
])
def test_builder_rejects_rows_without_writing(builder, rows, match):
    bufs = make_buffers(max_tokens=16, max_seqs=4, width=4)
    args = make_args(bufs, block_size=4, max_model_len=32)
    E.prepare_prompt_v4(args, pool_of([good_row(), RefRow(2, "b", [9, 8, 7], 2, 2, 1, [3])]))
    state = (args.num_tokens, args.num_rows, args.num_logits)
    before = snapshot(bufs)
    pool = pool_of([good_row(7)] + rows)  # a valid first row: still nothing written
    fn = E.prepare_prompt_v4 if builder == "prompt" else E.prepare_decode_v4
    with pytest.raises(ValueError, match=match):
        fn(args, pool)
    for k in bufs:
        np.testing.assert_array_equal(bufs[k], before[k], err_msg=k)
    assert (args.num_tokens, args.num_rows, args.num_logits) == state


def test_engram_token_outside_table_writes_nothing():
    E.set_engram_lookup_table(np.arange(10), 10)
    try:
        bufs = make_buffers(max_tokens=16, max_seqs=2, width=4, engram_cols=1)
        args = make_args(bufs, block_size=4, engram_ngram_orders=[2], engram_layer_seeds=[3],
                         engram_table_sizes=[11])
        before = snapshot(bufs)
        with pytest.raises(ValueError, match="Engram lookup table"):
            E.prepare_prompt_v4(args, pool_of([RefRow(1, "a", [1, 2, 30], 3, 0, 3, [0])]))
        for k in bufs:
            np.testing.assert_array_equal(bufs[k], before[k])
    finally:
        E.set_engram_lookup_table(None, 1)


@pytest.mark.parametrize("kw, name", [
    (dict(token_ids=[1, -2, 3]), "token_ids"),
    (dict(token_ids="abc"), "token_ids"),
    (dict(token_ids=[1, 2], block_table=[0, -1]), "block_table"),
    (dict(num_prompt_tokens=0), "num_prompt_tokens"),
    (dict(num_computed_tokens=9), "num_computed_tokens"),
    (dict(num_new_tokens=0), "num_new_tokens"),
    (dict(num_computed_tokens=0, num_new_tokens=9), "num_new_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(params={"temperature": 0.5}), "params"),
    (dict(eos_token_id=-2), "eos_token_id"),
])
def test_add_sequence_validates(kw, name):
    pool = E.SequenceMetadataPool()
    base = dict(seq_id=1, request_id="a", token_ids=[1, 2, 3], num_prompt_tokens=2, num_computed_tokens=2,
                num_new_tokens=1, block_table=[0])
    with pytest.raises((ValueError, TypeError), match=name):
        # the sampling fields are refused by the SamplingParams the row takes
        fields = {k: v for k, v in kw.items() if k in E.SamplingParams.FIELDS}
        rest = {k: v for k, v in kw.items() if k not in fields}
        pool.add_sequence(**{**base, **rest}, **({"params": E.SamplingParams(**fields)} if fields else {}))
    assert len(pool) == 0


def test_sampler_and_update_argument_types():
    bufs = make_buffers(max_tokens=16, max_seqs=2, width=2)
    args = make_args(bufs, block_size=4)
    with pytest.raises(TypeError):
        E.prepare_sampler_inputs(args, "not a pool", E.SamplerInputs())
    with pytest.raises(TypeError):
        E.prepare_prompt_v4(None, E.SequenceMetadataPool())


def test_buffer_made_read_only_later_is_refused():
    bufs = make_buffers(max_tokens=16, max_seqs=2, width=4)
    args = make_args(bufs, block_size=4)
    bufs["positions"].flags.writeable = False
    before = snapshot(bufs)
    with pytest.raises(ValueError, match="positions"):
        E.prepare_prompt_v4(args, pool_of([good_row()]))
    for k in bufs:
        np.testing.assert_array_equal(bufs[k], before[k])
