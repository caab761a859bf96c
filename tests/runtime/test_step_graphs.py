"""Eager steps replayed from CUDA graphs (``worker/step_graph_runner.py``): the token counts, the
padded host inputs, and the padded forward against the unpadded fused step (Triton's interpreter;
the captured graphs themselves need a GPU: ``step_graph_check.py MODEL_DIR cuda`` by hand)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

HERE = os.path.dirname(__file__)


def test_token_counts_are_powers_of_two_within_the_budget_and_the_moe_sort(monkeypatch):
    from deepinfer.runtime.kernels.fused_moe import TRITON_ALIGN_MAX_PAIRS
    from deepinfer.runtime.worker.step_graph_runner import step_graph_token_counts

    assert step_graph_token_counts(8192) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert step_graph_token_counts(2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]  # LLM()'s budget: every step
    assert step_graph_token_counts(100) == [16, 32, 64]
    assert step_graph_token_counts(15) == []
    # (token, expert) pairs stay within the one-launch sort a graph can hold
    assert max(step_graph_token_counts(8192, top_k=8)) * 8 <= TRITON_ALIGN_MAX_PAIRS
    assert step_graph_token_counts(8192, top_k=16) == [16, 32, 64, 128, 256]
    monkeypatch.setenv("DEEPINFER_STEP_GRAPH_TOKENS", "64")
    assert step_graph_token_counts(8192) == [16, 32, 64]
    monkeypatch.setenv("DEEPINFER_STEP_GRAPH_TOKENS", "0")
    assert step_graph_token_counts(8192) == []


POWERS_TO_8192 = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]


@pytest.mark.parametrize("setting", [None, "auto", " Auto "])
def test_auto_bound_goes_by_the_models_hidden_size(monkeypatch, setting):
    """``auto`` (the default): graphs up to 8192 tokens for models of hidden size up to 1024 (their long
    steps are bound by the host's launches), 2048 for larger or unknown ones; the budget still caps it."""
    from deepinfer.runtime.kernels.fused_moe import TRITON_ALIGN_MAX_PAIRS
    from deepinfer.runtime.worker.step_graph_runner import step_graph_bound, step_graph_token_counts

    if setting is None:
        monkeypatch.delenv("DEEPINFER_STEP_GRAPH_TOKENS", raising=False)
    else:
        monkeypatch.setenv("DEEPINFER_STEP_GRAPH_TOKENS", setting)
    assert [step_graph_bound(h) for h in (None, 256, 576, 1024, 1025, 4096)] == [2048, 8192, 8192, 8192, 2048, 2048]
    assert step_graph_token_counts(8192, hidden=576) == POWERS_TO_8192
    assert step_graph_token_counts(16384, hidden=1024) == POWERS_TO_8192
    assert step_graph_token_counts(3000, hidden=576) == POWERS_TO_8192[:8]  # the budget caps it
    assert step_graph_token_counts(8192, hidden=2048) == POWERS_TO_8192[:8]
    # a small mixture of experts stays within its one-launch sort
    assert max(step_graph_token_counts(8192, top_k=8, hidden=512)) * 8 <= TRITON_ALIGN_MAX_PAIRS


def test_a_number_overrides_auto_for_every_model(monkeypatch):
    from deepinfer.runtime.worker.step_graph_runner import step_graph_bound, step_graph_token_counts

    monkeypatch.setenv("DEEPINFER_STEP_GRAPH_TOKENS", "2048")  # the old default, small models included
    assert step_graph_token_counts(8192, hidden=576) == POWERS_TO_8192[:8]
    monkeypatch.setenv("DEEPINFER_STEP_GRAPH_TOKENS", "4096")
    assert [step_graph_bound(h) for h in (None, 576, 4096)] == [4096] * 3
    monkeypatch.setenv("DEEPINFER_STEP_GRAPH_TOKENS", "0")
    assert step_graph_token_counts(8192, hidden=576) == []
    monkeypatch.setenv("DEEPINFER_STEP_GRAPH_TOKENS", "big")
    with pytest.raises(ValueError, match="DEEPINFER_STEP_GRAPH_TOKENS='big' is not an integer"):
        step_graph_bound(576)


def test_capture_short_of_memory_drops_the_largest_counts_and_warns_once(monkeypatch):
    """``capture_step_graphs`` (no GPU: the graphs are faked): out of device memory while capturing,
    it drops the largest count and tries again, down to none, and warns once saying what was left
    out; an error of another kind is not swallowed."""
    from deepinfer.runtime.models import llama_fused_decode
    from deepinfer.runtime.worker import step_graph_runner

    tried: list[list[int]] = []

    class FakeGraphs:
        fits_up_to = 256

        def __init__(self, runner, counts, max_num_seqs, max_model_len):
            self.token_counts = list(counts)

        def capture(self):
            tried.append(self.token_counts)
            if self.token_counts[-1] > FakeGraphs.fits_up_to:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(step_graph_runner, "StepGraphs", FakeGraphs)
    monkeypatch.setattr(llama_fused_decode, "fused_step_supported", lambda model, attention: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setenv("DEEPINFER_STEP_GRAPH_TOKENS", "2048")
    runner = SimpleNamespace(device=torch.device("cuda"), config=SimpleNamespace(hidden_size=4096), model=None,
                             attention=None, step_graphs=None)
    with pytest.warns(RuntimeWarning, match=r"more than 256 tokens not captured: out of device memory \(CUDA out "
                      r"of memory\. Tried to allocate 2\.00 GiB\); steps of up to 256 tokens replay graphs, longer "
                      r"ones run eagerly\. .* \(asked up to 2048 tokens\)") as caught:
        graphs = step_graph_runner.capture_step_graphs(runner, 2048, 64, 4096)
    assert len(caught) == 1
    assert [t[-1] for t in tried] == [2048, 1024, 512, 256]
    assert graphs is runner.step_graphs and graphs.token_counts == [16, 32, 64, 128, 256]

    FakeGraphs.fits_up_to = 0  # nothing fits: no graphs, the steps run eagerly
    runner.step_graphs = None
    with pytest.warns(RuntimeWarning, match="prompt and mixed steps run eagerly"):
        assert step_graph_runner.capture_step_graphs(runner, 2048, 64, 4096) is None
    assert runner.step_graphs is None

    def broken(self):
        raise RuntimeError("a bug, not memory")

    monkeypatch.setattr(FakeGraphs, "capture", broken)
    with pytest.raises(RuntimeError, match="a bug, not memory"):
        step_graph_runner.capture_step_graphs(runner, 2048, 64, 4096)


def _graphs(max_seqs: int = 5):
    from deepinfer.runtime.worker.step_graph_runner import StepGraphs

    runner = SimpleNamespace(device=torch.device("cpu"), block_size=16, num_blocks=40, scratch_slot=640)
    return StepGraphs(runner, [16, 32, 64], max_num_seqs=max_seqs, max_model_len=128)  # type: ignore[arg-type]


@pytest.mark.parametrize("q_lens", [[22], [17, 5], [1, 7, 3], [1], [16, 16, 1, 2, 9]])
def test_host_inputs_pad_rows_to_the_scratch_slot_and_tiles_to_an_empty_sequence(q_lens):
    from deepinfer.runtime.attention.metadata import build_attention_metadata
    from deepinfer.runtime.attention.triton_paged import _tiles

    graphs = _graphs()
    n, rows = len(q_lens), sum(q_lens)
    tokens = graphs._count(rows)
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    seq_lens = np.array(q_lens) + 3  # three cached tokens before each
    positions = np.concatenate([np.arange(3, 3 + q) for q in q_lens])
    slots = np.arange(rows) + 100
    slots[0] = -1  # an engine padding row
    host = graphs.host_inputs(tokens, positions, slots, qsl, seq_lens)
    # rows: the step's, then position 0 writing the scratch slot; the engine's -1 is the scratch slot too
    assert host["positions"].tolist() == positions.tolist() + [0] * (tokens - rows)
    assert host["slots"].tolist() == [640] + slots[1:].tolist() + [640] * (tokens - rows)
    # sequences past the step's: no query rows (their start is the step's row count) and no context
    assert host["qsl"].tolist() == qsl.tolist() + [rows] * (graphs.max_seqs + 1 - n)
    assert host["seq_lens"].tolist() == seq_lens.tolist() + [0] * (graphs.max_seqs + 1 - n)
    # the real tiles are the eager attention's (16 rows each), the rest name the empty sequence n
    meta = build_attention_metadata(slot_mapping=slots, query_start_loc=qsl, seq_lens=seq_lens,
                                    block_tables=np.zeros((n, 8), np.int32), block_size=16, scratch_slot=640,
                                    device=torch.device("cpu"))
    want_seq, want_start = (t.numpy() for t in _tiles(meta, 16, torch.device("cpu")))
    used = len(want_seq)
    assert len(host["tile_seq"]) == graphs.max_tiles(tokens) >= used
    assert host["tile_seq"][:used].tolist() == want_seq.tolist()
    assert host["tile_start"][:used].tolist() == want_start.tolist()
    assert set(host["tile_seq"][used:].tolist()) <= {n} and not host["tile_start"][used:].any()


def test_steps_fit_by_rows_and_sequences():
    graphs = _graphs(max_seqs=5)
    assert graphs.fits(64, 5) and graphs.fits(1, 1)
    assert not graphs.fits(65, 1) and not graphs.fits(10, 6) and not graphs.fits(0, 0)
    assert [graphs._count(r) for r in (1, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]


def test_capture_needs_cuda_and_the_fused_eager_step(tmp_path):
    from deepinfer.runtime.worker.step_graph_runner import StepGraphs, capture_step_graphs

    graphs = _graphs()
    with pytest.raises(ValueError, match="CUDA device"):
        graphs.capture()
    with pytest.raises(ValueError, match="token counts must be positive, got \\[0, 16\\]"):
        StepGraphs(graphs.runner, [0, 16], max_num_seqs=2, max_model_len=64)
    cpu_runner = SimpleNamespace(device=torch.device("cpu"))
    assert capture_step_graphs(cpu_runner, 8192, 4, 256) is None  # type: ignore[arg-type]


def test_out_of_memory_while_capturing_warns_and_leaves_steps_eager(monkeypatch):
    import deepinfer.runtime.models.llama_fused_decode as fused
    import deepinfer.runtime.worker.step_graph_runner as sgr

    class Refused:
        def __init__(self, *args):
            pass

        def capture(self):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(fused, "fused_step_supported", lambda model, attention: True)
    monkeypatch.setattr(sgr, "StepGraphs", Refused)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    runner = SimpleNamespace(device=torch.device("cuda"), model=None, attention=None, config=SimpleNamespace(),
                             step_graphs=None)
    with pytest.warns(RuntimeWarning, match=r"out of device memory \(CUDA out of memory.*up to 1024 tokens"):
        assert sgr.capture_step_graphs(runner, 8192, 4, 256) is None  # type: ignore[arg-type]  # (4 sequences of 256 hold 1024 tokens)
    assert runner.step_graphs is None


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_padded_steps_match_the_unpadded_fused_step(tmp_path, arch):
    """Padded to 16 and 32 rows, with the query tiles padded by an empty sequence, the step's real
    rows and the KV cache come out as the unpadded fused step's (float32, Triton's interpreter)."""
    pytest.importorskip("triton", reason="Triton is not installed (it ships with torch's CUDA wheels)")
    from tiny_models import save_tiny_model
    from tiny_moe_models import save_tiny_moe

    if arch == "qwen3_moe":
        save_tiny_moe(tmp_path, arch)
    else:
        save_tiny_model(tmp_path, arch=arch)
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, os.path.join(HERE, "step_graph_check.py"), str(tmp_path), "cpu"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
    assert out.stdout.count("run_eager step ") == 3, out.stdout
