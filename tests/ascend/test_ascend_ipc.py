"""IPC against the fake ACL: export/import/close order, flags, allow-list, the handle's fields."""

from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT = "0"
ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION = "1"
ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS = "1"

# Imports the handle (twice: the mapping is cached), checks the values, drops them, exits.
CHILD = textwrap.dedent(
    """
    import pickle, sys, gc
    from deepinfer_ascend.plugin import deepinfer_backend
    cu = deepinfer_backend()["load"]().cuda_utils
    handle = pickle.loads(sys.stdin.buffer.read())
    try:
        a = cu.import_ipc_tensor(handle)
        b = cu.import_ipc_tensor(handle)
    except RuntimeError as exc:
        print(f"error call={exc.call} code={exc.code}")
        raise SystemExit(0)
    assert a.data_ptr() == b.data_ptr()
    print(f"ok sum={float(a.double().sum())}")
    a.fill_(3)
    del a, b
    gc.collect()
    """
)


def run_child(handle):
    done = subprocess.run(
        [sys.executable, "-c", CHILD], input=pickle.dumps(handle), capture_output=True, timeout=60
    )
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode().strip()


def test_handle_fields(native):
    cu = native.cuda_utils
    t = cu.alloc_tensor((4, 6), torch.float16, 1)
    sub = t[1:3, 2:5]
    h = cu.export_ipc_tensor(sub)
    assert h["backend"] == "ascend"
    assert h["offset"] == (1 * 6 + 2) * 2
    assert h["size"] == 4096  # the allocation: 48 bytes rounded to a page
    assert h["shape"] == (2, 3) and h["strides"] == (6, 1)
    assert h["dtype"] == "float16" and h["device"] == 1 and h["pid"] == os.getpid()
    assert isinstance(h["key"], str) and 0 < len(h["key"]) <= 64
    assert pickle.loads(pickle.dumps(h)) == h


def test_export_import_close_free_order(native, acl_log):
    cu = native.cuda_utils
    t = cu.alloc_tensor((10,), torch.float32, 0)
    t.copy_(torch.arange(10, dtype=torch.float32))
    h = cu.export_ipc_tensor(t[4:])
    assert cu.export_ipc_tensor(t[2:])["key"] == h["key"]  # one key per allocation
    (export,) = acl_log.of("aclrtIpcMemGetExportKey")
    (malloc,) = acl_log.of("aclrtMalloc")
    assert (
        export.args["ptr"] == malloc.args["ptr"]
    )  # the whole allocation; the offset travels separately
    assert export.args["size"] == "4096"
    assert export.args["flags"] == ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION
    assert run_child(h) == f"ok sum={float(sum(range(4, 10)))}"
    assert torch.equal(t, torch.tensor([0, 1, 2, 3, 3, 3, 3, 3, 3, 3], dtype=torch.float32))
    del t
    gc.collect()
    order = [
        (c.name, c.args.get("side"))
        for c in acl_log.calls()
        if c.name in ("aclrtIpcMemImportByKey", "aclrtIpcMemClose", "aclrtFree")
    ]
    # Importer maps once (cached), closes once when its last tensor dies; then the exporter
    # closes its key and only then frees.
    assert order == [
        ("aclrtIpcMemImportByKey", None),
        ("aclrtIpcMemClose", "importer"),
        ("aclrtIpcMemClose", "exporter"),
        ("aclrtFree", None),
    ]
    (imp,) = acl_log.of("aclrtIpcMemImportByKey")
    assert imp.pid != os.getpid() and imp.args["key"] == h["key"]
    assert imp.args["flags"] == ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS
    assert all(c.rc == 0 for c in acl_log.calls())


def test_same_process_import_never_calls_acl_import(native, acl_log):
    cu = native.cuda_utils
    t = cu.alloc_tensor((5,), torch.int32, 0)
    u = cu.import_ipc_tensor(cu.export_ipc_tensor(t[1:]))
    assert u.data_ptr() == t.data_ptr() + 4
    assert acl_log.of("aclrtIpcMemImportByKey") == []
    del t
    gc.collect()
    assert acl_log.of("aclrtFree") == []  # the imported tensor keeps the allocation alive
    del u
    gc.collect()
    assert [c.name for c in acl_log.calls() if c.name in ("aclrtIpcMemClose", "aclrtFree")] == [
        "aclrtIpcMemClose",
        "aclrtFree",
    ]


def test_pid_allow_list(native, acl_log):
    cu = native.cuda_utils
    t = cu.alloc_tensor((4,), torch.float32, 0)
    t.fill_(1.0)
    h = cu.export_ipc_tensor(t, importer_pids=[os.getpid() + 100_000])  # nobody we start
    (export,) = acl_log.of("aclrtIpcMemGetExportKey")
    assert export.args["flags"] == ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT
    (allow,) = acl_log.of("aclrtIpcMemSetImportPid")
    assert allow.args["key"] == h["key"] and allow.args["num"] == "1"
    # A process that is not on the list is refused by ACL, and that surfaces with call and code.
    assert run_child(h) == "error call=aclrtIpcMemImportByKey code=107000"


def test_pid_allow_list_admits_the_listed_process(native):
    cu = native.cuda_utils
    t = cu.alloc_tensor((4,), torch.float32, 0)
    t.fill_(2.0)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; sys.stdout.write('go'); sys.stdout.flush();"
            "data = sys.stdin.buffer.read(); exec(compile(data.decode(), 'child', 'exec'))",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert child.stdout is not None
    assert child.stdout.read(2) == b"go"
    h = cu.export_ipc_tensor(t, importer_pids=[child.pid])
    script = CHILD.replace(
        "pickle.loads(sys.stdin.buffer.read())", f"pickle.loads({pickle.dumps(h)!r})"
    )
    out, err = child.communicate(script.encode(), timeout=60)
    assert child.returncode == 0, err.decode()
    assert out.decode().strip() == "ok sum=8.0"


def test_export_rejects(native):
    cu = native.cuda_utils
    with pytest.raises(ValueError, match="is not memory from deepinfer_ascend alloc_tensor"):
        cu.export_ipc_tensor(torch.zeros(3))
    with pytest.raises(ValueError, match="empty"):
        cu.export_ipc_tensor(cu.alloc_tensor((4,), torch.float32, 0)[2:2])
    with pytest.raises(TypeError, match=r"tensor must be a torch\.Tensor"):
        cu.export_ipc_tensor("x")


def test_import_validates_every_field(native):
    cu = native.cuda_utils
    t = cu.alloc_tensor((8,), torch.float32, 0)
    good = cu.export_ipc_tensor(t)
    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"backend": "cuda"}, ValueError, "exported by another backend"),
        ({"offset": 4096}, ValueError, "outside its 4096-byte allocation"),
        ({"shape": (1025,)}, ValueError, "outside its 4096-byte allocation"),
        ({"shape": (2, 2)}, ValueError, "differ in length"),
        ({"dtype": "complex64"}, TypeError, "not supported"),
        ({"key": ""}, ValueError, "not an ACL IPC key"),
        ({"device": "zero"}, TypeError, r"handle\['device'\] has the wrong type"),
    ]
    for change, exc, message in cases:
        with pytest.raises(exc, match=message):
            cu.import_ipc_tensor({**good, **change})
    bad = dict(good)
    del bad["pid"]
    with pytest.raises(ValueError, match="handle has no 'pid' field"):
        cu.import_ipc_tensor(bad)


def test_same_process_handle_after_free(native):
    cu = native.cuda_utils
    t = cu.alloc_tensor((8,), torch.float32, 0)
    h = cu.export_ipc_tensor(t)
    del t
    gc.collect()
    with pytest.raises(ValueError, match="its memory has been freed"):
        cu.import_ipc_tensor(h)
