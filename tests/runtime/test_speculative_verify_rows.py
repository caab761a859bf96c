"""Verify steps as one-token decode rows (``worker.verify_rows``, what the verify CUDA graphs
replay): the bookkeeping by hand, and on CPU the whole path through the engine loop with the
graph replaced by the same rows run through the runner — logits equal to the var-len verify
step's, greedy output equal to the non-speculative output."""

from __future__ import annotations

import numpy as np
import pytest
from deepinfer.runtime.sampling_params import SamplingParams
from deepinfer.runtime.worker.step_buffers import StepBuffers
from deepinfer.runtime.worker.verify_rows import (
    expand_verify_rows,
    padded_size,
    verify_graph_sizes,
    verify_row_count,
)
from test_speculative_engine import NGRAM, make_loop, run, tokens_of


def _src(q, seq_lens, width=4, max_tokens=32, max_seqs=8):
    b = StepBuffers(max_tokens, max_seqs, width)
    a = b.arrays
    qsl = np.concatenate([[0], np.cumsum(q)])
    n = len(q)
    t = int(qsl[-1])
    a["query_start_loc"][:n + 1] = qsl
    a["seq_lens"][:n] = seq_lens
    a["input_ids"][:t] = 100 + np.arange(t)
    pos = np.concatenate([np.arange(s - k, s) for s, k in zip(seq_lens, q, strict=True)])
    a["positions"][:t] = pos
    a["slot_mapping"][:t] = 1000 + np.arange(t)
    a["block_tables"][:n] = np.arange(n * width).reshape(n, width) + 1
    a["logits_indices"][:t] = np.arange(t)
    return a


def test_rows_by_hand():
    src = _src([3, 1, 2], [10, 4, 7])
    dst = StepBuffers(16, 16, 4).arrays
    dst["seq_lens"][:] = 99  # stale values must be overwritten up to the padded size
    t = expand_verify_rows(src, 3, dst, 8)
    assert t == 6
    # sequence 0's three queries see 8, 9, 10 keys (causal inside the step); the others likewise
    assert dst["seq_lens"][:8].tolist() == [8, 9, 10, 4, 6, 7, 1, 1]
    # context length = position + 1 for every real row (the decode forward's own convention)
    assert (dst["seq_lens"][:t] == src["positions"][:t] + 1).all()
    assert dst["input_ids"][:8].tolist() == [100, 101, 102, 103, 104, 105, 0, 0]
    assert dst["slot_mapping"][:8].tolist() == [1000, 1001, 1002, 1003, 1004, 1005, -1, -1]
    assert dst["block_tables"][:8, 0].tolist() == [1, 1, 1, 5, 9, 9, 0, 0]
    assert (dst["block_tables"][1] == src["block_tables"][0]).all()


def test_shapes_the_graphs_do_not_take():
    a = _src([3, 1], [10, 4])
    assert verify_row_count(a["query_start_loc"], a["seq_lens"], 2, max_queries=3) == 4
    assert verify_row_count(a["query_start_loc"], a["seq_lens"], 2, max_queries=2) is None  # q > k + 1
    b = _src([3, 1], [2, 4])  # a context shorter than the queries: not a verify step
    assert verify_row_count(b["query_start_loc"], b["seq_lens"], 2, max_queries=3) is None
    assert verify_row_count(a["query_start_loc"], a["seq_lens"], 0, max_queries=3) is None
    with pytest.raises(ValueError, match="do not fit"):
        expand_verify_rows(a, 2, StepBuffers(3, 3, 4).arrays, 3)
    with pytest.raises(ValueError, match="widths differ"):
        expand_verify_rows(a, 2, StepBuffers(8, 8, 5).arrays, 4)


def test_capture_sizes_are_decode_sizes_times_k_plus_one():
    assert verify_graph_sizes([1, 2, 4, 8], 4, 512) == [5, 10, 20, 40]
    assert verify_graph_sizes([1, 2, 4, 8, 16], 4, 64) == [5, 10, 20, 40, 64]  # the budget caps them
    assert padded_size(11, [5, 10, 20]) == 20 and padded_size(21, [5, 10, 20]) is None
    with pytest.raises(ValueError):
        verify_graph_sizes([1], 0, 8)


class _RowsOnCpu:
    """A VerifyGraphRunner whose 'graph' runs the expanded one-token rows through the runner on
    CPU (the same buffers and bookkeeping as the CUDA one; the replay is the runner's forward)."""

    def __init__(self, runner, width, k, sizes, check=None):
        from deepinfer.runtime.worker.verify_graph_runner import VerifyGraphRunner

        self.inner = VerifyGraphRunner.__new__(VerifyGraphRunner)
        most = max(sizes)
        self.inner.runner, self.inner.k, self.inner.sizes = runner, k, sorted(sizes)
        self.inner.buffers = StepBuffers(most, most, width)
        self.inner.num_replays = 0
        self.inner.graphs = self
        self.check = check

    def replay(self, p):
        a = self.inner.buffers.arrays
        runner = self.inner.runner
        # padding rows write no KV in the CUDA graph (slot -1); the CPU kernels take the scratch slot
        slots = np.where(a["slot_mapping"][:p] < 0, runner.scratch_slot, a["slot_mapping"][:p])
        logits = runner.execute(
            input_ids=a["input_ids"][:p].copy(), positions=a["positions"][:p].copy(), slot_mapping=slots, query_start_loc=np.arange(p + 1, dtype=np.int32),
            seq_lens=a["seq_lens"][:p].copy(), block_tables=a["block_tables"][:p].copy(),
            logits_indices=np.arange(p, dtype=np.int32))
        return logits, None


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_output_through_the_row_path_is_the_plain_output(loaded_default, tokenizer, k):
    prompts = [tokenizer.encode(p) for p in (
        "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
        "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4,",
        "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    )]
    params = SamplingParams(temperature=0, max_tokens=24)
    base = tokens_of(run(make_loop(loaded_default, tokenizer), prompts, params))
    loop = make_loop(loaded_default, tokenizer, dict(NGRAM, num_speculative_tokens=k))
    runner = loop.executor.runner
    width = loop.executor.buffers[0].width
    rows = _RowsOnCpu(runner, width, k, verify_graph_sizes([1, 2, 4, 8], k, 512))
    runner.verify_graphs = rows.inner
    seen = []
    orig = rows.inner.try_replay

    def spy(args, arrays):
        # the var-len verify step's own logits (the runner's forward on the engine's layout), for
        # comparison, computed before the row path writes its KV (the values are the same)
        n = int(args.num_rows) or int(args.num_seqs)
        nt, nl = int(args.num_tokens), int(args.num_logits)
        ref = None
        if rows.inner.rows_for(args, arrays) is not None:
            ref = runner.execute(input_ids=arrays["input_ids"][:nt].copy(), positions=arrays["positions"][:nt].copy(),
                                 slot_mapping=arrays["slot_mapping"][:nt].copy(),
                                 query_start_loc=arrays["query_start_loc"][:n + 1].copy(),
                                 seq_lens=arrays["seq_lens"][:n].copy(), block_tables=arrays["block_tables"][:n].copy(),
                                 logits_indices=arrays["logits_indices"][:nl].copy())
        out = orig(args, arrays)
        if ref is not None:
            seen.append((nt, float((out.float() - ref.float()).abs().max()),
                         bool((out.argmax(-1) == ref.argmax(-1)).all())))
        return out

    rows.inner.try_replay = spy
    got = tokens_of(run(loop, prompts, params))
    assert got == base
    assert rows.inner.num_replays >= 3 and any(nt > 3 for nt, _, _ in seen), seen
    assert all(diff < 1e-3 and same for _, diff, same in seen), seen
    assert loop.speculator.stats.num_accepted_tokens > 0
