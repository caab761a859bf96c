"""alloc_tensor: dtypes, shapes, devices, independence of allocations, and bad input."""

from __future__ import annotations

import math

import pytest
import torch

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]
SHAPES = [(), (0,), (7,), (3, 5), (2, 0, 4), (2, 3, 4, 5)]


def _contiguous_strides(shape):
    strides, acc = [], 1
    for dim in reversed(shape):
        strides.append(acc)
        acc *= max(dim, 1)
    return tuple(reversed(strides))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtype_roundtrip(backend, dtype):
    t = backend.cuda_utils.alloc_tensor((4, 3), dtype, 0)
    assert t.dtype == dtype
    assert t.device.type == backend.adapter.tensor_device_type()
    # Write a reference through torch and read it back on the host.
    ref = (
        (torch.arange(12).reshape(4, 3) % 2 == 1)
        if dtype == torch.bool
        else torch.arange(12, dtype=dtype).reshape(4, 3)
    )
    t.copy_(ref.to(t.device))
    assert torch.equal(t.cpu(), ref)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_shape_and_contiguity(backend, shape):
    t = backend.cuda_utils.alloc_tensor(shape, torch.float32, 0)
    assert tuple(t.shape) == shape
    assert t.numel() == math.prod(shape)
    assert t.is_contiguous()
    if t.numel():
        assert tuple(t.stride()) == _contiguous_strides(shape)
        t.fill_(1.5)
        assert float(t.sum().cpu()) == 1.5 * t.numel()


def test_shape_accepts_list_and_torch_size(backend):
    cu = backend.cuda_utils
    assert tuple(cu.alloc_tensor([2, 5], torch.int32, 0).shape) == (2, 5)
    assert tuple(cu.alloc_tensor(torch.Size([3, 1]), torch.int32, 0).shape) == (3, 1)


def test_device_forms(backend):
    cu = backend.cuda_utils
    forms = [0, backend.adapter.device_str(0), backend.adapter.torch_device(0)]
    for device in [f for f in forms if f is not None]:
        t = cu.alloc_tensor((2,), torch.float32, device)
        assert t.device.type == backend.adapter.tensor_device_type()


def test_device_index_honoured(backend):
    if backend.device_count < 2:
        pytest.skip(f"needs 2 devices, backend {backend.name!r} reports {backend.device_count}")
    if not backend.adapter.reports_device_index():
        pytest.skip(
            "the fake libascendcl.so hands memory to torch as CPU tensors; tests/ascend checks the "
            "device of each allocation in the ACL call log"
        )
    t = backend.cuda_utils.alloc_tensor((2,), torch.float32, 1)
    assert t.device.index == 1


def test_allocations_are_independent(backend):
    cu = backend.cuda_utils
    a = cu.alloc_tensor((1024,), torch.float32, 0)
    b = cu.alloc_tensor((1024,), torch.float32, 0)
    assert a.data_ptr() != b.data_ptr()
    a.fill_(1.0)
    b.fill_(2.0)
    a.add_(1.0)
    assert torch.equal(a.cpu(), torch.full((1024,), 2.0))
    assert torch.equal(b.cpu(), torch.full((1024,), 2.0))
    b.fill_(-1.0)
    assert float(a.sum().cpu()) == 2048.0


def test_memory_outlives_views(backend):
    t = backend.cuda_utils.alloc_tensor((64,), torch.int64, 0)
    t.copy_(torch.arange(64).to(t.device))
    view = t[10:20]
    del t
    assert torch.equal(view.cpu(), torch.arange(10, 20))


def test_many_allocations_are_released(backend):
    # 200 x 4 MiB = 800 MiB if leaked; freed on tensor death, so this stays small.
    for _ in range(200):
        t = backend.cuda_utils.alloc_tensor((1 << 20,), torch.float32, 0)
        t[0] = 1.0
        del t


@pytest.mark.parametrize(
    ("shape", "exc"),
    [
        ((2, -1), ValueError),
        ((2, 1.5), TypeError),
        ((2, True), TypeError),
        ("ab", TypeError),
        (None, TypeError),
    ],
    ids=["negative", "float", "bool", "str", "none"],
)
def test_bad_shape(backend, shape, exc):
    with pytest.raises(exc, match="shape"):
        backend.cuda_utils.alloc_tensor(shape, torch.float32, 0)


@pytest.mark.parametrize(
    "dtype", ["not_a_dtype", 3, None, object()], ids=["str", "int", "none", "object"]
)
def test_bad_dtype(backend, dtype):
    with pytest.raises(TypeError, match="dtype"):
        backend.cuda_utils.alloc_tensor((2,), dtype, 0)


def test_bad_device(backend):
    cu = backend.cuda_utils
    for device in (
        backend.device_count,
        backend.device_count + 7,
        -1,
        "cpu",
        backend.adapter.device_str(backend.device_count),
    ):
        with pytest.raises(ValueError, match="device"):
            cu.alloc_tensor((2,), torch.float32, device)
    for device in (1.0, True, object()):
        with pytest.raises(TypeError, match="device"):
            cu.alloc_tensor((2,), torch.float32, device)
