"""Every backend exposes the same names, with the same argument names, and documents them."""

from __future__ import annotations

import pytest

CUDA_UTILS = ("alloc_tensor", "export_ipc_tensor", "import_ipc_tensor")
GRAPH_TIMER = ("EventHandle", "EventRecordNodeHandle", "GraphHandle")


def test_plugin_description(backend):
    d = backend.description
    assert d["name"] == backend.name
    assert d["distribution"] == f"deepinfer-{backend.name}"
    assert d["plugin_api_version"] == 1
    assert isinstance(d["priority"], int)
    assert isinstance(d["version"], str) and d["version"]
    probe = backend.probe
    assert set(probe) == {"available", "reason", "details"}
    assert probe["available"] is True and probe["reason"] == ""
    assert backend.device_count >= 1


@pytest.mark.parametrize("name", CUDA_UTILS)
def test_cuda_utils_names(backend, name):
    fn = getattr(backend.cuda_utils, name)
    assert callable(fn)
    assert fn.__doc__ and len(fn.__doc__.strip()) > 40


@pytest.mark.parametrize("name", GRAPH_TIMER)
def test_graph_timer_names_are_classes(backend, name):
    cls = getattr(backend.graph_timer, name)
    assert isinstance(cls, type)
    assert cls.__doc__ and cls.__doc__.strip()


def test_keyword_arguments(backend):
    import torch

    cu = backend.cuda_utils
    t = cu.alloc_tensor(shape=(4,), dtype=torch.float32, device=0)
    handle = cu.export_ipc_tensor(tensor=t)
    same = cu.import_ipc_tensor(handle=handle)
    assert same.data_ptr() == t.data_ptr()


def test_event_handle_methods(backend):
    ev = backend.graph_timer.EventHandle()
    for method in ("record", "query", "synchronize", "elapsed_ms"):
        assert callable(getattr(ev, method)), method
