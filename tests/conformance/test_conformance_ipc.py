"""export_ipc_tensor / import_ipc_tensor: same process, another process, offsets, bad input."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

# Run in a fresh interpreter: load the backend through its plugin, import the handle, check
# and overwrite the values, print the sum it saw.
CHILD = textwrap.dedent(
    """
    import importlib, pickle, sys, torch
    name, path = sys.argv[1], sys.argv[2]
    native = importlib.import_module(f"deepinfer_{name}.plugin").deepinfer_backend()["load"]()
    with open(path, "rb") as f:
        handle = pickle.load(f)
    t = native.cuda_utils.import_ipc_tensor(handle)
    seen = float(t.double().sum().cpu())
    t.fill_(7)
    if hasattr(torch, "cuda") and t.device.type == "cuda":
        torch.cuda.synchronize()
    if t.device.type == "npu":
        torch.npu.synchronize()
    print(f"shape={tuple(t.shape)} dtype={t.dtype} sum={seen}")
    """
)


def _run_child(backend, handle, tmp_path):
    path = tmp_path / "handle.pkl"
    path.write_bytes(pickle.dumps(handle))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, backend.name, str(path)],
        capture_output=True,
        text=True,
        env=backend.adapter.child_env(),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_handle_pickles_and_same_process_import_is_the_original(backend):
    cu = backend.cuda_utils
    t = cu.alloc_tensor((16,), torch.float32, 0)
    t.copy_(torch.arange(16, dtype=torch.float32).to(t.device))
    handle = pickle.loads(pickle.dumps(cu.export_ipc_tensor(t)))
    same = cu.import_ipc_tensor(handle)
    assert same.data_ptr() == t.data_ptr()
    assert same.dtype == t.dtype and tuple(same.shape) == (16,)
    same[3] = -1.0
    assert float(t[3].cpu()) == -1.0


def test_sub_tensor_at_offset_same_process(backend):
    cu = backend.cuda_utils
    t = cu.alloc_tensor((4, 8), torch.int32, 0)
    t.copy_(torch.arange(32, dtype=torch.int32).reshape(4, 8).to(t.device))
    sub = t[2]
    out = cu.import_ipc_tensor(cu.export_ipc_tensor(sub))
    assert out.data_ptr() == sub.data_ptr()
    assert torch.equal(out.cpu(), torch.arange(16, 24, dtype=torch.int32))


def test_export_twice_gives_equivalent_handles(backend):
    cu = backend.cuda_utils
    t = cu.alloc_tensor((8,), torch.float16, 0)
    a = cu.import_ipc_tensor(cu.export_ipc_tensor(t))
    b = cu.import_ipc_tensor(cu.export_ipc_tensor(t))
    assert a.data_ptr() == b.data_ptr() == t.data_ptr()


def test_cross_process_roundtrip(backend, tmp_path):
    cu = backend.cuda_utils
    t = cu.alloc_tensor((6, 5), torch.float32, 0)
    ref = torch.arange(30, dtype=torch.float32).reshape(6, 5)
    t.copy_(ref.to(t.device))
    out = _run_child(backend, cu.export_ipc_tensor(t), tmp_path)
    assert out == f"shape=(6, 5) dtype=torch.float32 sum={float(ref.sum())}"
    # The child's writes land in our memory.
    assert torch.equal(t.cpu(), torch.full((6, 5), 7.0))


def test_cross_process_sub_tensor_at_offset(backend, tmp_path):
    cu = backend.cuda_utils
    t = cu.alloc_tensor((100,), torch.int64, 0)
    t.copy_(torch.arange(100).to(t.device))
    sub = t[37:45]
    out = _run_child(backend, cu.export_ipc_tensor(sub), tmp_path)
    assert out == f"shape=(8,) dtype=torch.int64 sum={float(sum(range(37, 45)))}"
    host = t.cpu()
    assert torch.equal(host[37:45], torch.full((8,), 7))
    assert torch.equal(host[:37], torch.arange(37)) and torch.equal(
        host[45:], torch.arange(45, 100)
    )


def test_export_rejects_non_tensors(backend):
    with pytest.raises(TypeError, match="tensor"):
        backend.cuda_utils.export_ipc_tensor([1, 2, 3])


def test_export_rejects_foreign_memory(backend):
    with pytest.raises((TypeError, ValueError), match="tensor"):
        backend.cuda_utils.export_ipc_tensor(torch.zeros(4))


@pytest.mark.parametrize("handle", ["nope", 42, None, {}], ids=["str", "int", "none", "empty-dict"])
def test_import_rejects_malformed_handles(backend, handle):
    with pytest.raises((TypeError, ValueError), match="handle"):
        backend.cuda_utils.import_ipc_tensor(handle)
