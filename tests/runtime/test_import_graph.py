"""The import graph of ``deepinfer`` has no arrow pointing back up and no cycle.

Every import in every module of the installed ``deepinfer`` package — at the top, inside
functions and under ``TYPE_CHECKING`` alike — is read with ``ast`` (nothing is imported). Each
module belongs to a room (``docs/architecture.md``, "The runtime map"); rooms are ordered top to
bottom and an import may only point to the same room or a room below. Within a room, modules
must not import each other in a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

# Top to bottom. A module belongs to the longest prefix listed; one row may hold several rooms
# that do not import each other.
ROOMS: list[tuple[str, ...]] = [
    ("deepinfer.__main__",),
    ("deepinfer.cli",),
    ("deepinfer.serve",),
    ("deepinfer",),  # the package root: lazy LLM / SamplingParams
    ("deepinfer.runtime", "deepinfer.runtime.llm"),
    ("deepinfer.runtime.beam_search",),
    ("deepinfer.runtime.bench_metrics",),
    ("deepinfer.runtime.engine",),
    ("deepinfer.runtime.speculative", "deepinfer.runtime.structured"),
    ("deepinfer.runtime.distributed",),
    ("deepinfer.runtime.worker",),
    ("deepinfer.runtime.sampling",),
    ("deepinfer.runtime.loading",),
    ("deepinfer.runtime.parallel",),
    ("deepinfer.runtime.models",),
    ("deepinfer.runtime.attention",),
    ("deepinfer.runtime.kernels",),
    ("deepinfer.runtime.engine_args", "deepinfer.runtime.sampling_params", "deepinfer.runtime.interrupts",
     "deepinfer.runtime.switches", "deepinfer.runtime.host_to_device"),
    # speculative_config's keys (read by engine_args), StructuredOutputsParams (read by sampling_params)
    ("deepinfer.runtime.speculative.config", "deepinfer.runtime.structured.params",
     "deepinfer.runtime.sampling.logits_processors"),
    ("deepinfer.timer",),
    ("deepinfer._C",),
    ("deepinfer.plugins",),
]


def _package_root() -> Path:
    import deepinfer

    return Path(deepinfer.__file__).parent


def _modules(root: Path, package: str) -> dict[str, Path]:
    found = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).with_suffix("")
        parts = [package, *rel.parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``name`` imports (a ``from M import x`` of a submodule x
    counts as an import of M.x)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import a.b.c` of a non-module attribute: its module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _room(module: str) -> tuple[int, str]:
    best: tuple[int, str] | None = None
    for level, prefixes in enumerate(ROOMS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[1])):
                best = (level, prefix)
    assert best is not None, f"{module} is in no room of the map: add it to ROOMS and docs/architecture.md"
    return best


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules(_package_root(), "deepinfer")
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def test_the_map_knows_every_module(graph):
    for module in graph:
        _room(module)


def test_no_import_points_back_up(graph):
    up = []
    for module, targets in sorted(graph.items()):
        level, room = _room(module)
        for t in sorted(targets):
            t_level, t_room = _room(t)
            if t_level < level or (t_level == level and t_room != room and not t.startswith(room + ".")):
                up.append(f"{module} -> {t}")
    assert not up, "imports that point back up:\n" + "\n".join(up)


def test_no_import_cycle(graph):
    # Tarjan's strongly connected components; any component of more than one module is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_checker_sees_an_arrow_back_up_and_a_cycle(tmp_path):
    # The checker itself on a made-up package: it must report what it is there to report.
    pkg = tmp_path / "deepinfer"
    (pkg / "runtime" / "models").mkdir(parents=True)
    (pkg / "runtime" / "engine").mkdir()
    for d in (pkg, pkg / "runtime", pkg / "runtime" / "models", pkg / "runtime" / "engine"):
        (d / "__init__.py").write_text("")
    (pkg / "runtime" / "models" / "a.py").write_text("from deepinfer.runtime.engine import loop\n")
    (pkg / "runtime" / "engine" / "loop.py").write_text("from deepinfer.runtime.models import a\n")
    mods = _modules(pkg, "deepinfer")
    g = {m: _imports(m, p, set(mods)) for m, p in mods.items()}
    assert g["deepinfer.runtime.models.a"] == {"deepinfer.runtime.engine.loop"}
    assert g["deepinfer.runtime.engine.loop"] == {"deepinfer.runtime.models.a"}
    assert _room("deepinfer.runtime.models.a")[0] > _room("deepinfer.runtime.engine.loop")[0]


def test_the_graph_timer_wheel_imports_nothing_of_the_meta_package():
    root = Path(__file__).resolve().parents[2] / "packages" / "deepinfer-graph-timer" / "src" / "deepinfer_graph_timer"
    if not root.is_dir():
        pytest.skip("the graph-timer sources are not beside the tests (an installed-only run)")
    for path in root.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "deepinfer" or n.startswith("deepinfer.") for n in names), \
                f"{path.name} imports the meta package ({names})"
        assert "import_module(\"deepinfer" not in text and "import_module('deepinfer" not in text, \
            f"{path.name} imports the meta package through importlib"
