"""The Python examples a user copies run and print sensible answers on the default model.

Every ```python block of the README, the quickstart and the user guide runs, page by page in
one namespace (later blocks use the ``llm`` of earlier ones), and so do the scripts of
examples/. ``LLM(...)`` is memoised by its bound arguments so the model loads once for all of
them (each example still builds and uses a real LLM).
"""

from __future__ import annotations

import dataclasses
import re
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The serving page's examples talk to a running `deepinfer serve`: tests/serve runs them, and
# the blocks of other pages that open an OpenAI client on the server's address.
SERVER_PAGES = {"10-serving.md"}
SERVER_BLOCK = 'OpenAI(base_url="http://127.0.0.1:8000'

PAGES = [ROOT / "README.md", ROOT / "docs" / "quickstart.md",
         *sorted(p for p in (ROOT / "docs" / "guide").glob("*.md") if p.name not in SERVER_PAGES)]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def python_blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


@pytest.fixture(scope="module")
def shared_llm():
    """A memoising stand-in for the LLM class: one real LLM per distinct set of arguments."""
    pytest.importorskip("deepinfer_engine", reason="the C++ engine (deepinfer-engine) is not built/installed")
    import torch
    from deepinfer.runtime import llm as llm_module
    from deepinfer.runtime.engine_args import EngineArgs

    real = llm_module.LLM
    built: dict[str, object] = {}

    def make(model=None, **kwargs):
        args = EngineArgs.from_kwargs(model, kwargs)  # every option, defaults filled
        if args.device is None and not torch.cuda.is_available():
            args = dataclasses.replace(args, device="cpu")
        key = repr(args)
        if key not in built:
            built[key] = real(**args.to_kwargs())
        return built[key]

    return make


@pytest.fixture
def memoised_llm(shared_llm, monkeypatch, default_gguf):
    from deepinfer.runtime import llm as llm_module

    monkeypatch.setattr(llm_module, "LLM", shared_llm)
    return shared_llm


def test_the_pages_have_python_examples():
    counts = {page.name: len(python_blocks(page)) for page in PAGES}
    assert counts["README.md"] >= 1 and counts["quickstart.md"] >= 1, counts


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.name)
def test_python_blocks_of_the_page_run(page, memoised_llm, capsys):
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for i, block in enumerate(python_blocks(page)):
        if SERVER_BLOCK in block:  # run against a live server by tests/serve/test_docs_example.py
            continue
        exec(compile(block, f"{page.name}[python block {i}]", "exec"), namespace)
        printed = capsys.readouterr().out
        assert printed.strip(), f"{page.name} block {i} printed nothing"
        if "# The capital of France is Paris." in block:  # the answer the page promises
            assert "Paris" in printed, printed


@pytest.mark.parametrize("script, argv, expected", [
    ("offline_inference.py", ["--max-tokens", "12"], "Paris"),
    ("benchmark.py", ["--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--quiet"],
     "2 requests in"),
])
def test_examples_run(script, argv, expected, memoised_llm, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [script, *argv])
    try:
        runpy.run_path(str(ROOT / "examples" / script), run_name="__main__")
    except SystemExit as exc:
        assert exc.code in (0, None), exc.code
    out = capsys.readouterr().out
    assert expected in out, out
