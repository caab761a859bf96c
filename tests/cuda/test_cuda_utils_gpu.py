"""cuda_utils on a real GPU: driver-allocated memory and legacy CUDA IPC."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import pytest
from cuda_test_support import load_backend, requires_gpu

pytestmark = requires_gpu

MiB = 1 << 20


@pytest.fixture(scope="module")
def cu():
    return load_backend().cuda_utils


@pytest.fixture(scope="module")
def native():
    from deepinfer_cuda._native import cuda_utils

    return cuda_utils


def test_memory_is_outside_torch_accounting_and_freed_on_death(cu, native):
    import torch

    warm = cu.alloc_tensor((MiB,), torch.uint8, 0)  # load the kernels used below first:
    warm.fill_(7)  # lazily loaded modules take device memory too
    int(warm[::MiB].sum())
    del warm
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated(0)
    free_before, _ = native.mem_get_info(0)
    t = cu.alloc_tensor((256 * MiB,), torch.uint8, 0)
    free_during, _ = native.mem_get_info(0)
    assert torch.cuda.memory_allocated(0) == allocated
    assert free_before - free_during >= 256 * MiB
    t.fill_(7)
    assert int(t[::MiB].sum()) == 7 * 256
    torch.cuda.synchronize()
    free_with_t, _ = native.mem_get_info(0)
    del t
    torch.cuda.synchronize()
    free_after, _ = native.mem_get_info(0)
    assert free_after - free_with_t >= 256 * MiB  # the tensor's death freed its memory


@pytest.mark.parametrize(
    "dtype_name,shape",
    [("float16", (3, 5)), ("bfloat16", (7,)), ("float32", (2, 3, 4)), ("int64", (9,)), ("bool", (4, 4)),
     ("uint8", (1,)), ("complex64", (2, 2)), ("float64", ())],
)
def test_alloc_tensor_dtype_shape_device_and_round_trip(cu, dtype_name, shape):
    import torch

    dtype = getattr(torch, dtype_name)
    t = cu.alloc_tensor(shape, dtype, "cuda:0")
    assert t.dtype == dtype and tuple(t.shape) == shape and t.device == torch.device("cuda", 0)
    assert t.is_contiguous()
    ref = (torch.arange(max(1, t.numel())) % 3).to(dtype).reshape(shape) if t.numel() else torch.empty(shape, dtype=dtype)
    t.copy_(ref.cuda())
    assert torch.equal(t.cpu(), ref)


def test_alloc_tensor_empty_shapes(cu):
    import torch

    for shape in [(0,), (3, 0)]:
        t = cu.alloc_tensor(shape, torch.float32, 0)
        assert tuple(t.shape) == shape and t.numel() == 0 and t.is_cuda


def test_alloc_tensor_bad_input(cu):
    import torch

    with pytest.raises(ValueError, match="not a visible CUDA device"):
        cu.alloc_tensor((4,), torch.float32, 64)
    with pytest.raises(ValueError, match="shape"):
        cu.alloc_tensor((4, -1), torch.float32, 0)
    with pytest.raises(TypeError, match="dtype"):
        cu.alloc_tensor((4,), "float32", 0)
    with pytest.raises(ValueError, match="not a CUDA device"):
        cu.alloc_tensor((4,), torch.float32, "cpu")


def _run(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_alloc_tensor_before_torch_initialised_cuda():
    proc = _run(
        """
        import torch
        from deepinfer_cuda.cuda_utils import alloc_tensor
        assert not torch.cuda.is_initialized()
        t = alloc_tensor((1000,), torch.float32, 0)
        t.copy_(torch.arange(1000, dtype=torch.float32, device="cuda"))
        assert float(t.sum()) == 499500.0
        print("ok")
        """
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_same_process_import_returns_the_original_memory(cu):
    import torch

    base = cu.alloc_tensor((8, 16), torch.float32, 0)
    base.copy_(torch.arange(128, dtype=torch.float32).reshape(8, 16))
    view = base[3:7, 2:]  # non-contiguous, at a non-zero byte offset
    handle = cu.export_ipc_tensor(view)
    assert handle.offset == (3 * 16 + 2) * 4
    handle = pickle.loads(pickle.dumps(handle))
    imported = cu.import_ipc_tensor(handle)
    assert imported.data_ptr() == view.data_ptr()
    assert imported.stride() == view.stride() and imported.shape == view.shape
    assert torch.equal(imported, view)
    imported.fill_(-1)
    assert float(base[3:7, 2:].sum()) == -1.0 * 4 * 14


def test_same_process_import_after_the_exporter_freed_it(cu):
    import torch

    t = cu.alloc_tensor((1024,), torch.float32, 0)
    handle = cu.export_ipc_tensor(t)
    del t
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="no longer exists"):
        cu.import_ipc_tensor(handle)


def test_export_bad_input(cu):
    import torch

    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        cu.export_ipc_tensor([1, 2])
    with pytest.raises(ValueError, match="not on a CUDA device"):
        cu.export_ipc_tensor(torch.ones(3))
    with pytest.raises(ValueError, match="no elements"):
        cu.export_ipc_tensor(torch.ones(0, device="cuda"))
    with pytest.raises(TypeError, match="CudaIpcHandle"):
        cu.import_ipc_tensor({"handle": b"x"})


def test_expandable_segments_are_refused_with_the_reason():
    proc = _run(
        """
        import torch
        from deepinfer_cuda.cuda_utils import export_ipc_tensor
        t = torch.ones(1 << 20, device="cuda")
        try:
            export_ipc_tensor(t)
        except ValueError as exc:
            print("refused:", exc)
        else:
            print("exported")
        """,
        env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "refused:" in proc.stdout and "legacy CUDA IPC" in proc.stdout and "expandable" in proc.stdout


def _child_import(handle, expected, queue):
    import torch
    from deepinfer_cuda._native import cuda_utils as native
    from deepinfer_cuda.cuda_utils import import_ipc_tensor

    try:
        before = native.open_mapping_count()
        t = import_ipc_tensor(handle)
        t2 = import_ipc_tensor(handle)  # second import of the same allocation: same mapping
        same_values = bool(torch.equal(t.cpu(), expected))
        open_with_two = native.open_mapping_count()
        shared_ptr = t.data_ptr() == t2.data_ptr()
        t.mul_(10)  # visible to the exporter
        torch.cuda.synchronize()
        del t, t2
        after = native.open_mapping_count()
        queue.put(("ok", same_values, before, open_with_two, shared_ptr, after))
    except Exception as exc:  # reported to the parent, which fails the test
        queue.put(("error", repr(exc)))


def test_ipc_round_trip_across_processes_with_offsets(cu):
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    base = torch.arange(4096, dtype=torch.float32, device="cuda").reshape(64, 64)
    for view in (base, base[10:20, 5:37], base[33]):  # offsets 0, (10*64+5)*4, 33*64*4
        expected = view.cpu().clone()
        queue = ctx.Queue()
        proc = ctx.Process(target=_child_import, args=(cu.export_ipc_tensor(view), expected, queue))
        proc.start()
        result = queue.get(timeout=120)
        proc.join(timeout=60)
        assert result[0] == "ok", result
        _, same_values, before, open_with_two, shared_ptr, after = result
        assert same_values and shared_ptr
        assert (before, open_with_two, after) == (0, 1, 0)
        assert torch.equal(view.cpu(), expected * 10)
