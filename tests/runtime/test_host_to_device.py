"""``host_to_device``: the step's small host arrays on the device (runtime/host_to_device.py).

On every device the copy equals the array, in the dtype asked. On CUDA (skipped without one) the
two promises the step path relies on: the host does not wait for the kernels queued before the
copy, and the source may be overwritten as soon as the call returns (the bytes went through a pinned
block of torch's own; a view of pinned memory, as a step's buffers are, is copied as well)."""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from deepinfer.runtime.host_to_device import host_to_device  # noqa: E402


@pytest.mark.parametrize("dtype", [np.int64, np.int32, bool])
def test_the_copy_holds_the_array_in_the_dtype_asked(dtype):
    src = [3, 0, 7, 1] if dtype is not bool else [True, False, True, True]
    out = host_to_device(src, "cpu", dtype)
    assert out.dtype == torch.from_numpy(np.zeros(1, dtype)).dtype
    assert out.tolist() == [dtype(x) if dtype is not bool else x for x in src]
    strided = np.arange(10, dtype=np.int64)[::3]  # not contiguous: copied, not refused
    assert host_to_device(strided, torch.device("cpu")).tolist() == [0, 3, 6, 9]


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)")


def _busy_stream_ms() -> float:
    """Queue about 100 ms of matrix products on the current stream; their time on the device."""
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(4):
        a @ a
    torch.cuda.synchronize()
    per = (time.perf_counter() - t0) / 4
    reps = max(1, int(0.1 / per))
    for _ in range(reps):
        a = (a @ a) * 1e-3
    return 1000 * per * reps


@cuda
def test_on_cuda_the_host_does_not_wait_for_queued_kernels_and_may_reuse_the_source_at_once():
    src = np.arange(4096, dtype=np.int64)
    host_to_device(src, "cuda")  # (the pinned allocator's first block: cudaHostAlloc, once)
    torch.cuda.synchronize()
    busy_ms = _busy_stream_ms()  # queued, not yet run
    t0 = time.perf_counter()
    out = host_to_device(src, "cuda")
    returned_ms = 1000 * (time.perf_counter() - t0)
    src[:] = -1  # the bytes are in a pinned block of torch's by now
    torch.cuda.synchronize()
    assert out.tolist() == list(range(4096))
    # A blocking copy returns after the queued kernels (torch syncs the stream after it).
    assert returned_ms < busy_ms / 4, f"the copy waited {returned_ms:.1f} ms for {busy_ms:.1f} ms of queued kernels"
    # The premise, checked the same way: a blocking copy waits for the queued kernels.
    busy_ms = _busy_stream_ms()
    t0 = time.perf_counter()
    blocking = torch.from_numpy(src).to("cuda")
    blocking_ms = 1000 * (time.perf_counter() - t0)
    assert blocking.tolist() == [-1] * 4096
    assert blocking_ms > busy_ms / 4, f"a blocking copy returned in {blocking_ms:.1f} ms, before the kernels"


@cuda
def test_on_cuda_a_view_of_pinned_memory_may_be_rewritten_at_once():
    pinned = torch.arange(4096, dtype=torch.int64).pin_memory()  # as a step's pinned buffers are
    view = pinned.numpy()[:2048]
    _busy_stream_ms()  # the copy queues behind these kernels
    out = host_to_device(view, "cuda")
    pinned.fill_(-1)  # the next step's inputs, written while the copy still waits
    torch.cuda.synchronize()
    assert out.tolist() == list(range(2048))
