"""allowed_token_ids, bad words and priority at the engine level: the sampler inputs the builder
writes for hand-made rows (expected lists computed by hand here), the scheduler's policy."""

from __future__ import annotations

import numpy as np
import pytest
from deepinfer_engine import _engine as E
from inputs_helpers import make_args, make_buffers

P = [1, 2, 3]  # the prompt of every hand-made row


def _sampler_rows(rows):
    """rows: (output tokens, drafts, SamplingParams, eos) of decode rows over prompt P. Returns the
    per-sample-row (banned, allowed) lists of prepare_sampler_inputs."""
    pool = E.SequenceMetadataPool()
    for i, (out, drafts, params, eos) in enumerate(rows):
        tokens = P + out
        pool.add_sequence(seq_id=i, request_id=f"r{i}", token_ids=tokens, num_prompt_tokens=len(P),
                          num_computed_tokens=len(tokens) - 1, num_new_tokens=1 + len(drafts),
                          block_table=[10 * i, 10 * i + 1, 10 * i + 2], draft_tokens=drafts or None,
                          params=params, eos_token_id=eos)
    args = make_args(make_buffers(max_tokens=64, max_seqs=8, width=4), block_size=4, max_model_len=16)
    E.prepare_prompt_v4(args, pool)
    T = E.prepare_sampler_inputs(args, pool, E.SamplerInputs()).transform

    def csr(off, val, r):
        return val[off[r]: off[r + 1]].tolist()

    return [(csr(T.banned_offsets, T.banned_token_ids, r), csr(T.allowed_offsets, T.allowed_token_ids, r))
            for r in range(T.num_rows)], T


WORDS = [[8, 9], [5], [7, 8, 10], [3, 7, 11], [6, 9], [8, 8, 12]]


def test_bad_words_ban_the_token_completing_a_word_of_the_output():
    sp = E.SamplingParams(bad_words_token_ids=WORDS, banned_token_ids=[2])
    rows, T = _sampler_rows([
        ([7, 8], [], sp, -1),   # ends with 8 -> 9; with 7, 8 -> 10; [5] always; [3, 7] is not the output's
        ([7], [], sp, -1),      # ends with 7: [8, 9] not matched; [3, 7, 11] spans the prompt: not matched
        ([9, 8, 8], [], sp, -1),  # ends with 8 -> 9, and with 8, 8 -> 12
        ([], [], E.SamplingParams(bad_words_token_ids=[[3, 4], [6]]), -1),  # nothing generated: only [6]
        ([7], [], E.SamplingParams(), -1),  # no bad words: nothing banned
    ])
    assert [b for b, _ in rows] == [[2, 5, 9, 10], [2, 5], [2, 5, 9, 12], [6], []]
    assert not T.no_banned


def test_bad_words_of_a_speculative_row_follow_its_drafts():
    # output [7] + drafts [8]: the bonus token follows 7, 8 (the drafts' own rows are verified as drafted)
    rows, _ = _sampler_rows([([7], [8], E.SamplingParams(bad_words_token_ids=WORDS), -1)])
    assert [b for b, _ in rows] == [[5, 9, 10]]


def test_bad_words_join_min_tokens_masking():
    sp = E.SamplingParams(bad_words_token_ids=[[8, 9], [4]], stop_token_ids=[6], min_tokens=5)
    rows, _ = _sampler_rows([([7, 8], [], sp, 0), ([7, 8, 1, 1, 8], [], sp, 0)])
    # below min_tokens: EOS 0 and stop 6 too; at 5 outputs only the bad words (4 and 9 after 8)
    assert [b for b, _ in rows] == [[0, 4, 6, 9], [4, 9]]


def test_allowed_token_ids_reach_the_sampler_inputs():
    rows, T = _sampler_rows([([7], [], E.SamplingParams(allowed_token_ids=[9, 4, 9]), -1),
                             ([7], [], E.SamplingParams(), -1)])
    assert [a for _, a in rows] == [[4, 9], []] and not T.no_allowed


def _decoding_scheduler(words):
    s = E.Scheduler(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                    vocab_size=100, watermark=0.0)
    s.add_request("a", [1, 2, 3], E.SamplingParams(max_tokens=20, ignore_eos=True, bad_words_token_ids=words))
    s.schedule()
    s.update(np.array([5], np.int32))  # prefill, first token
    s.schedule()  # a decode step in flight
    return s


def test_overlap_goes_synchronous_for_a_multi_token_bad_word():
    # step N+1's host inputs lack step N's token, on which a multi-token word's ban depends
    assert _decoding_scheduler([[5, 6]]).schedule(overlap=True) is None
    assert _decoding_scheduler([[6], [7]]).schedule(overlap=True) is not None
    assert _decoding_scheduler([]).schedule(overlap=True) is not None


def test_bad_words_on_the_scheduler_path_follow_each_step():
    s = E.Scheduler(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                    vocab_size=100, watermark=0.0)
    s.add_request("a", [1, 2, 3], E.SamplingParams(max_tokens=10, ignore_eos=True,
                                                    bad_words_token_ids=[[7, 8, 9], [8, 4]]))
    args = make_args(make_buffers(max_tokens=64, max_seqs=4, width=16), block_size=4, max_model_len=64)
    pool, si = E.SequenceMetadataPool(), E.SamplerInputs()
    banned = []
    for token in (7, 8, 2, 8):
        s.schedule()
        pool.build(s)
        E.prepare_prompt_v4(args, pool)
        T = E.prepare_sampler_inputs(args, pool, si).transform
        banned.append(T.banned_token_ids[T.banned_offsets[0]: T.banned_offsets[1]].tolist())
        s.update(np.array([token], np.int32))
    # before any output; after 7; after 7, 8 (-> 9) and 8 (-> 4); after 2
    assert banned == [[], [], [4, 9], []]


@pytest.mark.parametrize("policy, first", [("priority", "urgent"), ("fcfs", "early")])
def test_priority_orders_admission_under_the_priority_policy(policy, first):
    s = E.Scheduler(num_blocks=32, block_size=4, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64,
                    vocab_size=100, policy=policy)
    s.add_request("early", [1, 2], E.SamplingParams(max_tokens=2), priority=5, arrival_time=1.0)
    s.add_request("urgent", [3, 4], E.SamplingParams(max_tokens=2), priority=-1, arrival_time=2.0)
    order = []
    while s.has_unfinished_requests():
        out = s.schedule()
        order += [r for r in out.request_ids if r not in order]
        s.update(np.full(out.num_sample_rows, 7, np.int32))
    assert order[0] == first and sorted(order) == ["early", "urgent"]
