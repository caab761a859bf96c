"""A temporary venv holding the real ``deepinfer`` wheel and the fake backend wheels."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest
from fake_backends import FAKES

REPO = Path(__file__).resolve().parents[2]


def _wheel(project: Path, out: Path) -> Path:
    before = set(out.glob("*.whl"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
         "-w", str(out), str(project)],
        check=True,
    )
    (wheel,) = set(out.glob("*.whl")) - before
    return wheel


def _meta_wheel(tmp: Path) -> Path:
    """The wheel nox built into dist/ when there is one, else one built from the source tree."""
    dist = os.environ.get("DEEPINFER_TEST_DIST")
    if dist:
        found = sorted(Path(dist).glob("deepinfer-*.whl"))
        if found:
            return found[-1]
    return _wheel(REPO / "deepinfer-meta", tmp)


def _copy_installed(dist_name: str, site: Path) -> None:
    """Copy an installed pure-Python distribution (package + dist-info) into ``site``."""
    dist = metadata.distribution(dist_name)
    for top in {Path(str(f)).parts[0] for f in dist.files or []}:
        src = Path(str(dist.locate_file(top)))
        if src.is_dir():
            shutil.copytree(src, site / top, dirs_exist_ok=True)


@pytest.fixture(scope="session")
def fake_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("registry")
    wheels = tmp / "wheels"
    wheels.mkdir()
    built = [_wheel(fake.write_project(tmp / "src"), wheels) for fake in FAKES]
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(
        sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)})
    )
    _copy_installed("pluggy", site)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed",
         "--prefix", str(venv), str(_meta_wheel(tmp)), *map(str, built)],
        check=True,
    )
    return venv


class Venv:
    def __init__(self, root: Path, tmp: Path) -> None:
        self.python = root / "bin" / "python"
        self.tmp = tmp

    def run(self, code: str, **env: str) -> subprocess.CompletedProcess[str]:
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("DEEPINFER_", "FAKE_"))}
        clean.pop("PYTHONPATH", None)
        clean["DEEPINFER_DEVICE_ROOT"] = str(self.tmp / "no-devices")
        clean.update(env)
        return subprocess.run(
            [str(self.python), "-c", code], capture_output=True, text=True, env=clean,
            cwd=self.tmp, timeout=120,
        )

    def env_report(self, **env: str) -> dict:
        proc = self.run("from deepinfer.cli import main; main(['env', '--json'])", **env)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    def import_error(self, module: str, **env: str) -> str:
        proc = self.run(f"import {module}", **env)
        assert proc.returncode != 0, f"importing {module} unexpectedly worked: {proc.stdout}"
        assert "BackendUnavailableError" in proc.stderr, proc.stderr
        return proc.stderr


@pytest.fixture
def venv(fake_venv: Path, tmp_path: Path) -> Venv:
    return Venv(fake_venv, tmp_path)
