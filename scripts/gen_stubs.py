"""Generate the committed ``.pyi`` stubs of ``deepinfer._C`` with pybind11-stubgen.

    python scripts/gen_stubs.py           check: exit 1 when a committed stub is stale
    python scripts/gen_stubs.py --write   rewrite the committed stubs

Sources: ``deepinfer_engine._engine`` for ``engine.pyi``; the CUDA backend's native
``graph_timer`` for ``graph_timer.pyi`` (every backend has the same signatures, checked by
tests/conformance). Each starts with its header from scripts/stub_headers/ (for engine.pyi:
the rules shared by many names). Names are rewritten from the native module paths to the
facade's, since users import them from ``deepinfer._C``.

``cuda_utils.pyi`` is kept by hand because the CUDA backend's ``cuda_utils`` is a Python
layer (torch conversion) over the native module; this script checks that its functions and
parameter names match the backend's.
"""

from __future__ import annotations

import ast
import difflib
import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "deepinfer-meta" / "src" / "deepinfer" / "_C"
HEADERS = ROOT / "scripts" / "stub_headers"


def _reference_backend() -> ModuleType:
    from deepinfer_cuda import plugin  # the reference backend for the shared signatures

    return plugin.deepinfer_backend()["load"]()  # type: ignore[no-any-return]


def _native_modules() -> dict[str, str]:
    """facade stub file -> native module that stubgen reads."""
    return {
        "engine.pyi": "deepinfer_engine._engine",
        "graph_timer.pyi": _reference_backend().graph_timer.__name__,
    }


def check_hand_kept_cuda_utils() -> list[str]:
    """Differences between cuda_utils.pyi and the reference backend's functions."""
    stub = ast.parse((OUT / "cuda_utils.pyi").read_text())
    in_stub = {
        node.name: [a.arg for a in node.args.args + node.args.kwonlyargs]
        for node in stub.body if isinstance(node, ast.FunctionDef)
    }
    module = _reference_backend().cuda_utils
    problems = []
    for name in ("alloc_tensor", "export_ipc_tensor", "import_ipc_tensor"):
        actual = list(inspect.signature(getattr(module, name)).parameters)
        if in_stub.get(name) != actual:
            problems.append(f"cuda_utils.pyi: {name}{tuple(in_stub.get(name) or ())} but the "
                            f"backend has {name}{tuple(actual)}")
    return problems


def _stubgen(module: str, tmp: Path) -> str:
    subprocess.run(
        [sys.executable, "-m", "pybind11_stubgen", "--numpy-array-wrap-with-annotated",
         "-o", str(tmp), module],
        check=True,
    )
    parts = module.split(".")
    candidates = [tmp.joinpath(*parts).with_suffix(".pyi"), tmp.joinpath(*parts, "__init__.pyi")]
    for path in candidates:
        if path.exists():
            return path.read_text()
    raise FileNotFoundError(f"pybind11-stubgen wrote no stub for {module} under {tmp}")


def _to_facade(text: str, module: str) -> str:
    """Refer to names as the facade module does (``Scheduler``, not ``deepinfer_engine._engine.Scheduler``)
    and drop the native module's docstring: the header is the facade's docstring."""
    text = re.sub(r'\A\s*"""(?:.|\n)*?"""\n', "", text)
    text = re.sub(rf"^import {re.escape(module)}\n", "", text, flags=re.M)
    text = text.replace(f"{module}.", "")
    text = _enum_members_as_values(text)
    text = _unhashable_as_typeshed_writes_it(text)
    # The engine has its own class ``Sequence``; stubgen resolves that name to typing's.
    if module == "deepinfer_engine._engine":
        text = re.sub(r"\btyping\.Sequence\b(?!\[)", "Sequence", text)
    return text


def _unhashable_as_typeshed_writes_it(text: str) -> str:
    """A class compared by value (one ``__eq__`` taking its own type, ``__hash__ = None``) as
    typeshed writes one, so type checkers accept the stub: both lines carry typeshed's ignore.
    Overloaded ``__eq__`` (enums) are left as they are."""
    out, previous = [], ""
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\n")
        if body == "    __hash__: typing.ClassVar[None] = None":
            line = body + "  # type: ignore[assignment]\n"
        elif (re.fullmatch(r"    def __eq__\(self, \w+: (?!object\b|typing\.Any\b)[^)]*\) -> bool:", body)
              and previous.strip() != "@typing.overload"):
            line = body + "  # type: ignore[override]\n"
        out.append(line)
        previous = body
    return "".join(out)


def _enum_members_as_values(text: str) -> str:
    """Members of a native ``enum.Enum`` subclass as ``NAME = ...`` (how the typing spec wants
    enum members in a stub), not stubgen's ``NAME: typing.ClassVar[Cls]`` (which reads as none)."""
    out, enum_class = [], None
    for line in text.splitlines(keepends=True):
        header = re.match(r"class (\w+)\(enum\.\w+\):", line)
        if header or line.startswith("class "):
            enum_class = header.group(1) if header else None
        elif enum_class:
            line = re.sub(rf"^(    \w+): typing\.ClassVar\[{enum_class}\]$", r"\1 = ...", line)
        out.append(line)
    return "".join(out)


def generate() -> dict[Path, str]:
    stubs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for filename, module in _native_modules().items():
            body = _to_facade(_stubgen(module, Path(tmp)), module)
            header = (HEADERS / filename).read_text()
            stubs[OUT / filename] = header.rstrip() + "\n\n" + body.lstrip()
    return stubs


def main() -> int:
    write = "--write" in sys.argv[1:]
    stale = []
    for path, text in generate().items():
        current = path.read_text() if path.exists() else ""
        if current == text:
            continue
        if write:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
        else:
            stale.append(path)
            sys.stdout.writelines(
                difflib.unified_diff(current.splitlines(True), text.splitlines(True),
                                     str(path.relative_to(ROOT)), "regenerated")
            )
    mismatched = check_hand_kept_cuda_utils()
    print("\n".join(mismatched))
    if stale:
        print(f"\n{len(stale)} stub(s) are stale; run `nox -s stubs -- --write` and commit.")
    if stale or mismatched:
        return 1
    print("stubs are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
