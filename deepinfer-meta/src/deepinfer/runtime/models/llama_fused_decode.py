"""The decode forward of ``LlamaForCausalLM`` on CUDA with fused Triton kernels (graph-capturable),
and the eager forward of steps of any shape through the same kernels (``fused_step_forward``).

Same math as ``LlamaForCausalLM.forward`` for one token per sequence, with the residual add
carried into the next RMSNorm (``add_rmsnorm``), (Qwen3's q/k norm +) rotary + KV-cache store in
one kernel, SiLU·mul in one kernel and the split-K decode attention (its merge folded into the
last split program). Every input is a device tensor, so the whole forward can be captured once
per batch size and replayed. ``region(name)`` brackets the attention and MLP blocks (a
GraphTimer's ``region`` during capture, or a no-op).

A step of one sequence (batch 1) runs each projection as the Triton GEMV with its neighbours
fused in, 6 kernels per layer instead of 11: qkv and gate_up compute the RMSNorm of the residual
stream in their prologue, o and down add their output to the stream in their epilogue, down
takes SiLU·mul of gate/up as its input. Larger batches keep cuBLAS and the separate kernels.
A mixture-of-experts layer (``models.moe``) runs its own MLP: the Triton routing, sort by expert
and grouped GEMMs, all with shapes fixed by the batch size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import cast

import torch
from torch import nn

from deepinfer.runtime import switches
from deepinfer.runtime.attention.metadata import AttentionMetadata
from deepinfer.runtime.attention.triton_decode import DecodeWorkspace, Quantized, decode_attention
from deepinfer.runtime.kernels.fused_ops import add_rmsnorm, rotary_kv_write, silu_mul
from deepinfer.runtime.kernels.gemv import gemv
from deepinfer.runtime.models.gguf_linear import GGUFLinearCUDA
from deepinfer.runtime.models.llama import LlamaForCausalLM, LlamaLayer, RMSNorm

Region = Callable[[str], AbstractContextManager[None]]

# Tiles (BLOCK_N, BLOCK_K, num_warps, num_stages[, split_k]) of the one-row projections through the
# Triton GEMV, picked on the H200 (bench/gemv_bench.py --configs sweep): for the Llama-3-8B shapes
# (K >= 2048) and the SmolLM2-135M ones (smaller K).
ONE_ROW_CONFIGS = {"qkv": (2, 1024, 4, 3), "o": (2, 1024, 4, 3), "gate_up": (2, 1024, 4, 3), "down": (4, 2048, 8, 1)}
SMALL_K_CONFIGS = {"qkv": (4, 1024, 4, 2), "o": (2, 1024, 4, 3), "gate_up": (8, 1024, 8, 2), "down": (4, 2048, 8, 1)}
# An o projection that narrows (attention width K above hidden N: Qwen3-30B-A3B's 4096 -> 2048)
# takes the down tile: gemv_bench 5.80 against 6.14 us, batch 1 366 -> 370-371 tok/s (H200,
# 2026-12-05). Llama-3-8B's square o measured the same either way (4,263 against 4,252 us a step);
# other narrowing o projections (Qwen3-0.6B's 2048 -> 1024) take it unmeasured.
NARROWING_O_CONFIG = (4, 2048, 8, 1)


def _tile(name: str, weight: torch.Tensor) -> tuple[int, ...]:
    # DEEPINFER_ONE_ROW_TILES="down=4,2048,8,1,2;o=..." overrides tiles (benchmarks)
    given = switches.tiles("DEEPINFER_ONE_ROW_TILES", tuple(ONE_ROW_CONFIGS), (4, 5)).get(name)
    if given:
        return given
    n, k = weight.shape
    if name == "o" and k >= 2048 and k > n:
        return NARROWING_O_CONFIG
    return (ONE_ROW_CONFIGS if k >= 2048 else SMALL_K_CONFIGS)[name]


def one_row_gemv_projections() -> frozenset[str]:
    """Projections of a one-row step that run through the GEMV with their neighbours fused in
    (qkv and gate_up: the RMSNorm; o and down: the residual add; down: SiLU·mul); the others run
    cuBLAS with the separate kernels. All four by default (on the H200 each fused GEMV beat cuBLAS
    with its separate kernels); ``DEEPINFER_ONE_ROW_GEMV`` ("qkv,o", "none") picks fewer (benchmarks)."""
    names = switches.value("DEEPINFER_ONE_ROW_GEMV")
    return frozenset() if names == "none" else frozenset(names.split(","))


def no_region(name: str) -> AbstractContextManager[None]:
    return contextlib.nullcontext()


class _Stream:
    """The residual stream of a decode step: ``stream`` (the sum so far) and ``pending`` (a block's
    output not yet added to it). A GEMV adds its output in its epilogue (nothing pending); a
    cuBLAS projection leaves it pending for the next ``add_rmsnorm``, which adds and normalises.
    The GEMV's norm prologue reads a finished sum, so it runs only when nothing is pending."""

    def __init__(self, x: torch.Tensor) -> None:
        self.stream: torch.Tensor = x
        self.pending: torch.Tensor | None = None

    def normed(self, norm: RMSNorm) -> torch.Tensor:
        """RMSNorm(stream + pending) * weight, with the add carried into the stream."""
        if self.pending is None:
            h, _ = add_rmsnorm(self.stream, None, norm.weight, norm.eps)
        else:
            h, self.stream = add_rmsnorm(self.pending, self.stream, norm.weight, norm.eps)
            self.pending = None
        return h


def _gemv_ok(b: int, proj: nn.Module, enabled: bool) -> bool:
    # the one-row GEMV reads the whole weight: a tensor-parallel projection (a subclass) goes
    # through its own forward, which gathers or all-reduces. Quantized layers (models/fp8_linear.py)
    # bring their own fused GEMV.
    if hasattr(proj, "fused_gemv"):
        return enabled and b == 1
    w = cast(torch.Tensor, getattr(proj, "weight", None))
    return enabled and b == 1 and type(proj) is nn.Linear and w.stride(1) == 1


def _one_row(proj: nn.Module, x: torch.Tensor, name: str, **fusions: object) -> torch.Tensor:
    fused = getattr(proj, "fused_gemv", None)
    if fused is not None:
        return cast(torch.Tensor, fused(x, **fusions))
    lin = cast(nn.Linear, proj)
    return gemv(x, lin.weight, lin.bias, config=_tile(name, lin.weight), **fusions)  # type: ignore[arg-type]


def _norm_linear(st: _Stream, norm: RMSNorm, proj: nn.Module, name: str, gemv_names: frozenset[str],
                 b: int) -> torch.Tensor:
    """proj(RMSNorm(residual stream)): the norm inside the GEMV where it runs, else add_rmsnorm + cuBLAS."""
    if st.pending is None and _gemv_ok(b, proj, name in gemv_names):
        return _one_row(proj, st.stream, name, norm=(norm.weight, norm.eps))
    if st.pending is None and b == 1 and isinstance(proj, GGUFLinearCUDA):
        # GGUF weights: their GEMV fuses the same norm
        return proj.gemv(st.stream, norm=(norm.weight, norm.eps))
    return proj.forward(st.normed(norm))


def _residual_linear(st: _Stream, a: torch.Tensor, proj: nn.Module, name: str, gemv_names: frozenset[str], b: int,
                     silu: bool = False, quantized: Quantized | None = None) -> None:
    """stream += proj(a) (SiLU·mul of a first with ``silu``): in the GEMV's epilogue where it runs,
    else left pending for the next add_rmsnorm. ``quantized``: ``a`` as 8-bit activations too (a
    GGUF GEMV then launches no quantization)."""
    if _gemv_ok(b, proj, name in gemv_names):
        assert st.pending is None
        st.stream = _one_row(proj, a, name, silu_mul=silu, residual=st.stream)
        return
    if b == 1 and isinstance(proj, GGUFLinearCUDA):
        assert st.pending is None
        st.stream = proj.gemv(a, silu_mul=silu, residual=st.stream, quantized=quantized)
        return
    assert st.pending is None
    st.pending = proj.forward(silu_mul(a) if silu else a)


def _silu_in_gate_up(gate_up: nn.Module) -> bool:
    """Whether ``DEEPINFER_SILU_IN_GATE_UP`` ("fp8" by default: the fp8 GEMV, where it measured
    faster; "1": the bf16/fp16 GEMV too, where it measured the same; "0") pairs this projection."""
    mode = switches.choice("DEEPINFER_SILU_IN_GATE_UP", ("0", "1", "fp8"))
    fp8 = bool(getattr(gate_up, "fused_silu_out", False))
    return (mode == "1" and (fp8 or type(gate_up) is nn.Linear)) or (mode == "fp8" and fp8)


def _dense_mlp(st: _Stream, layer: LlamaLayer, gemv_names: frozenset[str], b: int) -> None:
    """stream += down(SiLU·mul(gate_up(RMSNorm(stream)))). Where both run as one-row GEMVs and
    ``_silu_in_gate_up`` says so, gate/up's epilogue stores SiLU(gate)·up (each
    program pairs matching gate and up rows) and down reads it ready: otherwise each of down's
    programs computes the SiLU of the whole row again (same bits either way)."""
    gate_up, down, norm = layer.gate_up_proj, layer.down_proj, layer.post_attention_layernorm
    if (st.pending is None and _gemv_ok(b, gate_up, "gate_up" in gemv_names)
            and _gemv_ok(b, down, "down" in gemv_names) and _silu_in_gate_up(gate_up)):
        act = _one_row(gate_up, st.stream, "gate_up", norm=(norm.weight, norm.eps), silu_out=True)
        st.stream = _one_row(down, act, "down", residual=st.stream)
        return
    h = _norm_linear(st, norm, gate_up, "gate_up", gemv_names, b)
    _residual_linear(st, h, down, "down", gemv_names, b, silu=True)


# (layer, the step's qkv rows, the layer's KV cache, where to store the output as 8-bit activations
# too or None) -> attention output [B, H, D]: rotates q and k and stores the step's k and v, then attends
Attend = Callable[[LlamaLayer, torch.Tensor, torch.Tensor, "Quantized | None"], torch.Tensor]


def _o_activations(layer: LlamaLayer, b: int) -> Quantized | None:
    """Buffers for the attention output as the o projection's 8-bit activations, where the decode
    attention writes them (``DEEPINFER_GGUF_O_QUANT_IN_ATTENTION=1``): one row, a GGUF o
    projection multiplying with dp4a, heads of whole 16-column groups. Else None."""
    if not (layer.head_dim % 16 == 0 and switches.enabled("DEEPINFER_GGUF_O_QUANT_IN_ATTENTION")):
        return None
    return _dp4a_activations(layer.o_proj, b)


def _dp4a_activations(proj: nn.Module, b: int) -> Quantized | None:
    """(codes, stats) buffers for ``proj``'s input as the dp4a GEMV's 8-bit activations, where it
    runs one row through it; else None."""
    from deepinfer.runtime.kernels.gguf_gemv import dp4a_gemv, word_codes

    if not (b == 1 and isinstance(proj, GGUFLinearCUDA) and word_codes() and dp4a_gemv()):
        return None
    k = proj.in_features
    dev = proj.parts[0].codes.device
    return (torch.empty(k, dtype=torch.int8, device=dev), torch.empty(3 * (k // 16), dtype=torch.float32, device=dev))


def _qk_norm(layer: LlamaLayer) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """Qwen3's per-head q/k RMSNorm (weights, eps) for the rotary kernels, None without one."""
    if layer.q_norm is None or layer.k_norm is None:
        return None
    return layer.q_norm.weight, layer.k_norm.weight, layer.q_norm.eps


def fused_decode_forward(model: LlamaForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                         kv_caches: list[torch.Tensor], slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, workspace: DecodeWorkspace, num_splits: int,
                         region: Region = no_region, new_rows: int = 1) -> torch.Tensor:
    """Final hidden states [B, hidden] of one decode token per sequence (rows with slot -1 are
    padding: they write no KV). ``new_rows``: the most positions at the end of a row's context
    that this step stores (1; k + 1 for verify rows), see ``decode_attention``."""
    fold_merge = switches.enabled("DEEPINFER_FOLD_MERGE")
    cos, sin = model.rotary.cos, model.rotary.sin

    def attend(layer: LlamaLayer, qkv: torch.Tensor, cache: torch.Tensor, quantized: Quantized | None) -> torch.Tensor:
        q = rotary_kv_write(qkv, positions, cos, sin, slot_mapping, cache, layer.num_heads, layer.num_kv_heads,
                            _qk_norm(layer))
        return decode_attention(q, cache, block_tables, seq_lens, layer.scale, num_splits, workspace,
                                fold_merge=fold_merge, new_rows=new_rows, quantized=quantized)

    with region("embed"):
        st = _Stream(model.embed_tokens.forward(input_ids))  # a module call: the vocabulary-parallel one all-reduces
    return _fused_layers(model, st, kv_caches, attend, region, quantize_inputs=True)


def fused_step_forward(model: LlamaForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                       kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                       inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
    """``model.forward`` of an eager step of any shape (prompt chunks, decodes, both) on CUDA
    through the same fused kernels: about 10 launches a layer instead of ~30 (RMSNorm is 7 torch
    ops, the rotary 10), which is most of the CPU time of a mixed step of a small model. The keys
    and values are stored by the rotary kernel; the var-len Triton attention reads them there."""
    from deepinfer.runtime.attention.triton_paged import attend_cached

    def attend(layer: LlamaLayer, qkv: torch.Tensor, cache: torch.Tensor, quantized: Quantized | None) -> torch.Tensor:
        q = rotary_kv_write(qkv, positions, model.rotary.cos, model.rotary.sin, meta.slot_mapping, cache,
                            layer.num_heads, layer.num_kv_heads, _qk_norm(layer))
        return attend_cached(q, cache, meta, layer.scale)

    st = _Stream(model.embed_tokens.forward(input_ids) if inputs_embeds is None else inputs_embeds)
    return _fused_layers(model, st, kv_caches, attend, no_region)


def fused_step_supported(model: nn.Module, attention: object) -> bool:
    """Whether ``fused_step_forward`` computes this model's eager steps: a Llama-family model
    whose layers are plain ``LlamaLayer``s or mixture-of-experts ``MoeLayer``s (the base class's
    forward; not DeepSeek's MLA layers) with the var-len Triton attention (not the batch-invariant
    one), unless ``DEEPINFER_FUSED_EAGER=0``. For a mixture of experts this matters most: its torch
    forward launched about 54 kernels a layer, and a 128-token prompt step of the Qwen3-30B-A3B
    shape left the H200 85 % idle under the profiler (``bench/decode_profile.py --prompt``). In
    bf16 the fused step rounds differently from the torch one, and a routing near-tie can then
    pick another expert for a token (``fused_step_check.py`` bounds the median error there and
    prints the tail)."""
    from deepinfer.runtime.attention.triton_paged import paged_attention
    from deepinfer.runtime.models.moe import MoeLayer

    return (switches.enabled("DEEPINFER_FUSED_EAGER") and attention is paged_attention
            and isinstance(model, LlamaForCausalLM) and type(model).forward is LlamaForCausalLM.forward
            and all(type(layer) in (LlamaLayer, MoeLayer) and not cast(LlamaLayer, layer).input_layernorm.batch_invariant
                    for layer in model.layers))


def _fused_layers(model: LlamaForCausalLM, st: _Stream, kv_caches: list[torch.Tensor], attend: Attend,
                  region: Region, quantize_inputs: bool = False) -> torch.Tensor:
    """The decoder layers and the final norm over the residual stream ``st`` of ``b`` rows.
    ``quantize_inputs``: a decode graph's step, where ``attend`` can store its output as the GGUF
    o projection's 8-bit activations too (``_o_activations`` says where)."""
    b = st.stream.shape[0]
    gemv_names = one_row_gemv_projections()
    for module, cache in zip(model.layers, kv_caches, strict=True):
        layer = cast(LlamaLayer, module)
        moe = getattr(layer, "moe", None)
        with region("attention"):
            qkv = _norm_linear(st, layer.input_layernorm, layer.qkv_proj, "qkv", gemv_names, b)
            quantized = _o_activations(layer, b) if quantize_inputs else None
            o = attend(layer, qkv, cache, quantized)
            # one row of a mixture of experts: its router may run in the o projection's launch
            routed = (moe is not None and st.pending is None and quantized is None and "o" in gemv_names
                      and moe.routes_in_o(st.stream, layer.o_proj))
            o_tile = _tile("o", layer.o_proj.weight) if routed else ()
            routed = routed and o_tile[4:] in ((), (1,))  # a split-K tile (a benchmark's override): the plain GEMV
            if not routed:
                _residual_linear(st, o.view(b, -1), layer.o_proj, "o", gemv_names, b, quantized=quantized)
        with region("mlp"):
            if routed and moe is not None:
                norm = layer.post_attention_layernorm
                st.stream = moe.forward_from_attention(o.view(b, -1), st.stream, layer.o_proj, o_tile,
                                                       (norm.weight, norm.eps))
                continue
            if moe is not None:  # a mixture-of-experts layer (models.moe.MoeLayer): routing and
                # the fused experts, fixed shapes, no host sync; the residual is added in their
                # combine kernel, so the next layer's qkv GEMV can take its norm in its prologue
                norm = layer.post_attention_layernorm
                if st.pending is None and moe.fuses_norm(st.stream):  # a few tokens: 3 launches
                    st.stream = moe.forward_normed(st.stream, (norm.weight, norm.eps))
                    continue
                h = st.normed(norm)
                st.stream = moe(h, residual=st.stream)
                continue
            _dense_mlp(st, layer, gemv_names, b)
    with region("final_norm"):
        h = st.normed(model.norm)
    return h
