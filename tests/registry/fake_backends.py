"""Throw-away backend distributions for the registry tests.

Each fake is a real pure-Python wheel (built with hatchling) declaring an entry point in
group ``deepinfer.backends``, installed into a temporary venv beside the real ``deepinfer``
wheel. Nothing in the registry is patched: the tests only set DEEPINFER_* variables.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path

PLUGIN_TEMPLATE = '''
import os
import types

import pluggy

{import_failure}

hookimpl = pluggy.HookimplMarker("deepinfer")
NAME = {name!r}


def _probe():
    {probe_body}


def _load():
    marker = os.environ.get("FAKE_LOAD_MARKER")
    if marker:
        with open(marker, "a") as f:
            f.write(NAME + "\\n")
    native = types.ModuleType(NAME + "._native")
    cuda_utils = types.ModuleType(NAME + "._native.cuda_utils")
    graph_timer = types.ModuleType(NAME + "._native.graph_timer")
    for fn in ("alloc_tensor", "export_ipc_tensor", "import_ipc_tensor"):
        setattr(cuda_utils, fn, (lambda fn: lambda *a, **k: (NAME, fn))(fn))
    for cls in ("EventHandle", "EventRecordNodeHandle", "GraphHandle"):
        setattr(graph_timer, cls, type(cls, (), {{"backend": NAME}}))
    native.cuda_utils, native.graph_timer = cuda_utils, graph_timer
    return native


@hookimpl
def deepinfer_backend():
    counter = os.environ.get("FAKE_REGISTER_COUNTER")
    if counter:
        with open(counter, "a") as f:
            f.write(NAME + "\\n")
    return {{
        "name": NAME,
        "distribution": {dist!r},
        "version": "1.2.3",
        "plugin_api_version": {api},
        "priority": {priority},
        "probe": _probe,
        "load": _load,
    }}
'''


@dataclass(frozen=True)
class FakeBackend:
    name: str
    priority: int = 50
    api: int = 1
    reason: str = ""  # non-empty: the probe says unavailable with this reason
    import_error: str = ""  # non-empty: importing the plugin module raises ImportError(this)
    probe_raises: str = ""  # non-empty: the probe raises RuntimeError(this)

    @property
    def dist(self) -> str:
        return f"fake-backend-{self.name}"

    def write_project(self, root: Path) -> Path:
        project = root / self.dist
        package = project / f"fake_backend_{self.name}"
        package.mkdir(parents=True)
        if self.probe_raises:
            probe_body = f"raise RuntimeError({self.probe_raises!r})"
        elif self.reason:
            probe_body = f'return {{"available": False, "reason": {self.reason!r}, "details": {{}}}}'
        else:
            probe_body = 'return {"available": True, "reason": "", "details": {"devices": "1"}}'
        import_failure = f"raise ImportError({self.import_error!r})" if self.import_error else ""
        (package / "__init__.py").write_text("")
        (package / "plugin.py").write_text(
            PLUGIN_TEMPLATE.format(
                name=self.name,
                dist=self.dist,
                api=self.api,
                priority=self.priority,
                probe_body=probe_body,
                import_failure=import_failure,
            )
        )
        (project / "pyproject.toml").write_text(
            textwrap.dedent(
                f"""
                [build-system]
                requires = ["hatchling"]
                build-backend = "hatchling.build"

                [project]
                name = "{self.dist}"
                version = "1.2.3"
                dependencies = ["pluggy"]

                [project.entry-points."deepinfer.backends"]
                {self.name} = "fake_backend_{self.name}.plugin"

                [tool.hatch.build.targets.wheel]
                packages = ["fake_backend_{self.name}"]
                """
            )
        )
        return project


FAKES = (
    FakeBackend("alpha", priority=50),
    FakeBackend("beta", priority=70, reason="no beta device found (fake)"),
    FakeBackend("gamma", priority=90, import_error="gamma needs libgamma.so (fake)"),
    FakeBackend("delta", priority=99, api=99),
    FakeBackend("epsilon", priority=50),
    FakeBackend("zeta", priority=80, probe_raises="zeta probe exploded (fake)"),
    FakeBackend("omega", priority=10),
)
