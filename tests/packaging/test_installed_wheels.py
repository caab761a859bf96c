"""The packaging session's checks: a fresh venv gets deepinfer[cuda] and deepinfer[ascend]
from dist/ only (``--no-index --find-links dist``), and discovery, resolution and
``deepinfer env`` work from the installed wheels, not from the source tree.

Third-party dependencies (torch pinned by constraints.txt, transformers, ...) come from the
machine's package index first; every deepinfer wheel comes from dist/.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DIST = Path(os.environ.get("DEEPINFER_TEST_DIST", REPO / "dist"))
CONSTRAINTS = os.environ.get("DEEPINFER_CONSTRAINTS", str(REPO / "constraints.txt"))
THIRD_PARTY = ["torch", "transformers", "tokenizers", "safetensors", "gguf", "jinja2", "tqdm",
               "numpy", "pluggy", "xgrammar"]

pytestmark = pytest.mark.skipif(
    not list(DIST.glob("deepinfer-*.whl")), reason="dist/ has no wheels: run `nox -s build`"
)


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("packaging") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    pip = [str(root / "bin" / "python"), "-m", "pip", "install", "-q"]
    try:
        subprocess.run([*pip, "-c", CONSTRAINTS, *THIRD_PARTY], check=True)
        subprocess.run([*pip, "--no-index", "--find-links", str(DIST), "deepinfer[cuda]"], check=True)
        yield root
    finally:  # ~2 GB with torch: pytest keeps its last three temp folders, not their venvs
        shutil.rmtree(root, ignore_errors=True)


def _run(venv: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    clean.pop("PYTHONPATH", None)
    clean.update(env)
    return subprocess.run(list(args), capture_output=True, text=True, env=clean,
                          cwd=venv.parent, timeout=300)


def _env_report(venv: Path) -> dict:
    proc = _run(venv, str(venv / "bin" / "deepinfer"), "env", "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_cuda_extra_installs_engine_backend_and_graph_timer_from_dist(venv: Path):
    report = _env_report(venv)
    for dist in ("deepinfer", "deepinfer-engine", "deepinfer-cuda", "deepinfer-graph-timer"):
        assert report["packages"][dist] is not None, f"{dist} not installed by deepinfer[cuda]"
    assert report["packages"]["deepinfer-ascend"] is None


def test_cuda_backend_is_discovered_but_unavailable_here_with_the_reason(venv: Path):
    report = _env_report(venv)
    (cuda,) = [b for b in report["backends"] if b["name"] == "cuda"]
    assert cuda["distribution"] == "deepinfer-cuda"
    assert cuda["load_error"] is None
    assert cuda["plugin_api_version"] == report["plugin_api_version"]
    if not cuda["probe"]["available"]:  # this CPU machine: no driver, or no device
        reason = cuda["probe"]["reason"].lower()
        assert "libcuda" in reason or "driver" in reason or "device" in reason, reason
        assert report["selected_backend"] is None


def test_engine_imports_from_the_installed_wheel(venv: Path):
    code = (
        "import deepinfer, deepinfer_engine\n"
        "from deepinfer._C.engine import Scheduler\n"
        "import deepinfer._C.engine as e\n"
        "print(deepinfer.__file__); print(deepinfer_engine.__file__); print(len(e.__all__))"
    )
    proc = _run(venv, str(venv / "bin" / "python"), "-c", code)
    assert proc.returncode == 0, proc.stderr
    meta_file, engine_file, count = proc.stdout.split()
    assert meta_file.startswith(str(venv)) and engine_file.startswith(str(venv))
    assert int(count) == 35  # the seed's 34 names + SamplingParams


def test_backend_submodules_raise_import_error_listing_each_backend(venv: Path):
    proc = _run(venv, str(venv / "bin" / "python"), "-c", "import deepinfer._C.cuda_utils")
    report = _env_report(venv)
    if report["selected_backend"] is not None:
        pytest.skip("a GPU backend is usable here; the no-backend error cannot be observed")
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr or "BackendUnavailableError" in proc.stderr
    assert "cuda (entry point 'cuda' from deepinfer-cuda" in proc.stderr
    assert "deepinfer._C.engine works without one" in proc.stderr


def test_python_dash_m_deepinfer_env_matches_the_command(venv: Path):
    proc = _run(venv, str(venv / "bin" / "python"), "-m", "deepinfer", "env")
    assert proc.returncode == 0, proc.stderr
    assert "Backends (entry points in 'deepinfer.backends')" in proc.stdout
    assert "cuda" in proc.stdout and "DEEPINFER_BACKEND=(unset)" in proc.stdout


def test_ascend_extra_adds_the_ascend_backend(venv: Path):
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    proc = _run(venv, *pip, "--no-index", "--find-links", str(DIST), "deepinfer[ascend]")
    assert proc.returncode == 0, proc.stderr
    report = _env_report(venv)
    assert report["packages"]["deepinfer-ascend"] is not None
    (ascend,) = [b for b in report["backends"] if b["name"] == "ascend"]
    assert ascend["load_error"] is None
    assert not ascend["probe"]["available"]
    assert "libascendcl" in ascend["probe"]["reason"]


def test_meta_package_declares_version_ranges_for_its_extras(venv: Path):
    code = (
        "from importlib.metadata import requires\n"
        "print('\\n'.join(requires('deepinfer')))"
    )
    proc = _run(venv, str(venv / "bin" / "python"), "-c", code)
    reqs = [r.replace('"', "'") for r in proc.stdout.splitlines()]
    for dep, extra in (("deepinfer-cuda", "cuda"), ("deepinfer-ascend", "ascend"),
                       ("deepinfer-graph-timer", "cuda"), ("deepinfer-graph-timer", "ascend")):
        assert any(r.startswith(dep) and "<" in r and ">=" in r and f"extra == '{extra}'" in r
                   for r in reqs), (dep, extra, reqs)
    assert any(r.startswith("deepinfer-engine") and "<" in r for r in reqs), reqs


def test_serve_extra_resolves_from_dist_and_serve_says_when_it_is_missing(venv: Path):
    serve = str(venv / "bin" / "deepinfer")
    proc = _run(venv, serve, "serve", "--port", "0")
    assert proc.returncode == 2, proc.stderr  # before the extra: a one-line hint, no model load
    assert "pip install 'deepinfer[serve]'" in proc.stderr
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    proc = _run(venv, *pip, "-c", CONSTRAINTS, "fastapi", "uvicorn", "prometheus-client", "pydantic", "pyzmq",
                "msgspec", "orjson", "uvloop", "httptools")
    assert proc.returncode == 0, proc.stderr
    proc = _run(venv, *pip, "--no-index", "--find-links", str(DIST), "deepinfer[serve]")
    assert proc.returncode == 0, proc.stderr
    code = ("from importlib.metadata import requires\n"
            "import deepinfer.serve.app\n"
            "print('\\n'.join(r for r in requires('deepinfer') if 'serve' in r))")
    proc = _run(venv, str(venv / "bin" / "python"), "-c", code)
    assert proc.returncode == 0, proc.stderr
    assert {line.split(">")[0] for line in proc.stdout.splitlines()} >= {"fastapi", "uvicorn", "prometheus-client"}
    proc = _run(venv, serve, "serve", "--help")
    assert proc.returncode == 0 and "--shutdown-timeout" in proc.stdout, proc.stderr
