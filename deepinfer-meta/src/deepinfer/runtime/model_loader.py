"""Build the runtime's model from a path (HF directory or GGUF file) or random "dummy" weights."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.runtime.model_config import ModelConfig
from deepinfer.runtime.models.llama import LlamaForCausalLM
from deepinfer.runtime.models.rotary import RotaryEmbedding


@dataclass
class LoadedModel:
    """A model ready to run, with its configuration and where it came from."""

    model: LlamaForCausalLM
    config: ModelConfig
    path: str


def resolve_model_path(model: str | os.PathLike[str] | None) -> str:
    """The model path to load: the embedded default when ``model`` is None."""
    if model is None:
        from deepinfer.runtime.default_model import default_model_path

        return default_model_path()
    path = os.fspath(model)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"model={path!r}: no such file or directory (expected a GGUF file or a Hugging Face "
            f"model directory; nothing is downloaded)")
    if os.path.isfile(path) and not path.lower().endswith(".gguf"):
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError(f"model={path!r}: a file that is not GGUF (no GGUF magic)")
    return path


def read_config(path: str) -> ModelConfig:
    """Only the architecture of the model at ``path`` (cheap: no weights are dequantized)."""
    if os.path.isdir(path):
        from deepinfer.runtime.safetensors_loader import load_hf_config

        return load_hf_config(path)
    from deepinfer.runtime.gguf_loader import gguf_config, open_gguf

    return gguf_config(open_gguf(path), path)


def load_model(path: str, *, device: torch.device, dtype: torch.dtype, dummy_weights: bool = False,
               max_positions: int | None = None, seed: int = 0) -> LoadedModel:
    """Load weights from ``path`` (or random ones of its shape) into a LlamaForCausalLM on ``device``."""
    weights: dict[str, Any] | None = None
    if os.path.isdir(path):
        from deepinfer.runtime.safetensors_loader import load_hf_config, load_safetensors

        config = load_hf_config(path)
        if not dummy_weights:
            weights = load_safetensors(path)
    elif dummy_weights:
        config = read_config(path)
    else:
        from deepinfer.runtime.gguf_loader import load_gguf

        config, weights = load_gguf(path)
    freq_factors = None
    if weights is not None and "rope_freq_factors" in weights:
        w = weights["rope_freq_factors"]
        freq_factors = w if isinstance(w, torch.Tensor) else torch.from_numpy(w)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config, max_positions=max_positions, rope_freq_factors=freq_factors)
    if weights is None:
        model.init_dummy_weights(seed)
    else:
        model.load_hf_weights(weights)
    del weights
    model = model.to(device=device, dtype=dtype).eval()
    if device.type == "cpu":  # faster few-row matmuls on CPU (see the method)
        model.store_wide_projections_input_major()
    # cos/sin tables are rebuilt on the device in float32: .to(dtype) would round them
    model.rotary = RotaryEmbedding(config.head_dim, max_positions or config.max_position_embeddings,
                                   config.rope_theta, config.rope_scaling, freq_factors).to(device)
    return LoadedModel(model=model, config=config, path=path)
