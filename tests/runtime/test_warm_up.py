"""The start-up warm-up (``worker/warm_up.py``): which row counts it runs, that its dummy steps
touch no sequence's KV cache and change no output, and that ``LLM`` runs it where it is wanted.

On CUDA the point is Triton's compiles, which this machine cannot show; here the steps run the
same runner on the CPU (the dummy inputs, the scratch block and the wiring are the same)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer import LLM, SamplingParams
from deepinfer.runtime.worker import warm_up as wu


@pytest.mark.parametrize("budget,expected", [
    (2048, [2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 512, 513, 1024, 1025, 2048]),
    (100, [2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 100]),
    (64, [2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64]),
    (2, [2]),
    (1, []),
])
def test_rows_are_the_powers_of_two_each_plus_one_and_the_budget(budget, expected):
    assert wu.warm_up_rows(budget) == expected


@pytest.mark.parametrize("k", [1, 2, 6, 8])
def test_rows_put_a_count_on_each_side_of_every_kernel_edge(k):
    """Every edge the kernels have (rows times a MoE top-k ``k`` at 16, 32, 64, 1024 and 4096) has
    warmed counts on both sides, and on each side a multiple of 16 and a count that is not one,
    wherever some count of two or more rows on that side is."""
    budget = 8192
    rows = wu.warm_up_rows(budget)
    for edge in (16, 32, 64, 1024, 4096):
        for below in (True, False):
            possible = [r * k for r in range(2, budget + 1) if (r * k <= edge) == below]
            warmed = [r * k for r in rows if (r * k <= edge) == below]
            for kind in (lambda p: p % 16 == 0, lambda p: p % 16 != 0):
                if any(kind(p) for p in possible):
                    assert any(kind(p) for p in warmed), (edge, k, warmed)


def test_dummy_step_of_one_row_sequences_after_a_cached_block():
    step = wu.dummy_step(3, max_model_len=128, block_size=16, scratch_block=9, context=16, per_seq=1)
    np.testing.assert_array_equal(step["seq_lens"], [17, 17, 17])  # eager decode rows
    np.testing.assert_array_equal(step["query_start_loc"], [0, 1, 2, 3])
    np.testing.assert_array_equal(step["positions"], [16, 16, 16])
    np.testing.assert_array_equal(step["logits_indices"], [0, 1, 2])
    assert step["block_tables"].shape == (3, 2) and (step["block_tables"] == 9).all()
    with pytest.raises(ValueError, match="2 new tokens a sequence after context=127 do not fit max_model_len=128"):
        wu.dummy_step(4, max_model_len=128, block_size=16, scratch_block=9, context=127, per_seq=2)


def test_dummy_step_splits_rows_into_sequences_of_the_model_length_on_the_scratch_block():
    step = wu.dummy_step(300, max_model_len=128, block_size=16, scratch_block=77)
    np.testing.assert_array_equal(step["seq_lens"], [128, 128, 44])
    np.testing.assert_array_equal(step["query_start_loc"], [0, 128, 256, 300])
    np.testing.assert_array_equal(step["logits_indices"], [127, 255, 299])
    np.testing.assert_array_equal(step["positions"][:3], [0, 1, 2])
    np.testing.assert_array_equal(step["positions"][126:131], [126, 127, 0, 1, 2])
    assert step["positions"][-1] == 43 and len(step["input_ids"]) == 300
    assert (step["slot_mapping"] // 16 == 77).all()  # the scratch block's slots only
    assert step["block_tables"].shape == (3, 8) and (step["block_tables"] == 77).all()


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=32, block_size=16,
               max_num_batched_tokens=128)


def _greedy(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=8, temperature=0.0))
    return [list(o.outputs[0].token_ids) for o in outs]


def test_warm_up_leaves_every_sequence_block_and_every_output_as_it_was(llm):
    prompts = [[3, 9, 27, 5, 11], [8, 2, 2, 14, 30, 1, 7, 19, 4]]
    before = _greedy(llm, prompts)
    runner = llm.worker.runner
    # the cache after those requests (their blocks are free now, and may be cached prefixes)
    # (compared bit by bit: blocks never written hold whatever the allocation held, NaNs included)
    caches = [c[:, :runner.num_blocks].clone().view(torch.int32) for c in runner.kv_caches]
    seen = []
    execute = runner.execute

    def recording(**arrays):
        logits = execute(**arrays)
        seen.append((len(arrays["input_ids"]), int(arrays["seq_lens"].max()), tuple(logits.shape)))
        return logits

    runner.execute = recording
    try:
        steps = wu.warm_up(runner, budget=100, max_num_seqs=5, max_model_len=64)
    finally:
        del runner.execute
    vocab = llm.model_config.vocab_size
    # whole prompts: 65 and 100 rows of a 64-token model are two sequences each (64 + 1, 64 + 36);
    # then 1..5 one-row sequences after a cached block of 16 (context 17 tokens each)
    whole = [(r, min(r, 64), (1 if r <= 64 else 2, vocab)) for r in (2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 100)]
    decode = [(n, 17, (n, vocab)) for n in (1, 2, 3, 4, 5)]
    assert seen == whole + decode
    assert steps == [(r, shape[0]) for r, _, shape in whole + decode]
    for c, old in zip(runner.kv_caches, caches, strict=True):
        assert torch.equal(c[:, :runner.num_blocks].contiguous().view(torch.int32), old), "a warm-up step wrote outside the scratch block"
    assert _greedy(llm, prompts) == before


def test_warm_up_skips_the_steps_that_step_graphs_replay():
    from types import SimpleNamespace

    from deepinfer.runtime.worker.step_graph_runner import StepGraphs

    seen = []
    runner = SimpleNamespace(block_size=16, num_blocks=8, scratch_slot=128, device=torch.device("cpu"),
                             execute=lambda **a: seen.append((len(a["input_ids"]), len(a["seq_lens"]))))
    runner.step_graphs = StepGraphs(runner, [16, 32], max_num_seqs=3, max_model_len=64)  # type: ignore[arg-type]
    steps = wu.warm_up(runner, budget=100, max_num_seqs=5, max_model_len=64)
    # up to 32 rows of up to 3 sequences replay a graph; the rest run (and compile) eagerly
    assert steps == seen == [(33, 1), (64, 1), (65, 2), (100, 2), (4, 4), (5, 5)]


def test_llm_warms_up_where_wanted(tiny_model_dir, monkeypatch):
    calls = []
    monkeypatch.setattr(wu, "warm_up_wanted", lambda device_type: device_type == "cpu")
    monkeypatch.setattr(wu, "warm_up", lambda runner, *args: calls.append((runner, args)))
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=8,
              max_num_batched_tokens=96, max_num_seqs=6)
    assert calls == [(llm.worker.runner, (96, 6, 64))]


def test_warm_up_is_off_on_cpu_and_with_the_switch(monkeypatch):
    monkeypatch.delenv("DEEPINFER_WARMUP", raising=False)
    assert wu.warm_up_wanted("cuda") and not wu.warm_up_wanted("cpu")
    monkeypatch.setenv("DEEPINFER_WARMUP", "0")
    assert not wu.warm_up_wanted("cuda")
