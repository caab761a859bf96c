"""Every ACL error code the backend can meet surfaces as AclError naming the call and the code."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

CODE = 507899  # any non-zero aclError; the fake returns it from the injected call


def _alloc(native, fake, stream):
    native.cuda_utils.alloc_tensor((4,), torch.float32, 0)


def _export(native, fake, stream):
    native.cuda_utils.export_ipc_tensor(native.cuda_utils.alloc_tensor((4,), torch.float32, 0))


def _export_allow_list(native, fake, stream):
    native.cuda_utils.export_ipc_tensor(
        native.cuda_utils.alloc_tensor((4,), torch.float32, 0), importer_pids=[1]
    )


def _event(native, fake, stream):
    native.graph_timer.EventHandle()


def _record(native, fake, stream):
    native.graph_timer.EventHandle().record(stream)


def _query(native, fake, stream):
    native.graph_timer.EventHandle().query()


def _sync(native, fake, stream):
    native.graph_timer.EventHandle().synchronize()


def _elapsed(native, fake, stream):
    gt = native.graph_timer
    a, b = gt.EventHandle(), gt.EventHandle()
    a.record(stream)
    b.record(stream)
    a.elapsed_ms(b)


def _captured(native, fake, stream):
    g = native.graph_timer.GraphHandle()
    g.capture_begin(stream)
    native.graph_timer.EventHandle().record(stream)
    g.capture_end()
    return g


def _begin(native, fake, stream):
    native.graph_timer.GraphHandle().capture_begin(stream)


def _end(native, fake, stream):
    g = native.graph_timer.GraphHandle()
    g.capture_begin(stream)
    g.capture_end()  # each test has its own stream: a stream left capturing harms nobody


def _replay(native, fake, stream):
    _captured(native, fake, stream).replay(stream)


def _nodes(native, fake, stream):
    _captured(native, fake, stream).nodes()


def _swap(native, fake, stream):
    g = _captured(native, fake, stream)
    (node,) = g.event_record_nodes()
    node.set_event(native.graph_timer.EventHandle())


def _destroy(native, fake, stream):
    _captured(native, fake, stream).destroy()


CASES = [
    ("aclrtGetDeviceCount", _alloc),
    ("aclrtSetDevice", _alloc),
    ("aclrtMalloc", _alloc),
    ("aclrtIpcMemGetExportKey", _export),
    ("aclrtIpcMemSetImportPid", _export_allow_list),
    ("aclrtCreateEventWithFlag", _event),
    ("aclrtRecordEvent", _record),
    ("aclrtQueryEventStatus", _query),
    ("aclrtSynchronizeEvent", _sync),
    ("aclrtEventElapsedTime", _elapsed),
    ("aclmdlRICaptureBegin", _begin),
    ("aclmdlRICaptureGetInfo", _begin),
    ("aclmdlRICaptureEnd", _end),
    ("aclmdlRIExecuteAsync", _replay),
    ("aclmdlRIGetStreams", _nodes),
    ("aclmdlRIGetTasksByStream", _nodes),
    ("aclmdlRITaskGetType", _nodes),
    ("aclmdlRITaskGetParams", _swap),
    ("aclmdlRITaskSetParams", _swap),
    ("aclmdlRIUpdate", _swap),
    ("aclmdlRIDestroy", _destroy),
]


@pytest.mark.parametrize(("call", "operation"), CASES, ids=[c for c, _ in CASES])
def test_injected_error_names_call_and_code(native, fake, stream, inject, call, operation):
    inject(call, CODE)
    with pytest.raises(native.AclError) as info:
        operation(native, fake, stream)
    assert isinstance(info.value, RuntimeError)
    err: Any = info.value
    assert (err.call, err.code) == (call, CODE)
    assert str(err) == f"{call} failed with ACL error {CODE}"


def test_error_type_is_exported_everywhere(native):
    assert native.cuda_utils.AclError is native.graph_timer.AclError is native.AclError
    assert issubclass(native.AclError, RuntimeError)


def test_failed_malloc_leaves_nothing_behind(native, inject, acl_log):
    inject("aclrtMalloc", 207001)
    with pytest.raises(native.AclError, match="aclrtMalloc failed with ACL error 207001"):
        native.cuda_utils.alloc_tensor((1 << 20,), torch.float32, 0)
    gc.collect()
    assert acl_log.of("aclrtFree") == []


def test_failed_free_is_reported_not_raised(native, inject, acl_log, capfd):
    t = native.cuda_utils.alloc_tensor((4,), torch.float32, 0)
    inject("aclrtFree", 107000)
    del t
    gc.collect()
    assert "aclrtFree failed with ACL error 107000" in capfd.readouterr().err


def test_failed_import_in_another_process(native, fake_library):
    # aclrtIpcMemImportByKey only happens in an importing process: inject it there.
    import pickle

    cu = native.cuda_utils
    h = cu.export_ipc_tensor(cu.alloc_tensor((4,), torch.float32, 0))
    code = (
        "import pickle, sys\nfrom deepinfer_ascend.plugin import load\n"
        "n = load()\ntry:\n    n.cuda_utils.import_ipc_tensor(pickle.loads(sys.stdin.buffer.read()))\n"
        "except n.AclError as e:\n    print(type(e).__name__, e.call, e.code, e)\n"
    )
    env = dict(os.environ, DEEPINFER_FAKE_ACL_FAIL="aclrtIpcMemImportByKey:507899")
    done = subprocess.run(
        [sys.executable, "-c", code],
        input=pickle.dumps(h),
        capture_output=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == (
        "AclError aclrtIpcMemImportByKey 507899 aclrtIpcMemImportByKey failed with ACL error 507899"
    )


def test_failed_acl_init_is_retried(fake_library):
    # In a fresh process: aclInit fails once (the error names it), then works when ACL recovers.
    code = (
        "import os, torch\nfrom deepinfer_ascend.plugin import load\nn = load()\n"
        "try:\n    n.cuda_utils.alloc_tensor((2,), torch.float32, 0)\n"
        "except n.AclError as e:\n    print(e.call, e.code)\n"
        "del os.environ['DEEPINFER_FAKE_ACL_FAIL']\n"
        "print(n.cuda_utils.alloc_tensor((2,), torch.float32, 0).shape)\n"
    )
    env = dict(
        os.environ,
        DEEPINFER_FAKE_ACL_FAIL="aclInit:100000",
        DEEPINFER_ASCEND_LIBRARY=str(fake_library),
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["aclInit 100000", "torch.Size([2])"]


def test_no_library_error_from_native_calls(tmp_path):
    # The native module used without any libascendcl.so: a RuntimeError with the probe's reason.
    code = (
        "import torch\nfrom deepinfer_ascend.plugin import load\n"
        "try:\n    load().cuda_utils.alloc_tensor((2,), torch.float32, 0)\n"
        "except RuntimeError as e:\n    print(e)\n"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DEEPINFER_ASCEND_LIBRARY", "ASCEND_TOOLKIT_HOME")
    }
    env["LD_LIBRARY_PATH"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(
        "deepinfer-ascend cannot use AscendCL: libascendcl.so not found (searched"
    )


def test_missing_inspection_api_is_named(fake_library, fakeacl_module):
    # A CANN release without aclmdlRIGetStreams & co.: capture and replay still work, and the
    # calls that need the missing symbols raise NotImplementedError naming them.
    old = fakeacl_module.build_fake_library(("DEEPINFER_FAKE_ACL_OMIT_INSPECTION",))
    code = (
        "import ctypes\nfrom deepinfer_ascend.plugin import load\n"
        "gt = load().graph_timer\nlib = ctypes.CDLL(__import__('os').environ['DEEPINFER_ASCEND_LIBRARY'])\n"
        "ev = gt.EventHandle(0)\ns = ctypes.c_void_p(); assert lib.aclrtCreateStream(ctypes.byref(s)) == 0\n"
        "g = gt.GraphHandle(device=0); g.capture_begin(s.value); ev.record(s.value); g.capture_end()\n"
        "g.replay(s.value); ev.synchronize(); print(ev.query())\n"
        "for f in (g.kernel_nodes, lambda: g.find_event_record_node(ev)):\n"
        "    try:\n        f()\n    except NotImplementedError as e:\n        print(e)\n"
    )
    env = dict(os.environ, DEEPINFER_ASCEND_LIBRARY=str(old))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0, done.stderr
    message = f"the loaded libascendcl.so ({old}) has no aclmdlRIGetStreams; this needs a newer CANN release"
    assert done.stdout.splitlines() == ["True", message, message]
