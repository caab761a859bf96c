"""GraphHandle on raw int handles, batched event swaps, and streams of a foreign context."""

from __future__ import annotations

import ctypes

import pytest
from cuda_test_support import load_backend, requires_gpu

pytestmark = requires_gpu


@pytest.fixture(scope="module")
def gt():
    return load_backend().graph_timer


def _captured(fn):
    import torch

    g = torch.cuda.CUDAGraph(keep_graph=True)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        fn()
    return g


def test_raw_int_graph_with_an_exec_of_its_own(gt):
    import torch

    x = torch.zeros(16, device="cuda")
    g = _captured(lambda: (x.add_(1), x.mul_(3)))
    handle = gt.GraphHandle(g.raw_cuda_graph(), 0, 0)  # an int CUgraph: the handle owns its exec
    assert handle.graph == g.raw_cuda_graph()
    assert len(handle.kernel_nodes()) == 2
    with pytest.raises(RuntimeError, match="not instantiated"):
        handle.launch(0)
    start, end = gt.EventHandle(0), gt.EventHandle(0)
    handle.insert_timer_nodes(0, 1, start, end)
    handle.instantiate()
    stream = torch.cuda.current_stream()
    handle.launch(stream)
    handle.launch(stream.cuda_stream)
    torch.cuda.synchronize()
    assert torch.equal(x.cpu(), torch.full((16,), 12.0))  # ((0+1)*3+1)*3
    assert start.elapsed_ms(end) > 0.0


def test_set_events_batch_and_foreign_nodes(gt):
    import torch

    x = torch.zeros(4, device="cuda")
    g1 = _captured(lambda: x.add_(1))
    g2 = _captured(lambda: x.add_(2))
    h1, h2 = gt.GraphHandle(g1, device=0), gt.GraphHandle(g2, device=0)
    a1, b1 = h1.insert_timer_nodes(0, 0, gt.EventHandle(0), gt.EventHandle(0))
    a2, _ = h2.insert_timer_nodes(0, 0, gt.EventHandle(0), gt.EventHandle(0))
    h1.instantiate()
    h2.instantiate()
    fresh = [gt.EventHandle(0), gt.EventHandle(0)]
    h1.set_events([a1, b1], fresh)
    assert a1.event.handle == fresh[0].handle and b1.event.handle == fresh[1].handle
    g1.replay()
    torch.cuda.synchronize()
    assert fresh[0].elapsed_ms(fresh[1]) >= 0.0
    with pytest.raises(ValueError, match="another GraphHandle"):
        h1.set_events([a2], [gt.EventHandle(0)])
    with pytest.raises(ValueError, match="differ in length"):
        h1.set_events([a1, b1], [gt.EventHandle(0)])


def test_stream_of_another_context_is_refused(gt):
    import torch

    torch.cuda.init()
    lib = ctypes.CDLL("libcuda.so.1")
    dev, ctx, stream, popped = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    assert lib.cuDeviceGet(ctypes.byref(dev), 0) == 0
    # A second, non-primary context on the same device (cuCtxCreate_v4 on CUDA 13 drivers).
    if hasattr(lib, "cuCtxCreate_v2"):
        assert lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0
    else:
        assert lib.cuCtxCreate_v4(ctypes.byref(ctx), None, 0, dev) == 0
    try:
        assert lib.cuStreamCreate(ctypes.byref(stream), 0) == 0
        assert lib.cuCtxPopCurrent_v2(ctypes.byref(popped)) == 0
        with pytest.raises(ValueError, match="another device or context"):
            gt.EventHandle(0).record(stream.value)
    finally:
        lib.cuCtxPushCurrent_v2(ctx)
        if stream.value:
            lib.cuStreamDestroy_v2(stream)
        lib.cuCtxDestroy_v2(ctx)
