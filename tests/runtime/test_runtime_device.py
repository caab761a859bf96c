"""The runtime's device follows the backend the plugin registry selects (fake registry records)."""

from __future__ import annotations

import pytest
from deepinfer.plugins import devices as backend_devices
from deepinfer.plugins import env_report
from deepinfer.plugins.registry import BackendUnavailableError, registry
from deepinfer.runtime.worker import device as rd


class _Record:
    def __init__(self, name: str) -> None:
        self.name = name


@pytest.fixture
def selected(monkeypatch):
    """Make the registry resolve to a backend of the given name (None: no usable backend)."""
    def choose(name):
        def resolve():
            if name is None:
                raise BackendUnavailableError("no accelerator backend is available")
            return _Record(name)
        monkeypatch.setattr(registry, "resolve", resolve)
    return choose


def test_cuda_backend_gives_the_cuda_device_when_torch_has_cuda(selected, monkeypatch):
    selected("cuda")
    monkeypatch.setattr(backend_devices, "_torch_cuda_available", lambda: True)
    assert rd.resolve_runtime_device(None) == rd.RuntimeDevice("cuda", "cuda", "the CUDA backend is selected")
    monkeypatch.setattr(backend_devices, "_torch_cuda_available", lambda: False)
    where = rd.resolve_runtime_device(None)
    assert (where.device, where.backend) == ("cpu", "cpu") and "no CUDA" in where.reason


def test_ascend_backend_gives_the_npu_device_only_when_torch_npu_works(selected, monkeypatch):
    selected("ascend")
    monkeypatch.setattr(backend_devices, "_torch_npu_available", lambda: True)
    assert rd.resolve_runtime_device(None).device == "npu"
    monkeypatch.setattr(backend_devices, "_torch_npu_available", lambda: False)
    where = rd.resolve_runtime_device(None)
    assert where.device == "cpu" and "torch_npu" in where.reason


def test_no_backend_gives_cpu_and_ignores_torch_cuda(selected, monkeypatch):
    selected(None)
    monkeypatch.setattr(backend_devices, "_torch_cuda_available", lambda: True)  # CUDA alone does not pick the device
    assert rd.resolve_runtime_device(None) == rd.RuntimeDevice("cpu", "cpu", "no accelerator backend is available")


def test_an_explicit_device_wins_and_bad_ones_are_refused(selected):
    selected("cuda")
    assert rd.resolve_runtime_device("cpu").backend == "cpu"
    assert rd.resolve_runtime_device("cuda:1") == rd.RuntimeDevice("cuda:1", "cuda", "asked for with device=")
    with pytest.raises(ValueError, match="device must be a string"):
        rd.resolve_runtime_device("")


def test_a_device_torch_does_not_know_is_a_valueerror_saying_what_to_use():
    """(torch's own RuntimeError lists every device type it parses, and none of what to install.)"""
    from deepinfer.runtime.worker.worker import runtime_device

    for bad in ("tpu", "cuda:x", "gpu0"):
        with pytest.raises(ValueError, match=rf"^device='{bad}' is not a device this torch knows: use 'cpu', 'cuda'"):
            runtime_device(bad)
    try:
        import torch_npu  # noqa: F401
    except ImportError:  # (without it torch does not parse "npu")
        with pytest.raises(ValueError, match=r"^device='npu' needs torch_npu.*deepinfer\[ascend\]"):
            runtime_device("npu")
    assert str(runtime_device("cpu:0")[0]) == "cpu:0"


def test_env_report_says_which_backend_serves_the_runtime(selected, monkeypatch):
    selected("cuda")
    monkeypatch.setattr(backend_devices, "_torch_cuda_available", lambda: True)
    monkeypatch.setattr(registry, "discover", lambda: [])
    report = env_report.collect()
    assert report["runtime"] == {"device": "cuda", "backend": "cuda", "reason": "the CUDA backend is selected"}
    assert "Runtime (deepinfer.LLM): device cuda, served by backend cuda" in env_report.render(report)


def test_llm_reports_its_backend(selected, tmp_path):
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from deepinfer import LLM
    from gpu_shapes import write_shape_dir

    selected(None)
    llm = LLM(write_shape_dir(str(tmp_path), "test-small"), dummy_weights=True, max_model_len=64,
              cpu_kv_cache_bytes=1 << 22)
    assert llm.backend == "cpu" and str(llm.device) == "cpu" and llm.runner.graphs is None
    assert "backend='cpu'" in repr(llm) and "cuda_graphs=off" in repr(llm)


def test_enforce_eager_must_be_a_bool(selected, tmp_path):
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from deepinfer import LLM
    from gpu_shapes import write_shape_dir

    selected(None)
    with pytest.raises(TypeError, match="enforce_eager must be a bool"):
        LLM(write_shape_dir(str(tmp_path), "test-small"), dummy_weights=True, enforce_eager="yes")
