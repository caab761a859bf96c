"""Sphinx configuration: Markdown pages through MyST; the runtime API read from its docstrings.

autodoc imports ``deepinfer`` from this source tree and ``deepinfer._C.engine`` from the
installed ``deepinfer-engine`` wheel (``nox -s docs`` installs it); torch and the model
libraries are mocked, so building the docs never needs them.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "deepinfer-meta", "src"))

project = "DeepInfer"
author = "DeepInfer developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_title = "DeepInfer"
suppress_warnings = ["myst.xref_missing"]

autodoc_mock_imports = ["torch", "transformers", "tokenizers", "gguf", "safetensors", "triton"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False


def _keep_engine_property_docs(app, what, name, obj, options, lines):
    """napoleon reads a property docstring's first line as ``type: description``; the engine's
    property docstrings are plain sentences that may contain a colon, so keep them as written."""
    if what == "property" and name.startswith("deepinfer._C.") and getattr(obj, "__doc__", None):
        lines[:] = obj.__doc__.strip().splitlines()


def _check_engine_args_tables(app):
    """The engine options tables (docs/guide/09-command-line.md, docs/api/runtime.md) must be
    what ``EngineArgs`` generates: a stale one is a warning, an error under ``-W``."""
    from sphinx.util import logging

    scripts = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts")
    sys.path.insert(0, scripts)
    try:
        import gen_engine_args_docs
    finally:
        sys.path.remove(scripts)
    for page in gen_engine_args_docs.stale_pages():
        logging.getLogger(__name__).warning(
            "%s: the engine options table differs from EngineArgs; run python scripts/gen_engine_args_docs.py", page)


def setup(app):
    app.connect("autodoc-process-docstring", _keep_engine_property_docs, priority=900)
    app.connect("builder-inited", _check_engine_args_tables)
