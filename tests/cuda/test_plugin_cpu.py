"""CPU-side checks of the CUDA backend: plugin contract, probe reasons, argument checks.

The probe's failure paths are driven by a fake libcuda.so.1 (fake_libcuda.c, built with
the system C compiler) put first on LD_LIBRARY_PATH of a child interpreter.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib

HERE = Path(__file__).resolve().parent
PYPROJECT = HERE.parents[1] / "packages" / "deepinfer-cuda" / "pyproject.toml"


def _has_real_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _child(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_plugin_description_matches_the_wheel():
    from deepinfer_cuda.plugin import deepinfer_backend

    d = deepinfer_backend()
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert d["name"] == "cuda" and d["distribution"] == project["name"] == "deepinfer-cuda"
    assert d["version"] == project["version"]
    assert d["plugin_api_version"] == 1 and d["priority"] == 100
    assert callable(d["probe"]) and callable(d["load"])
    assert project["entry-points"]["deepinfer.backends"]["cuda"] == "deepinfer_cuda.plugin"


def test_plugin_and_probe_import_neither_deepinfer_nor_torch():
    proc = _child(
        """
        import json, sys
        from deepinfer_cuda.plugin import deepinfer_backend
        result = deepinfer_backend()["probe"]()
        print(json.dumps({"mods": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "deepinfer")),
                          "native": "deepinfer_cuda._native" in sys.modules, "result": result}))
        """
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["mods"] == [] and out["native"] is False
    assert set(out["result"]) == {"available", "reason", "details"}


@pytest.mark.skipif(_has_real_driver(), reason="this machine has libcuda.so.1")
def test_probe_says_no_driver_on_this_machine():
    from deepinfer_cuda._probe import probe

    result = probe()
    assert result["available"] is False
    assert result["reason"] == "libcuda.so.1 not found: no NVIDIA driver installed"
    assert "libcuda.so.1" in result["details"]["error"]


@pytest.mark.skipif(_has_real_driver(), reason="this machine has libcuda.so.1")
def test_native_calls_say_no_driver():
    import torch
    from deepinfer_cuda.plugin import deepinfer_backend

    native = deepinfer_backend()["load"]()
    with pytest.raises(RuntimeError, match=r"libcuda\.so\.1 not found: no NVIDIA driver installed"):
        native.cuda_utils.alloc_tensor((2,), torch.float32, 0)
    with pytest.raises(RuntimeError, match=r"libcuda\.so\.1 not found"):
        native.graph_timer.EventHandle()


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler (cc) to build the fake libcuda.so.1")
    out = tmp_path_factory.mktemp("fakecuda")
    subprocess.run(
        [cc, "-shared", "-fPIC", "-o", str(out / "libcuda.so.1"), str(HERE / "fake_libcuda.c")], check=True
    )
    return out


def _probe_with(fake_driver: Path, **env: str) -> dict:
    proc = _child(
        "import json; from deepinfer_cuda._probe import probe; print(json.dumps(probe()))",
        {"LD_LIBRARY_PATH": f"{fake_driver}:{os.environ.get('LD_LIBRARY_PATH', '')}", **env},
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"FAKE_CUDA_INIT_RESULT": "100"}, "cuInit failed with CUDA_ERROR_NO_DEVICE (100)"),
        ({"FAKE_CUDA_INIT_RESULT": "35"}, "cuInit failed with CUDA_ERROR_INSUFFICIENT_DRIVER (35)"),
        ({"FAKE_CUDA_INIT_RESULT": "999"}, "cuInit failed with CUDA_ERROR_UNKNOWN (999)"),
        ({"FAKE_CUDA_DRIVER_VERSION": "11080"}, "the NVIDIA driver supports CUDA 11.8; deepinfer-cuda needs CUDA 12.0 or newer"),
        ({"FAKE_CUDA_DEVICE_COUNT": "0"}, "the NVIDIA driver sees no CUDA device (check CUDA_VISIBLE_DEVICES)"),
        ({"FAKE_CUDA_COUNT_RESULT": "3"}, "cuDeviceGetCount failed with CUDA_ERROR_NOT_INITIALIZED (3)"),
    ],
)
def test_probe_failure_reasons(fake_driver, env, reason):
    result = _probe_with(fake_driver, **env)
    assert result["available"] is False
    assert result["reason"] == reason


def test_probe_details_when_available(fake_driver):
    result = _probe_with(fake_driver, FAKE_CUDA_DRIVER_VERSION="12040", FAKE_CUDA_DEVICE_COUNT="2")
    assert result == {
        "available": True,
        "reason": "",
        "details": {"library": str(fake_driver / "libcuda.so.1"), "driver_version": "12.4", "device_count": "2"},
    }


def test_native_module_refuses_a_pre_cuda_12_driver(fake_driver):
    proc = _child(
        """
        from deepinfer_cuda.graph_timer import EventHandle
        try:
            EventHandle(0)
        except RuntimeError as exc:
            print(exc)
        """,
        {"LD_LIBRARY_PATH": f"{fake_driver}:{os.environ.get('LD_LIBRARY_PATH', '')}"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "older than CUDA 12" in proc.stdout


def test_argument_checks_need_no_device():
    import torch
    from deepinfer_cuda import cuda_utils, graph_timer

    with pytest.raises(ValueError, match="shape"):
        cuda_utils.alloc_tensor((2, -1), torch.float32, 0)
    with pytest.raises(TypeError, match="shape"):
        cuda_utils.alloc_tensor((2, 1.5), torch.float32, 0)
    with pytest.raises(TypeError, match="dtype"):
        cuda_utils.alloc_tensor((2,), "float32", 0)
    with pytest.raises(ValueError, match="not a CUDA device"):
        cuda_utils.alloc_tensor((2,), torch.float32, "cpu")
    with pytest.raises(TypeError, match="device"):
        cuda_utils.alloc_tensor((2,), torch.float32, 1.0)
    with pytest.raises(TypeError, match="tensor"):
        cuda_utils.export_ipc_tensor([1, 2])
    with pytest.raises(ValueError, match="not on a CUDA device"):
        cuda_utils.export_ipc_tensor(torch.zeros(3))
    with pytest.raises(TypeError, match="CudaIpcHandle"):
        cuda_utils.import_ipc_tensor(b"\0" * 64)
    with pytest.raises(TypeError, match="CUDAGraph"):
        graph_timer.GraphHandle("not a graph")
