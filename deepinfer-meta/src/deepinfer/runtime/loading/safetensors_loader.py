"""Read a Hugging Face model directory: ``config.json`` and ``*.safetensors`` weights."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch

from deepinfer.runtime.models.config import ModelConfig, check_tensor_shapes


def safetensors_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the directory's ``*.safetensors`` files (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        try:
            with safe_open(f, "pt") as st:
                for name in st.keys():
                    shapes[name] = tuple(st.get_slice(name).get_shape())
        except Exception as exc:
            raise ValueError(f"cannot read safetensors file {f!r}: {exc}") from exc
    return shapes


def load_hf_config(model_dir: str) -> ModelConfig:
    """ModelConfig from ``model_dir/config.json``."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model: {model_dir!r} has no config.json (expected a Hugging Face model directory)")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"model: {path!r} is not valid JSON: {exc}") from exc
    try:
        config = ModelConfig.from_hf_dict(cfg)
        shapes = safetensors_shapes(model_dir)
        if shapes:  # a config-only directory (dummy weights) has none to compare with
            check_tensor_shapes(config, shapes)
    except KeyError as exc:
        raise ValueError(f"model: {path!r} lacks the field {exc.args[0]!r}") from exc
    except (ValueError, TypeError) as exc:
        raise ValueError(f"model: {path!r}: {exc}") from None
    return config


def safetensors_files(model_dir: str) -> list[str]:
    """The directory's ``*.safetensors`` files; FileNotFoundError when there are none."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"model: {model_dir!r} has no *.safetensors weight files")
    return files


def check_finite(t: torch.Tensor, where: str) -> None:
    """ValueError naming ``where`` when a floating tensor holds NaN or infinite values."""
    if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
        bad = ~torch.isfinite(t)
        first = [int(i) for i in torch.nonzero(bad)[0]]
        raise ValueError(f"model: {where} holds {int(bad.sum())} non-finite value(s) (NaN or inf; the first at "
                         f"index {first}): the weights are damaged")


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) one at a time, in the file's own dtype, memory-mapped: only the tensor being
    copied into the model is in memory beyond the model itself. Each tensor's values are checked
    finite (a ValueError names the file and the tensor)."""
    from safetensors import safe_open

    for f in safetensors_files(model_dir):
        try:
            st_cm = safe_open(f, framework="pt", device="cpu")
            st = st_cm.__enter__()
            names = list(st.keys())
        except Exception as exc:  # safetensors raises its own SafetensorError, OSError, ...
            raise ValueError(f"model: cannot read safetensors file {f!r}: {exc}") from exc
        try:
            for name in names:
                try:
                    t = st.get_tensor(name)
                except Exception as exc:
                    raise ValueError(f"model: cannot read safetensors file {f!r}: {exc}") from exc
                check_finite(t, f"safetensors file {f!r} tensor {name!r}")
                yield name, t
        finally:
            st_cm.__exit__(None, None, None)


def load_safetensors(model_dir: str) -> dict[str, torch.Tensor]:
    """All tensors of the directory's ``*.safetensors`` files at once, as float32 CPU tensors (for
    tools and tests; the runtime streams them with ``iter_safetensors``)."""
    return {name: t.float() for name, t in iter_safetensors(model_dir)}
