"""The backend conformance suite: the same tests for every backend, parametrized by name.

Each backend is loaded the way the registry loads it, through its plugin:
``deepinfer_<name>.plugin.deepinfer_backend()["load"]()``. A backend whose wheel is not
installed is skipped with that reason; one whose probe says unavailable is skipped with the
probe's reason. On machines without an NPU the Ascend backend runs against the fake
``libascendcl.so`` of tests/ascend/fake_acl (set DEEPINFER_ASCEND_REAL=1 to use the
real library instead). Per-backend facts live in backends.py.

Select backends with DEEPINFER_CONFORMANCE_BACKENDS=cuda,ascend (default: all known).
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backends import ADAPTERS, Adapter


@dataclass
class Backend:
    """A loaded backend under test."""

    name: str
    native: ModuleType
    adapter: Adapter
    description: dict[str, Any]
    probe: dict[str, Any]

    @property
    def cuda_utils(self) -> Any:
        return self.native.cuda_utils

    @property
    def graph_timer(self) -> Any:
        return self.native.graph_timer

    @property
    def device_count(self) -> int:
        return int(self.probe["details"]["device_count"])


def _selected() -> list[str]:
    raw = os.environ.get("DEEPINFER_CONFORMANCE_BACKENDS")
    return [n.strip() for n in raw.split(",") if n.strip()] if raw else sorted(ADAPTERS)


_loaded: dict[str, Backend] = {}


def _load(name: str) -> Backend:
    if name in _loaded:
        return _loaded[name]
    try:
        plugin = importlib.import_module(f"deepinfer_{name}.plugin")
    except ModuleNotFoundError as exc:
        if exc.name in (f"deepinfer_{name}", f"deepinfer_{name}.plugin"):
            pytest.skip(f"deepinfer-{name} is not installed (no module deepinfer_{name})")
        raise
    adapter = ADAPTERS[name]()
    adapter.prepare()
    description = plugin.deepinfer_backend()
    probe = description["probe"]()
    if not probe["available"]:
        pytest.skip(f"backend {name!r} unavailable: {probe['reason']}")
    backend = Backend(name, description["load"](), adapter, description, probe)
    _loaded[name] = backend
    return backend


@pytest.fixture(params=_selected(), scope="session")
def backend(request: pytest.FixtureRequest) -> Backend:
    return _load(request.param)
