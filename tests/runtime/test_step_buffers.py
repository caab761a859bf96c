"""The engine's step buffers: one host allocation whose byte prefix carries a decode batch (what
the CUDA graph runner copies up in one go), and the graph runner's argument checks (CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer.runtime.worker.cuda_graph_runner import CudaGraphRunner, default_graph_batch_sizes
from deepinfer.runtime.worker.step_buffers import StepBuffers


def test_views_share_one_allocation_and_a_prefix_carries_a_batch():
    sb = StepBuffers(max_tokens=40, max_seqs=8, width=5)
    rng = np.random.default_rng(0)
    for name, arr in sb.arrays.items():
        arr[...] = rng.integers(-5, 1000, arr.shape)
        assert sb.offsets[name] % 64 == 0 and arr.flags.c_contiguous and arr.flags.writeable
    # a copy of only the first bytes_for_batch(3) bytes, read through the device-side views
    dev = torch.zeros(sb.nbytes, dtype=torch.uint8)
    n = sb.bytes_for_batch(3)
    dev[:n] = sb.host[:n]
    views = sb.device_views(dev)
    for name, arr in sb.arrays.items():
        got = views[name].numpy()
        if name == "block_tables":
            np.testing.assert_array_equal(got[:3], arr[:3])
            assert not got[3:].any()  # rows past the batch are not copied
        else:
            np.testing.assert_array_equal(got, arr)
            assert got.dtype == arr.dtype


def test_engine_accepts_the_views_as_prepare_buffers():
    from deepinfer._C import engine

    sb = StepBuffers(max_tokens=32, max_seqs=4, width=8)
    args = engine.PrepareArgs(block_size=16, max_model_len=128, graph_batch_sizes=[1, 2, 4], **sb.arrays)
    assert args.graph_batch_sizes == [1, 2, 4] and args.max_num_tokens == 32 and args.max_num_seqs == 4


def test_graph_batch_sizes():
    assert default_graph_batch_sizes(1) == [1]
    assert default_graph_batch_sizes(8) == [1, 2, 4, 8]
    assert default_graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert default_graph_batch_sizes(256)[-3:] == [224, 240, 256]


def test_graph_runner_refuses_a_cpu_model_and_bad_sizes():
    class Runner:
        device = torch.device("cpu")

    sb = StepBuffers(max_tokens=8, max_seqs=4, width=2)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        CudaGraphRunner(Runner(), sb, [1, 2])  # type: ignore[arg-type]
    Runner.device = torch.device("cuda")
    with pytest.raises(ValueError, match=r"graph batch sizes must be integers in \[1, 4\]"):
        CudaGraphRunner(Runner(), sb, [1, 8])  # type: ignore[arg-type]
