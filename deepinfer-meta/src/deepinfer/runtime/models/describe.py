"""What really runs in a built model: per tensor kind (qkv, o, gate_up, down, lm_head, embedding)
the weight type and the kernel path, and the activation dtype.

Read from the modules themselves: a layer that is not a plain torch one says what it is with two
attributes, ``weight_type`` and ``kernel_path`` (``models/fp8_linear.py``, ``models/quantized.py``,
``models/cpu_linear.py``); a plain ``nn.Linear``/``nn.Embedding`` is its weight's dtype through
torch. ``deepinfer env --model`` and ``deepinfer bench`` print these lines.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn

KINDS = ("qkv", "o", "gate_up", "down", "lm_head", "embedding")
_LAYER_ATTRS = {"qkv": "qkv_proj", "o": "o_proj", "gate_up": "gate_up_proj", "down": "down_proj"}


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def describe_module(module: Any) -> tuple[str, str]:
    """(weight type, kernel path) of one projection or embedding module."""
    weight_type, path = getattr(module, "weight_type", None), getattr(module, "kernel_path", None)
    w = getattr(module, "weight", None)
    if weight_type is None:
        weight_type = _dtype_name(w) if isinstance(w, torch.Tensor) else type(module).__name__
    if path is None:
        if isinstance(module, nn.Embedding):
            path = "row lookup"
        elif isinstance(w, torch.Tensor) and w.device.type == "cuda":
            # models/llama_fused_decode.py: one-row decode steps of the decode graphs
            path = "torch matmul (cuBLAS); one-row decode steps: Triton GEMV (fused)"
        else:
            path = "torch matmul"
    return weight_type, path


def kind_modules(model: nn.Module) -> dict[str, list[Any]]:
    """The modules of each tensor kind (one per layer for the projections)."""
    layers = list(getattr(model, "layers", []) or [])
    head = getattr(model, "quantized_head", None) or getattr(model, "lm_head", None)
    out: dict[str, list[Any]] = {k: [m for m in (getattr(layer, a, None) for layer in layers) if m is not None]
                                 for k, a in _LAYER_ATTRS.items()}
    out["lm_head"] = [head] if head is not None else []
    out["embedding"] = [m for m in (getattr(model, "embed_tokens", None),) if m is not None]
    return out


def describe_model(model: nn.Module) -> dict[str, list[tuple[str, str, int]]]:
    """Per tensor kind, each distinct (weight type, kernel path) with how many modules have it.
    A tied LM head reads the embedding table: it is described as a product with that weight."""
    table: dict[str, list[tuple[str, str, int]]] = {}
    for kind, mods in kind_modules(model).items():
        if kind == "lm_head" and not mods and getattr(model, "embed_tokens", None) is not None:
            wt, _ = describe_module(model.embed_tokens)
            emb = getattr(model.embed_tokens, "weight", None)
            on_gpu = isinstance(emb, torch.Tensor) and emb.device.type == "cuda"
            table[kind] = [(f"{wt} (tied to the embedding)", "torch matmul (cuBLAS)" if on_gpu else "torch matmul",
                            1)]
            continue
        counts = Counter(describe_module(m) for m in mods)
        table[kind] = [(wt, path, n) for (wt, path), n in counts.items()]
    return table


def activation_dtype(model: nn.Module) -> str:
    """The dtype of the hidden states between layers (the final norm's weight dtype)."""
    norm = getattr(model, "norm", None)
    w = getattr(norm, "weight", None)
    return _dtype_name(w) if isinstance(w, torch.Tensor) else "?"


def describe_lines(model: nn.Module) -> list[str]:
    """One line per tensor kind, then the activation dtype."""
    lines = []
    for kind, rows in describe_model(model).items():
        parts = [f"weights {wt}, {path}" + (f" (x{n})" if len(rows) > 1 else "") for wt, path, n in rows]
        lines.append(f"{kind}: " + ("; ".join(parts) or "-"))
    lines.append(f"activations: {activation_dtype(model)}")
    return lines
