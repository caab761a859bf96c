"""DeepSeek-V2/V3-style decoders: multi-head latent attention over a latent paged cache
(``attention.mla``) and mixture-of-experts layers with shared experts and group-limited routing
(``models.moe``); the first ``first_k_dense_replace`` layers keep a dense SwiGLU MLP.

The rotary part of each query/key head is rotated in DeepSeek's interleaved pairs ``(x0, x1),
(x2, x3), ...`` (``rope_interleave``; V3 with ``rope_interleave=false``: halves, as Llama).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import ClassVar, cast

import torch
from torch import nn

from deepinfer.runtime.attention.metadata import AttentionMetadata
from deepinfer.runtime.attention.mla import mla_paged_attention, write_latent
from deepinfer.runtime.models.config import MlaSpec, ModelConfig
from deepinfer.runtime.models.llama import AttentionFn, LlamaForCausalLM, RMSNorm
from deepinfer.runtime.models.moe import SparseMoe, SwiGLU
from deepinfer.runtime.models.rotary import RotaryEmbedding, yarn_mscale

_ATTENTION_PARTS = ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
                    "kv_b_proj", "o_proj")
Region = Callable[[str], AbstractContextManager[None]]
NormFn = Callable[[RMSNorm, torch.Tensor], torch.Tensor]


def _module_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return norm(x)


def _triton_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    from deepinfer.runtime.kernels.fused_ops import add_rmsnorm

    return add_rmsnorm(x, None, norm.weight, norm.eps)[0]


class _Residual:
    """The residual stream of a graph decode step: ``stream`` (the sum so far) and ``pending``
    (a block's output not yet added), added by the next norm in the same kernel."""

    def __init__(self, x: torch.Tensor) -> None:
        self.stream = x
        self.pending: torch.Tensor | None = None

    def normed(self, norm: RMSNorm) -> torch.Tensor:
        from deepinfer.runtime.kernels.fused_ops import add_rmsnorm

        h, self.stream = add_rmsnorm(self.stream if self.pending is None else self.pending,
                                     None if self.pending is None else self.stream, norm.weight, norm.eps)
        self.pending = None
        return h
LATENT_NORM_EPS = 1e-6  # DeepSeek's q_a / kv_a layernorms keep RMSNorm's default epsilon


def rotate_interleaved(cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, d] whose pairs are adjacent values (x[2i], x[2i+1]) by frequency i.
    ``cos_sin``: the step's [T, 1, d] tables (frequencies repeated over the two halves)."""
    cos, sin = cos_sin
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * c - odd * s, odd * c + even * s], dim=-1).flatten(-2)


class MlaLayer(nn.Module):
    """Pre-norm MLA attention and pre-norm MLP (dense SwiGLU or SparseMoe) with residuals."""

    def __init__(self, cfg: ModelConfig, mla: MlaSpec, moe: bool) -> None:
        super().__init__()
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        self.mla, self.num_heads = mla, heads
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        qk = mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj: nn.Linear | None = nn.Linear(h, heads * qk, bias=False)
            self.q_a_proj = self.q_b_proj = None
            self.q_a_layernorm: RMSNorm | None = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(h, mla.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * mla.v_head_dim, h, bias=False)
        self.scale = qk ** -0.5
        sc = cfg.rope_scaling or {}
        if sc.get("rope_type", sc.get("type")) not in (None, "default") and sc.get("mscale_all_dim"):
            # YaRN: the softmax scale grows with the stretch (transformers' yarn_apply_mscale)
            self.scale *= yarn_mscale(float(sc["factor"]), float(sc["mscale_all_dim"])) ** 2
        self.mlp: nn.Module = (SparseMoe(h, cfg.moe) if moe and cfg.moe is not None
                               else SwiGLU(h, cfg.intermediate_size))

    def _latent_query(self, h: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                      norm: NormFn = _module_norm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_nope [T, H, nope], rotated q_pe [T, H, rope], latent [T, C + rope]) of normed rows;
        ``norm(module, x)`` applies the q_a / kv_a RMSNorms (the decode graphs: a Triton kernel)."""
        mla, t = self.mla, h.shape[0]
        if self.q_proj is not None:
            q = self.q_proj.forward(h)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj.forward(norm(self.q_a_layernorm, self.q_a_proj.forward(h)))
        q = q.view(t, self.num_heads, mla.qk_head_dim)
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa.forward(h).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        rotate = rotate_interleaved if mla.rope_interleave else RotaryEmbedding.rotate_one
        q_pe = rotate(cos_sin, q_pe)
        k_pe = rotate(cos_sin, k_pe.unsqueeze(1)).squeeze(1)
        return q_nope, q_pe, torch.cat([norm(self.kv_a_layernorm, c), k_pe], dim=-1)

    def kv_b(self) -> torch.Tensor:
        """kv_b_proj's weight as [H, nope + v, C]."""
        mla = self.mla
        return self.kv_b_proj.weight.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                meta: AttentionMetadata, attention: AttentionFn) -> torch.Tensor:
        t = x.shape[0]
        q_nope, q_pe, latent = self._latent_query(self.input_layernorm(x), cos_sin)
        o = mla_paged_attention(q_nope, q_pe, latent, kv_cache, meta, self.kv_b(), self.scale)
        x = x + self.o_proj.forward(o.reshape(t, -1))
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode_forward(self, st: _Residual, cos_sin: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                       slots: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       num_splits: int, region: Region) -> None:
        """``forward`` for one token per sequence from device tensors only (the decode graphs),
        on the residual stream ``st``: the Triton MLA decode kernel over the latent cache
        (``attention.triton_mla``), the RMSNorms as Triton kernels with the residual adds folded
        in. ``slots``: every row's cache slot (padding rows: the scratch block's)."""
        from deepinfer.runtime.attention.triton_mla import mla_decode  # (Triton: CUDA builds only)

        t, nope = st.stream.shape[0], self.mla.qk_nope_head_dim
        with region("attention"):
            q_nope, q_pe, latent = self._latent_query(st.normed(self.input_layernorm), cos_sin, _triton_norm)
            write_latent(kv_cache, latent, slots)
            kv_b = self.kv_b()
            q = torch.cat([torch.einsum("bhd,hdc->bhc", q_nope, kv_b[:, :nope]), q_pe], dim=-1)
            o_lat = mla_decode(q, kv_cache, block_tables, seq_lens, self.mla.kv_lora_rank, self.scale, num_splits)
            o = torch.einsum("bhc,hvc->bhv", o_lat.to(q.dtype), kv_b[:, nope:])
            st.pending = self.o_proj.forward(o.reshape(t, -1))
        with region("mlp"):
            st.pending = self.mlp(st.normed(self.post_attention_layernorm))


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """Embedding, MLA decoder layers, final norm and LM head (DeepSeek-V2/V3 checkpoints)."""

    # decode graphs run ``graph_decode_forward`` (the Triton MLA decode kernel, fused MoE)
    supports_decode_graphs: ClassVar[bool] = True

    def graph_decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                             slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                             num_splits: int, region: Region | None = None) -> torch.Tensor:
        """Final hidden states [B, hidden] of one decode token per sequence, from device tensors
        only (captured by ``worker.cuda_graph_runner``); rows with slot -1 are padding: they
        write the scratch block (the cache's last)."""
        region = region or (lambda name: contextlib.nullcontext())
        cache0 = kv_caches[0]
        scratch = (cache0.shape[1] - 1) * cache0.shape[2]
        slots = torch.where(slot_mapping < 0, torch.full_like(slot_mapping, scratch), slot_mapping).long()
        with region("embed"):
            st = _Residual(self.embed_tokens.forward(input_ids.long()))
        cos_sin = self.rotary.tables(positions.long(), st.stream.dtype)
        for module, cache in zip(self.layers, kv_caches, strict=True):
            cast(MlaLayer, module).decode_forward(st, cos_sin, cache, slots, block_tables, seq_lens, num_splits, region)
        with region("final_norm"):
            return st.normed(self.norm)

    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        assert cfg.mla is not None
        return MlaLayer(cfg, cfg.mla, moe=cfg.moe is not None and index in cfg.moe.moe_layers)

    def weight_slots(self) -> dict[str, tuple[torch.Tensor, slice]]:
        full = slice(None)
        slots: dict[str, tuple[torch.Tensor, slice]] = {"model.norm.weight": (self.norm.weight, full),
                                                        "model.embed_tokens.weight": (self.embed_tokens.weight, full)}
        if isinstance(self.lm_head, nn.Linear):
            slots["lm_head.weight"] = (self.lm_head.weight, full)
        for i, module in enumerate(self.layers):
            layer = cast(MlaLayer, module)
            p = f"model.layers.{i}."
            for name in ("input_layernorm", "post_attention_layernorm"):
                slots[p + name + ".weight"] = (getattr(layer, name).weight, full)
            for name in _ATTENTION_PARTS:
                sub = getattr(layer, name)
                if sub is not None:
                    slots[f"{p}self_attn.{name}.weight"] = (sub.weight, full)
            if isinstance(layer.mlp, SparseMoe):
                slots.update(layer.mlp.slots(p + "mlp.", ("experts", "gate_proj", "up_proj", "down_proj")))
            else:
                slots.update(cast(SwiGLU, layer.mlp).slots(p + "mlp."))
        return slots

    def use_cpu_linears(self) -> None:
        from deepinfer.runtime.models.cpu_linear import cpu_linear

        self.head_linear = cpu_linear

    @torch.no_grad()
    def store_wide_projections_input_major(self) -> None:
        """Only the LM head is re-laid (see LlamaForCausalLM's method)."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        head.weight.data = head.weight.data.t().contiguous().t()

    @torch.no_grad()
    def init_dummy_weights(self, seed: int = 0) -> None:
        super().init_dummy_weights(seed)
        for module in self.layers:
            mlp = cast(MlaLayer, module).mlp
            if isinstance(mlp, SparseMoe) and mlp.correction_bias is not None:
                mlp.correction_bias.zero_()
