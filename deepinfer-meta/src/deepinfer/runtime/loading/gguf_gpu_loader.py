"""Keep a GGUF file's quantized projections quantized on a CUDA device (``models.gguf_linear``).

Each projection (fused qkv, o, fused gate/up, down, and the output head) whose tensors all have a
GPU kernel type (``kernels.gguf_layout.GPU_TYPES``) is read from the memory-mapped file, regrouped
into planes on the CPU (one tensor at a time), uploaded and swapped in for the dense layer. The
others (dense tensors, types without a kernel, widths not a multiple of 64) keep their dense
parameters, loaded afterwards in the model's dtype. The embedding table stays dense.
"""

from __future__ import annotations

from typing import cast

import torch

from deepinfer.runtime.kernels import gguf_blocks
from deepinfer.runtime.kernels.gguf_layout import GPU_TYPES, GGUFPlanes, regroup
from deepinfer.runtime.loading.gguf_loader import GGUFModel
from deepinfer.runtime.models.gguf_linear import GGUFLinearCUDA, chain_model
from deepinfer.runtime.models.llama import LlamaForCausalLM, LlamaLayer


def gguf_planes(gguf_model: GGUFModel, name: str) -> GGUFPlanes | None:
    """Tensor ``name`` as GPU planes in the Hugging Face row order (CPU), or None when it has no GPU kernel."""
    t = gguf_model.tensors[name]
    kind = t.tensor_type.name
    if kind not in GPU_TYPES or len(t.shape) != 2:
        return None
    rows = int(t.shape[1])
    try:
        planes = regroup(gguf_blocks.raw_blocks(t.data, rows), kind)
    except ValueError:
        return None  # a width the layout does not take (not a multiple of 64): stays dense
    except Exception as exc:
        raise gguf_model.load_error(name, exc) from exc
    index = gguf_model.row_index(name, rows)
    return planes if index is None else planes.permute_rows(index)


def keep_gguf_quantization_cuda(model: LlamaForCausalLM, gguf_model: GGUFModel, device: torch.device,
                                dtype: torch.dtype) -> None:
    """Swap the projections (and output head) with GPU kernel types for ``GGUFLinearCUDA`` layers on ``device``."""

    def quantized(names: list[str], bias_names: list[str] | None = None) -> GGUFLinearCUDA | None:
        if any(n not in gguf_model.tensors for n in names):
            return None
        parts = [gguf_planes(gguf_model, n) for n in names]
        if any(p is None for p in parts) or len({p.k for p in parts if p is not None}) != 1:
            return None
        bias = None
        if bias_names and all(n in gguf_model.tensors for n in bias_names):
            bias = torch.cat([gguf_model.dense(n) for n in bias_names]).to(device, dtype)
        return GGUFLinearCUDA([p.map(lambda t: t.to(device)) for p in parts if p is not None], bias)

    for i, module in enumerate(model.layers):
        layer = cast(LlamaLayer, module)
        p = f"model.layers.{i}."
        attn = [p + f"self_attn.{n}_proj." for n in "qkv"]
        qkv = quantized([a + "weight" for a in attn],
                        [a + "bias" for a in attn] if layer.qkv_proj.bias is not None else None)
        if qkv is not None:
            layer.qkv_proj = qkv  # type: ignore[assignment]  # same forward(x) interface
        for attr, names in (("o_proj", [p + "self_attn.o_proj.weight"]),
                            ("gate_up_proj", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                            ("down_proj", [p + "mlp.down_proj.weight"])):
            q = quantized(names)
            if q is not None:
                setattr(layer, attr, q)
    head = "model.embed_tokens.weight" if model.lm_head is None else "lm_head.weight"
    model.quantized_head = quantized([head])
    if model.quantized_head is not None:
        model.lm_head = None
    chain_model(model)  # DEEPINFER_GGUF_DENSE_ROWS: each weight decoded while the one before multiplies
