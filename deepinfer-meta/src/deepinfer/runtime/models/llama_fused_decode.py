"""The decode forward of ``LlamaForCausalLM`` on CUDA with fused Triton kernels (graph-capturable).

Same math as ``LlamaForCausalLM.forward`` for one token per sequence, with the residual add
carried into the next RMSNorm (``add_rmsnorm``), rotary + KV-cache store in one kernel, SiLU·mul
in one kernel and the split-K decode attention. Every input is a device tensor, so the whole
forward can be captured once per batch size and replayed. ``region(name)`` brackets the
attention and MLP blocks (a GraphTimer's ``region`` during capture, or a no-op).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import cast

import torch
import torch.nn.functional as F

from deepinfer.runtime.attention.triton_decode import DecodeWorkspace, decode_attention
from deepinfer.runtime.kernels.fused_ops import add_rmsnorm, rotary_kv_write, silu_mul
from deepinfer.runtime.models.llama import LlamaForCausalLM, LlamaLayer

Region = Callable[[str], AbstractContextManager[None]]


def no_region(name: str) -> AbstractContextManager[None]:
    return contextlib.nullcontext()


def fused_decode_forward(model: LlamaForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                         kv_caches: list[torch.Tensor], slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, workspace: DecodeWorkspace, num_splits: int,
                         region: Region = no_region) -> torch.Tensor:
    """Final hidden states [B, hidden] of one decode token per sequence (rows with slot -1 are
    padding: they write no KV)."""
    b = input_ids.shape[0]
    with region("embed"):
        x = model.embed_tokens.forward(input_ids)  # a module call: the vocabulary-parallel one all-reduces
    cos, sin = model.rotary.cos, model.rotary.sin
    residual: torch.Tensor | None = None
    for module, cache in zip(model.layers, kv_caches, strict=True):
        layer = cast(LlamaLayer, module)
        with region("attention"):
            h, residual = add_rmsnorm(x, residual, layer.input_layernorm.weight, layer.input_layernorm.eps)
            qkv = F.linear(h, layer.qkv_proj.weight, layer.qkv_proj.bias)
            q = rotary_kv_write(qkv, positions, cos, sin, slot_mapping, cache, layer.num_heads, layer.num_kv_heads)
            o = decode_attention(q, cache, block_tables, seq_lens, layer.scale, num_splits, workspace)
            x = layer.o_proj.forward(o.view(b, -1))  # row-parallel under TP: all-reduces
        with region("mlp"):
            h, residual = add_rmsnorm(x, residual, layer.post_attention_layernorm.weight,
                                      layer.post_attention_layernorm.eps)
            x = layer.down_proj.forward(silu_mul(F.linear(h, layer.gate_up_proj.weight)))
    with region("final_norm"):
        h, _ = add_rmsnorm(x, residual, model.norm.weight, model.norm.eps)
    return h
