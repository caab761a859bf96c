"""Generate the committed ``.pyi`` stubs of ``deepinfer._C`` with pybind11-stubgen.

    python scripts/gen_stubs.py           check: exit 1 when a committed stub is stale
    python scripts/gen_stubs.py --write   rewrite the committed stubs

Sources: ``deepinfer_engine._engine`` for ``engine.pyi``; the CUDA backend's native
``cuda_utils`` / ``graph_timer`` for the other two (every backend has the same signatures,
checked by tests/conformance). Each stub starts with its header from scripts/stub_headers/
(for engine.pyi: the rules shared by many names). Names are rewritten from the native module
paths to the facade's, since users import them from ``deepinfer._C``.
"""

from __future__ import annotations

import difflib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "deepinfer-meta" / "src" / "deepinfer" / "_C"
HEADERS = ROOT / "scripts" / "stub_headers"


def _native_modules() -> dict[str, str]:
    """facade stub file -> native module that stubgen reads."""
    targets = {"engine.pyi": "deepinfer_engine._engine"}
    from deepinfer_cuda import plugin  # the reference backend for the shared signatures

    native = plugin.deepinfer_backend()["load"]()
    targets["cuda_utils.pyi"] = native.cuda_utils.__name__
    targets["graph_timer.pyi"] = native.graph_timer.__name__
    return targets


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
    """Refer to names as the facade module does (``Scheduler``, not ``deepinfer_engine._engine.Scheduler``)."""
    text = re.sub(rf"^import {re.escape(module)}\n", "", text, flags=re.M)
    return text.replace(f"{module}.", "")


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
    if stale:
        print(f"\n{len(stale)} stub(s) are stale; run `nox -s stubs -- --write` and commit.")
        return 1
    print("stubs are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
