"""The decode forward of ``LlamaForCausalLM`` on CUDA with fused Triton kernels (graph-capturable).

Same math as ``LlamaForCausalLM.forward`` for one token per sequence, with the residual add
carried into the next RMSNorm (``add_rmsnorm``), (Qwen3's q/k norm +) rotary + KV-cache store in one kernel, SiLU·mul
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
from torch import nn

from deepinfer.runtime.attention.triton_decode import DecodeWorkspace, decode_attention
from deepinfer.runtime.kernels.fused_ops import add_rmsnorm, rotary_kv_write, silu_mul
from deepinfer.runtime.kernels.gemv import gemv
from deepinfer.runtime.models.llama import LlamaForCausalLM, LlamaLayer

Region = Callable[[str], AbstractContextManager[None]]

# One-row o_proj through the Triton GEMV where it beat cuBLAS on the H200 (bench/gemv_bench.py:
# 4096x4096 bf16 in 11.0 us against 12.8 us + a split-K reduce); smaller matrices stay cuBLAS.
GEMV_MIN_WEIGHT = 1 << 24
O_PROJ_CONFIG = (4, 512, 4, 3)


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
            qk_norm = None if layer.q_norm is None or layer.k_norm is None else (
                layer.q_norm.weight, layer.k_norm.weight, layer.q_norm.eps)
            q = rotary_kv_write(qkv, positions, cos, sin, slot_mapping, cache, layer.num_heads, layer.num_kv_heads,
                                qk_norm)
            o = decode_attention(q, cache, block_tables, seq_lens, layer.scale, num_splits, workspace)
            w_o = layer.o_proj.weight
            # the one-row GEMV reads the whole weight: a row-parallel o_proj (tensor parallelism,
            # a subclass) goes through its own forward, which all-reduces
            if b == 1 and type(layer.o_proj) is nn.Linear and w_o.numel() >= GEMV_MIN_WEIGHT and w_o.stride(1) == 1:
                x = gemv(o.view(1, -1), w_o, config=O_PROJ_CONFIG)
            else:
                x = layer.o_proj.forward(o.view(b, -1))
        with region("mlp"):
            h, residual = add_rmsnorm(x, residual, layer.post_attention_layernorm.weight,
                                      layer.post_attention_layernorm.eps)
            x = layer.down_proj.forward(silu_mul(F.linear(h, layer.gate_up_proj.weight)))
    with region("final_norm"):
        h, _ = add_rmsnorm(x, residual, model.norm.weight, model.norm.eps)
    return h
