"""The Ascend backend seen through deepinfer's registry: `deepinfer._C` and `deepinfer env`."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

import pytest

pytest.importorskip(
    "deepinfer.plugins.registry", reason="the deepinfer meta wheel is not installed"
)
try:  # the registry finds backends through entry points: a PYTHONPATH build has none
    metadata.distribution("deepinfer-ascend")
except metadata.PackageNotFoundError:
    pytest.skip("deepinfer-ascend is not installed as a distribution (its entry point is "
                "needed); run through `nox -s tests_ascend`", allow_module_level=True)


def _run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    full.update(env)
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=full, timeout=120
    )


def test_facade_resolves_to_ascend(fake_library):
    code = (
        "import torch\nfrom deepinfer._C import cuda_utils, graph_timer\n"
        "t = cuda_utils.alloc_tensor((2, 3), torch.float16, 0)\n"
        "print(type(graph_timer.EventHandle()).__module__, tuple(t.shape), t.dtype)\n"
    )
    done = _run("-c", code, DEEPINFER_ASCEND_LIBRARY=str(fake_library), DEEPINFER_BACKEND="ascend")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "deepinfer_ascend._native.graph_timer (2, 3) torch.float16"


def test_env_shows_the_probe(fake_library, tmp_path):
    done = _run("-m", "deepinfer", "env", DEEPINFER_ASCEND_LIBRARY=str(fake_library))
    assert done.returncode == 0, done.stderr
    assert "device_count: 2" in done.stdout and f"library: {fake_library}" in done.stdout
    done = _run("-m", "deepinfer", "env", LD_LIBRARY_PATH=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "libascendcl.so not found" in done.stdout
