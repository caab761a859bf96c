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


def compare_with_the_var_len_forward(vg, runner):
    """Wrap ``vg.replay_arrays``: each step taken is also run through the runner's forward in the
    engine's var-len layout first (same KV values written); returns the list of (token rows,
    max |logits difference|, argmax equal) it fills."""
    seen = []
    orig = vg.replay_arrays

    def spy(num_seqs, num_tokens, arrays, logits_indices):
        ref = None
        qsl = np.asarray(arrays["query_start_loc"][:num_seqs + 1])
        if verify_row_count(qsl, arrays["seq_lens"], num_seqs, vg.k + 1) == num_tokens:
            ref = runner.execute(input_ids=np.array(arrays["input_ids"][:num_tokens]),
                                 positions=np.array(arrays["positions"][:num_tokens]),
                                 slot_mapping=np.array(arrays["slot_mapping"][:num_tokens]),
                                 query_start_loc=np.array(qsl), seq_lens=np.array(arrays["seq_lens"][:num_seqs]),
                                 block_tables=np.array(arrays["block_tables"][:num_seqs]),
                                 logits_indices=np.array(logits_indices))
        out = orig(num_seqs, num_tokens, arrays, logits_indices)
        if ref is not None:
            seen.append((num_tokens, float((out.float() - ref.float()).abs().max()),
                         bool((out.argmax(-1) == ref.argmax(-1)).all())))
        return out

    vg.replay_arrays = spy
    return seen


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
    seen = compare_with_the_var_len_forward(rows.inner, runner)
    got = tokens_of(run(loop, prompts, params))
    assert got == base
    assert rows.inner.num_replays >= 3 and any(nt > 3 for nt, _, _ in seen), seen
    assert all(diff < 1e-3 and same for _, diff, same in seen), seen
    assert loop.speculator.stats.num_accepted_tokens > 0


def test_draft_model_forwards_through_the_row_path(loaded_default, tokenizer):
    """The draft model's catch-up and one-token forwards replay the draft runner's row graphs
    (``capture_verify_graphs(draft=True)``): with the target as its own draft every draft is kept
    only if those rows give the target's logits, and the output is the plain output."""
    from test_speculative_draft_model import draft_loop

    prompts = [tokenizer.encode(p) for p in ("The quick brown fox jumps over", "1, 2, 3, 4, 5, 6,")]
    params = SamplingParams(temperature=0, max_tokens=20)
    base = tokens_of(run(make_loop(loaded_default, tokenizer), prompts, params))
    k = 3
    loop = draft_loop(loaded_default, tokenizer, loaded_default, k=k)
    draft = loop.speculator.draft
    sizes = sorted({1, 2, 4, 8} | set(verify_graph_sizes([1, 2, 4, 8], k, 512)))
    rows = _RowsOnCpu(draft.runner, loop.executor.buffers[0].width, k, sizes)
    draft.runner.verify_graphs = rows.inner
    seen = compare_with_the_var_len_forward(rows.inner, draft.runner)
    assert tokens_of(run(loop, prompts, params)) == base
    assert any(nt > 2 for nt, _, _ in seen) and all(diff < 1e-3 and same for _, diff, same in seen), seen
    st = loop.speculator.stats
    assert st.num_draft_tokens > 10 and st.acceptance_rate == 1.0, st.as_dict()
    # every forward but the first catch-up of each sequence (a whole prompt) took the rows
    assert rows.inner.num_replays >= draft.num_forwards - len(prompts) and rows.inner.num_replays > 5
