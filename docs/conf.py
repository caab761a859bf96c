"""Sphinx configuration: Markdown pages through MyST."""

project = "DeepInfer"
author = "DeepInfer developers"
extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_title = "DeepInfer"
suppress_warnings = ["myst.xref_missing"]
