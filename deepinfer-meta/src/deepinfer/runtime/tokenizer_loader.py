"""Load a model's tokenizer offline: from a HF directory, or converted from a GGUF file.

Converting a GGUF vocabulary takes seconds, so the converted tokenizer is saved once under
``$DEEPINFER_CACHE`` (default ``~/.cache/deepinfer``) keyed by the file's path, size and mtime.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def cache_dir() -> str:
    """Folder where converted GGUF tokenizers are kept."""
    return os.environ.get("DEEPINFER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "deepinfer")


def load_tokenizer(model_path: str) -> Any:
    """A transformers tokenizer for a model directory or a GGUF file, without network access."""
    _offline()
    from transformers import AutoTokenizer

    if os.path.isdir(model_path):
        return AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    st = os.stat(model_path)
    key = hashlib.sha256(f"{os.path.abspath(model_path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
    cached = os.path.join(cache_dir(), "tokenizers", key)
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(cached, local_files_only=True)
        except (OSError, ValueError):  # a damaged cache entry: rebuild it below
            pass
    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(model_path)),
                                        gguf_file=os.path.basename(model_path), local_files_only=True)
    try:
        tmp = f"{cached}.tmp{os.getpid()}"
        tok.save_pretrained(tmp)
        os.replace(tmp, cached)
    except OSError:  # read-only home: run without the cache
        pass
    return tok
