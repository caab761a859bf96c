"""Load a model's tokenizer offline: from a HF directory, or converted from a GGUF file.

Converting a GGUF vocabulary takes seconds, so the converted tokenizer is saved once under
``$DEEPINFER_CACHE`` (default ``~/.cache/deepinfer``) keyed by the file's path, size and mtime.

``load_tokenizer`` gives the transformers tokenizer (``LLM.tokenizer``); ``load_text_tokenizer``
the runtime's ``TextTokenizer``, a snapshot of it kept under ``$DEEPINFER_CACHE/text-tokenizers``
that loads without importing transformers (see ``text_tokenizer``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from deepinfer.runtime import switches

# files of a model directory that are not the tokenizer's (their changes need no new snapshot)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt")


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def cache_dir() -> str:
    """Folder where converted GGUF tokenizers are kept."""
    return switches.raw("DEEPINFER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "deepinfer")


# a writer's temporary folder older than this is left over from a killed process
_STALE_TMP_SECONDS = 600.0


def _sweep_stale_tmp(parent: str, now: float) -> None:
    """Remove ``<key>.tmp*`` folders under ``parent`` left by processes killed while writing."""
    try:
        with os.scandir(parent) as entries:
            for e in entries:
                if ".tmp" in e.name and e.is_dir(follow_symlinks=False):
                    try:
                        if now - e.stat(follow_symlinks=False).st_mtime > _STALE_TMP_SECONDS:
                            shutil.rmtree(e.path, ignore_errors=True)
                    except OSError:
                        pass
    except OSError:
        pass


def publish_cache_dir(final: str, write: Callable[[str], object], *, replace_existing: bool = False) -> bool:
    """Write a cache entry into a fresh temporary folder beside ``final`` (``write(tmp)``) and
    rename it to ``final``; True when ``final`` is this call's. The temporary folder is removed on
    every path: a failed write, a read-only cache, any exception, and the loser of a race between
    processes (or threads) writing the same entry (``final`` then holds the winner's copy, which is
    kept unless ``replace_existing``: a damaged entry the caller wants replaced)."""
    parent = os.path.dirname(final)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=os.path.basename(final) + ".tmp", dir=parent)
    except OSError:  # read-only cache
        return False
    try:
        write(tmp)
        if replace_existing:
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.replace(tmp, final)  # atomic; fails when another writer's non-empty final is there
        except OSError:
            return False
        return True
    except OSError:
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op once renamed
        _sweep_stale_tmp(parent, time.time())


# files beside a GGUF file that can make AutoTokenizer pick another tokenizer class
_CLASS_HINTS = ("tokenizer_config.json", "config.json", "tokenizer.json")


def gguf_tokenizer_class(model_path: str) -> Any:
    """The class ``AutoTokenizer.from_pretrained(gguf_file=)`` picks for this GGUF file, where it can be
    named without AutoTokenizer's own config read (transformers' legacy GGUF reader: ~4 s of the
    default model's first load, building a numpy object per vocabulary entry); else None.

    Named only in the plain case: a ``llama`` file (the default model's architecture) with no
    tokenizer class registered for ``llama`` in this transformers (AutoTokenizer then falls back
    to its generic ``TokenizersBackend``) and nothing beside the file that names a class. Any
    other file keeps AutoTokenizer; the test suite checks that both give the same files."""
    if any(os.path.exists(os.path.join(os.path.dirname(os.path.abspath(model_path)), f)) for f in _CLASS_HINTS):
        return None
    from deepinfer.runtime.loading.gguf_file import GGUFFile

    try:
        arch = GGUFFile(model_path).fields.get("general.architecture")
    except (OSError, ValueError):
        return None  # AutoTokenizer says what is wrong with the file
    if arch != "llama":
        return None
    import transformers

    try:  # (a transformers that moved these: AutoTokenizer decides)
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES
    except ImportError:
        return None
    if TOKENIZER_MAPPING_NAMES.get("llama") is not None:
        return None
    return getattr(transformers, "TokenizersBackend", None)


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
    folder, name = os.path.dirname(os.path.abspath(model_path)), os.path.basename(model_path)
    direct = gguf_tokenizer_class(model_path)
    tok = (direct or AutoTokenizer).from_pretrained(folder, gguf_file=name, local_files_only=True)
    # a damaged entry (no tokenizer.json) is replaced; a read-only home runs without the cache
    publish_cache_dir(cached, tok.save_pretrained,
                      replace_existing=os.path.isdir(cached)
                      and not os.path.isfile(os.path.join(cached, "tokenizer.json")))
    return tok


def _transformers_identity() -> str:
    # the installed transformers (path, size and mtime of its __init__.py, found without importing
    # it): a snapshot taken with another version is retaken
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.origin:
        return "no transformers"
    st = os.stat(spec.origin)
    return f"{spec.origin}|{st.st_size}|{st.st_mtime_ns}"


def _source_stats(model_path: str) -> list[str]:
    """Name, size and mtime of what the tokenizer is built from: the GGUF file, or a model
    directory's files (weights aside) and its additional chat templates."""
    if not os.path.isdir(model_path):
        st = os.stat(model_path)
        return [f"{st.st_size}|{st.st_mtime_ns}"]
    out = []
    for sub in ("", "additional_chat_templates"):
        folder = os.path.join(model_path, sub)
        if not os.path.isdir(folder):
            continue
        with os.scandir(folder) as entries:
            for e in entries:
                if e.is_file() and not e.name.endswith(_WEIGHT_SUFFIXES):
                    st = e.stat()
                    out.append(f"{sub}/{e.name}|{st.st_size}|{st.st_mtime_ns}")
    return sorted(out)


def text_tokenizer_dir(model_path: str) -> str:
    """Where the ``TextTokenizer`` snapshot of ``model_path``'s tokenizer is kept."""
    import tokenizers

    parts = [os.path.abspath(model_path), _transformers_identity(), f"tokenizers {tokenizers.__version__}",
             *_source_stats(model_path)]
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]
    return os.path.join(cache_dir(), "text-tokenizers", key)


def load_text_tokenizer(model_path: str) -> Any:
    """The runtime's tokenizer of a model directory or GGUF file: a ``TextTokenizer`` equal to the
    transformers tokenizer ``load_tokenizer`` gives, from its cached snapshot (no transformers
    import). Without a snapshot (first use, damaged or unreadable files) the transformers
    tokenizer is loaded and the snapshot written; a model-specific transformers tokenizer that a
    snapshot cannot reproduce is returned as it is."""
    from deepinfer.runtime.loading.text_tokenizer import TextTokenizer

    folder = text_tokenizer_dir(model_path)
    try:
        return TextTokenizer.load(folder)
    except (OSError, ValueError):  # none yet, or damaged: take it again below
        pass
    tok = load_tokenizer(model_path)
    if not TextTokenizer.mirrors(tok):
        return tok
    text = TextTokenizer.from_transformers(tok)
    # A damaged snapshot is replaced, unless another process wrote a good one meanwhile (the race's
    # loser keeps its copy in memory); a read-only cache: this process keeps its snapshot in memory.
    damaged = os.path.exists(folder)
    if damaged:
        try:
            TextTokenizer.load(folder)
            damaged = False
        except (OSError, ValueError):
            pass
    publish_cache_dir(folder, text.save, replace_existing=damaged)
    return text
