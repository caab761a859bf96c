"""Checks that only mean something on a real NPU (run by `nox -s tests_ascend_hardware`).

Not run in CI here: there is no Ascend NPU. Written against the documented ACL and
torch_npu behaviour; the first run on hardware is their first verification.
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.skipif(
    os.environ.get("DEEPINFER_ASCEND_REAL", "") in ("", "0"),
    reason="needs an Ascend NPU with CANN and torch-npu: run `nox -s tests_ascend_hardware` "
    "(DEEPINFER_ASCEND_REAL=1)",
)


@pytest.fixture(scope="module")
def npu():
    import torch
    import torch_npu  # noqa: F401
    from deepinfer_ascend.plugin import deepinfer_backend

    d = deepinfer_backend()
    probe = d["probe"]()
    assert probe["available"], probe["reason"]
    assert "fake_acl" not in probe["details"]
    return torch, d["load"]()


def test_alloc_is_an_npu_tensor_outside_torch_npu_allocator(npu):
    torch, native = npu
    before = torch.npu.memory_allocated(0)
    t = native.cuda_utils.alloc_tensor((1024, 1024), torch.float16, 0)
    assert t.device == torch.device("npu", 0)
    assert torch.npu.memory_allocated(0) == before
    t.copy_(torch.ones(1024, 1024, dtype=torch.float16))
    assert float(t.float().sum().cpu()) == 1024 * 1024
    if torch.npu.device_count() > 1:
        assert native.cuda_utils.alloc_tensor((4,), torch.float32, 1).device == torch.device(
            "npu", 1
        )


def test_captured_region_is_timed_and_swapped(npu):
    torch, native = npu
    gt = native.graph_timer
    stream = torch.npu.Stream()
    a = torch.randn(2048, 2048, device="npu")
    start, end = gt.EventHandle(0), gt.EventHandle(0)
    g = gt.GraphHandle(device=0)
    torch.npu.synchronize()
    g.capture_begin(stream.npu_stream)
    with torch.npu.stream(stream):
        start.record(stream.npu_stream)
        b = a @ a
        end.record(stream.npu_stream)
    g.capture_end()
    types = [t for _, t in g.nodes()]
    assert "kernel" in types and types.count("event_record") >= 2
    g.replay(stream.npu_stream)
    end.synchronize()
    first = start.elapsed_ms(end)
    assert first > 0.0
    end_node = g.find_event_record_node(end)
    fresh = gt.EventHandle(0)
    end_node.set_event(fresh)
    g.replay(stream.npu_stream)
    fresh.synchronize()
    assert end.elapsed_ms(fresh) > 0.0  # replay 1's stamp kept, replay 2's in the fresh event
    assert torch.allclose(b.float().cpu(), (a @ a).float().cpu(), rtol=1e-2, atol=1e-2)
