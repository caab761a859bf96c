"""host_arena: a CPU model's parameters in one mapping on 2 MiB pages (Linux transparent huge pages)."""

from __future__ import annotations

import itertools
import sys

import pytest
import torch
from deepinfer.runtime.loading.host_arena import HUGE_PAGE, host_arena_tensors

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge-page arena is Linux only")


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "absent"
    return text.split("[")[1].split("]")[0]


def _anon_huge_kib() -> int:
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@linux
def test_views_are_disjoint_aligned_and_hold_what_is_written():
    shapes = [torch.Size([1000, 576]), torch.Size([3]), torch.Size([49, 7, 5]), torch.Size([576])]
    ts = host_arena_tensors(shapes, torch.float32)
    assert ts is not None
    assert [t.shape for t in ts] == shapes and all(t.dtype == torch.float32 and t.is_contiguous() for t in ts)
    assert ts[0].data_ptr() % HUGE_PAGE == 0 and all(t.data_ptr() % 64 == 0 for t in ts)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * 4) for t in ts)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # no overlap
    for i, t in enumerate(ts):
        t.fill_(float(i))
    assert [float(t.min()) for t in ts] == [float(t.max()) for t in ts] == [0.0, 1.0, 2.0, 3.0]
    bf16 = host_arena_tensors([torch.Size([1024, 1024])], torch.bfloat16)
    assert bf16 is not None and bf16[0].dtype == torch.bfloat16 and bf16[0].shape == (1024, 1024)


@linux
def test_small_requests_use_the_ordinary_allocator():
    assert host_arena_tensors([torch.Size([16, 16])], torch.float32) is None


@linux
@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"),
                    reason="transparent huge pages are off on this machine (/sys/kernel/mm/transparent_hugepage)")
def test_written_parameters_sit_on_huge_pages():
    before = _anon_huge_kib()
    ts = host_arena_tensors([torch.Size([16 * 1024 * 1024 // 4])], torch.float32)  # 16 MiB
    assert ts is not None
    ts[0].fill_(1.0)
    assert _anon_huge_kib() - before >= 8 * 1024  # most of the 16 MiB on 2 MiB pages


@linux
def test_a_cpu_models_parameters_share_one_packed_mapping_and_hold_the_files_weights(loaded_default, default_gguf):
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    # (the wide projections are re-laid out input-major, elsewhere, when the native path is off)
    params = [p for n, p in loaded_default.model.named_parameters() if "qkv_proj" not in n and "gate_up" not in n]
    everything = sum(p.numel() * p.element_size() for p in loaded_default.model.parameters())
    lo = min(p.data_ptr() for p in params)
    hi = max(p.data_ptr() + p.numel() * p.element_size() for p in params)
    assert hi - lo <= everything + 64 * len(params)  # one mapping, packed
    # the weights written into it are the file's (gguf's own dequantizer as the reference)
    t = next(t for t in GGUFReader(default_gguf).tensors if t.name == "blk.0.ffn_down.weight")
    ref = dequantize(t.data, t.tensor_type).reshape(loaded_default.config.hidden_size, -1)
    np.testing.assert_array_equal(loaded_default.model.layers[0].down_proj.weight.numpy(), ref)
