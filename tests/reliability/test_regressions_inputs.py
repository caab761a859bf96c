"""Minimal reproductions of the input-builder problems the state machine found (reported in
build/notes/requests-for-core-II.md). xfail(strict) until fixed."""

from __future__ import annotations

import numpy as np
import pytest
from deepinfer_engine import _engine as E


def _buffers(T=64, S=8, W=16):
    return dict(input_ids=np.zeros(T, np.int32), positions=np.zeros(T, np.int32),
                slot_mapping=np.zeros(T, np.int64), query_start_loc=np.zeros(S + 1, np.int32),
                seq_lens=np.zeros(S, np.int32), block_tables=np.zeros((S, W), np.int32),
                logits_indices=np.zeros(T, np.int32))


def test_abort_after_schedule_builds_a_placeholder_row_and_the_step_still_applies():
    """The aborted row is built as a placeholder (no KV written, row_seq_ids -1); the step's
    update then skips it."""
    s = E.Scheduler(num_blocks=40, block_size=4, max_num_seqs=3, max_num_batched_tokens=43, max_model_len=31,
                    vocab_size=40, eos_token_id=1)
    s.add_request("a", [5, 6, 7, 8, 9], E.SamplingParams(max_tokens=10))
    s.add_request("b", [5, 6, 7, 8], E.SamplingParams(max_tokens=10))
    s.schedule()
    s.abort_request("a")
    pool = E.SequenceMetadataPool()
    pool.build(s)
    bufs = _buffers()
    args = E.PrepareArgs(block_size=4, max_model_len=31, **bufs)
    E.prepare_prompt_v4(args, pool)
    assert args.row_seq_ids.tolist()[: args.num_seqs] == [-1, 1]
    assert bufs["query_start_loc"][:3].tolist() == [0, 5, 9]     # the placeholder keeps a's 5 tokens
    assert bufs["slot_mapping"][:5].tolist() == [-1] * 5
    # the sampler's rows still line up with the scheduler's sample rows (what update() takes)
    si = E.prepare_sampler_inputs(args, pool, E.SamplerInputs())
    assert si.driver.num_real_rows == 2
    assert si.driver.seq_ids[:2].tolist() == [-1, 1]
    s.update(np.array([3, 3], np.int32))      # the step still applies; a's row is skipped
    assert s.check_invariants() == ""
    assert s.get_sequence(1).output_token_ids.tolist() == [3]


def test_abort_between_schedule_and_prepare_leaves_the_other_rows_buildable():
    s = E.Scheduler(num_blocks=40, block_size=4, max_num_seqs=3, max_num_batched_tokens=43, max_model_len=31,
                    vocab_size=40, eos_token_id=1)
    s.add_request("a", [5, 6, 7, 8, 9], E.SamplingParams(max_tokens=10))
    s.add_request("b", [5, 6, 7, 8], E.SamplingParams(max_tokens=10))
    s.schedule()
    s.abort_request("a")            # e.g. the client went away while the step was being built
    pool = E.SequenceMetadataPool()
    pool.build(s)
    bufs = _buffers()
    args = E.PrepareArgs(block_size=4, max_model_len=31, **bufs)
    E.prepare_prompt_v4(args, pool)
    # b's rows are exact; a's rows write no KV (placeholder slots), like zos_discard does
    b_table = s.get_sequence(1).block_table.tolist()
    rows = args.row_seq_ids.tolist()
    qsl = bufs["query_start_loc"]
    for i, sid in enumerate(rows[: args.num_seqs]):
        slots = bufs["slot_mapping"][qsl[i]: qsl[i + 1]].tolist()
        if sid == 1:
            assert slots == [b_table[p // 4] * 4 + p % 4 for p in range(4)]
        else:
            assert all(x == -1 for x in slots)


def _stale_pool_setup():
    s = E.Scheduler(num_blocks=40, block_size=4, max_num_batched_tokens=64, max_model_len=64, vocab_size=100)
    s.add_request("a", list(range(5, 25)), E.SamplingParams(max_tokens=8, ignore_eos=True))
    s.schedule()
    pool = E.SequenceMetadataPool()
    pool.build(s)
    bufs = _buffers()
    args = E.PrepareArgs(block_size=4, max_model_len=64, **bufs)
    E.prepare_prompt_v4(args, pool)
    E.prepare_sampler_inputs(args, pool, E.SamplerInputs())
    s.update(np.array([9], np.int32))
    s.schedule()                                           # pool.build(s) forgotten
    return s, pool, args, bufs


def test_every_builder_refuses_a_pool_built_for_another_step():
    for call in ("decode", "prompt", "sampler"):
        s, pool, args, bufs = _stale_pool_setup()
        with pytest.raises(ValueError, match=r"SequenceMetadataPool\.build"):
            if call == "decode":
                E.prepare_decode_v4(args, pool)
            elif call == "prompt":
                E.prepare_prompt_v4(args, pool)
            else:
                E.prepare_sampler_inputs(args, pool, E.SamplerInputs())
        pool.build(s)                                        # the fix: build, then it works
        E.prepare_decode_v4(args, pool)
        assert bufs["positions"][0] == 20                  # the new token's position


def test_sampler_input_views_are_read_only_and_valid_until_the_next_prepare():
    s = E.Scheduler(num_blocks=40, block_size=4, max_num_batched_tokens=64, max_model_len=64, vocab_size=100)
    s.add_request("a", list(range(5, 25)), E.SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.5))
    pool, si = E.SequenceMetadataPool(), E.SamplerInputs()
    args = E.PrepareArgs(block_size=4, max_model_len=64, **_buffers())
    s.schedule()
    pool.build(s)
    E.prepare_prompt_v4(args, pool)
    E.prepare_sampler_inputs(args, pool, si)
    views = [si.kernel.offsets, si.kernel.temperature, si.driver.seq_ids, si.kernel.logits_rows, args.row_seq_ids]
    for v in views:
        assert not v.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            v[...] = 0
    assert si.kernel.offsets.tolist() == [0]
    s.update(np.array([9], np.int32))
    s.schedule()
    pool.build(s)
    E.prepare_decode_v4(args, pool)
    E.prepare_sampler_inputs(args, pool, si)
    assert si.kernel.offsets.tolist() == [1]                  # a fresh read after the next prepare
