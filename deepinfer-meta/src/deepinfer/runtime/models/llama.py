"""The Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm)
over a paged KV cache.

Inputs are flattened over the batch (var-len): ``input_ids`` and ``positions`` [T], plus the
step's AttentionMetadata. Q/K/V and gate/up projections are fused into one matmul each, which
matters on CPU where per-op overhead dominates small models.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.runtime.attention.metadata import AttentionMetadata
from deepinfer.runtime.models.config import ModelConfig
from deepinfer.runtime.models.rotary import RotaryEmbedding

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float],
                       torch.Tensor]


class RMSNorm(nn.Module):
    """RMS normalisation computed in float32, as transformers' LlamaRMSNorm does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        # Set by LlamaForCausalLM.use_batch_invariant_kernels (deterministic=True on CUDA)
        self.batch_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            from deepinfer.runtime.kernels.batch_invariant import invariant_rms_norm

            return invariant_rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class LlamaLayer(nn.Module):
    """One decoder layer: pre-norm attention and pre-norm SwiGLU MLP with residuals."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.intermediate_size = cfg.intermediate_size
        self.scale = self.head_dim ** -0.5
        # Qwen3: RMSNorm over each q and k head (weights of head_dim) before rotary
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                kv_cache: torch.Tensor, meta: AttentionMetadata, attention: AttentionFn) -> torch.Tensor:
        # .forward called directly: no Module hook overhead, 4 matmuls x every layer. The
        # projections are nn.Linear or, for GGUF weights kept quantized, models.quantized.Int4Linear.
        h = self.input_layernorm(x)
        qkv = self.qkv_proj.forward(h)
        t, qk_size = x.shape[0], self.split[0] + self.split[1]
        # q and k sit side by side in qkv: one rotation for both heads (elementwise, same values)
        qk = qkv[:, :qk_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])], dim=1)
        qk = RotaryEmbedding.rotate_one(cos_sin, qk)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, qk_size:].view(t, self.num_kv_heads, self.head_dim)
        o = attention(q, k, v, kv_cache, meta, self.scale)
        x = x + self.o_proj.forward(o.reshape(t, -1))
        return x + self.feed_forward(self.post_attention_layernorm(x))

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        """The SwiGLU MLP of the normed rows ``h`` [T, hidden] (mixture-of-experts layers,
        ``models.moe``, replace it)."""
        gate, up = self.gate_up_proj.forward(h).split(self.intermediate_size, dim=-1)
        return self.down_proj.forward(F.silu(gate).mul_(up))  # in place: one [T, I] tensor fewer


class LlamaForCausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head of a Llama-family model."""

    # Whether the CUDA decode graphs (and their fused Triton forward) can run this model.
    supports_decode_graphs: ClassVar[bool] = True

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None,
                 rope_freq_factors: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = cfg
        # _weight: skip the random init (weights are loaded; on the meta device the init's
        # normal_ would import torch._dynamo and sympy, ~1 s of startup)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Set by the loader when the output projection keeps a GGUF quantization (Int4Linear).
        self.quantized_head: nn.Module | None = None
        # The LM head's matmul: F.linear, or models.cpu_linear's on CPU (use_cpu_linears)
        self.head_linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear
        with torch.device("cpu"):  # real tables even when built on meta (torch's meta refs import sympy)
            self.rotary = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings,
                                          cfg.rope_theta, cfg.rope_scaling, rope_freq_factors)

    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        """Decoder layer ``index`` (the mixture-of-experts and MLA models override it)."""
        return LlamaLayer(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, attention: AttentionFn,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states [T, hidden] for the flattened tokens of one step. ``inputs_embeds``
        [T, hidden]: the step's input embeddings, given (prompt embeddings), instead of
        ``embed_tokens(input_ids)``."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos_sin = self.rotary.tables(positions, x.dtype)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos_sin, cache, meta, attention)
        return self.norm(x)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] of the given hidden rows, in the head's dtype (the one place the
        LM head is applied: the tensor-parallel model gathers its vocabulary shards here)."""
        if self.quantized_head is not None:
            return self.quantized_head.forward(hidden)
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.head_linear(hidden, w)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [rows, vocab] of the given hidden rows."""
        return self.head_logits(hidden).float()

    def weight_slots(self) -> dict[str, tuple[torch.Tensor, slice]]:
        """Where each Hugging Face-named tensor goes: (parameter, its rows in it). q/k/v share the
        fused qkv parameter and gate/up the fused gate_up one. Projections replaced by quantized
        layers have no slot."""
        full = slice(None)
        slots: dict[str, tuple[torch.Tensor, slice]] = {"model.norm.weight": (self.norm.weight, full)}
        if isinstance(self.embed_tokens, nn.Embedding):
            slots["model.embed_tokens.weight"] = (self.embed_tokens.weight, full)
        if isinstance(self.lm_head, nn.Linear):
            slots["lm_head.weight"] = (self.lm_head.weight, full)
        for i, module in enumerate(self.layers):
            layer = cast(LlamaLayer, module)
            p = f"model.layers.{i}."
            slots[p + "input_layernorm.weight"] = (layer.input_layernorm.weight, full)
            slots[p + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight, full)
            if layer.q_norm is not None and layer.k_norm is not None:
                slots[p + "self_attn.q_norm.weight"] = (layer.q_norm.weight, full)
                slots[p + "self_attn.k_norm.weight"] = (layer.k_norm.weight, full)
            q, kv = layer.split[0], layer.split[1]
            rows = {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}
            if isinstance(layer.qkv_proj, nn.Linear):
                for n, r in rows.items():
                    slots[p + f"self_attn.{n}_proj.weight"] = (layer.qkv_proj.weight, r)
                    if layer.qkv_proj.bias is not None:
                        slots[p + f"self_attn.{n}_proj.bias"] = (layer.qkv_proj.bias, r)
            if isinstance(layer.o_proj, nn.Linear):
                slots[p + "self_attn.o_proj.weight"] = (layer.o_proj.weight, full)
            if isinstance(layer.gate_up_proj, nn.Linear):
                m = layer.intermediate_size
                slots[p + "mlp.gate_proj.weight"] = (layer.gate_up_proj.weight, slice(0, m))
                slots[p + "mlp.up_proj.weight"] = (layer.gate_up_proj.weight, slice(m, 2 * m))
            if isinstance(layer.down_proj, nn.Linear):
                slots[p + "mlp.down_proj.weight"] = (layer.down_proj.weight, full)
        return slots

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in one at a time (each converted to its parameter's
        dtype and device as it is copied); names without a slot are ignored. ValueError for a
        wrong shape or a missing tensor."""
        slots = self.weight_slots()
        missing = set(slots)
        for name, value in named_tensors:
            slot = slots.get(name)
            if slot is None:
                continue
            param, rows = slot
            target = param[rows]
            if tuple(target.shape) != tuple(value.shape):
                raise ValueError(f"model weights: {name} has shape {tuple(value.shape)}, "
                                 f"expected {tuple(target.shape)}")
            target.copy_(value)
            missing.discard(name)
            del value, target  # free this tensor before the next one is read
        if missing:
            raise ValueError(f"model weights: missing tensor {sorted(missing)[0]!r} "
                             f"({len(missing)} missing in all)")

    def load_hf_weights(self, weights: Mapping[str, object]) -> None:
        """Copy Hugging Face-named weights (numpy arrays or tensors) in, fusing qkv and gate/up."""
        self.load_weights((name, w if isinstance(w, torch.Tensor) else torch.from_numpy(w))  # type: ignore[arg-type]
                          for name, w in weights.items())

    def use_cpu_linears(self) -> None:
        """Run the float32 projections and LM head of this CPU model through
        ``models.cpu_linear`` (oneDNN from a few rows on); the parameters stay the same tensors."""
        from deepinfer.runtime.models.cpu_linear import CpuLinear, cpu_linear

        for module in self.layers:
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                linear = getattr(module, name)
                if type(linear) is nn.Linear:  # not quantized layers, not tensor-parallel ones
                    setattr(module, name, CpuLinear.sharing(linear))
        self.head_linear = cpu_linear

    def use_batch_invariant_kernels(self) -> None:
        """Run every projection, RMSNorm and the LM head through ``kernels.batch_invariant`` (Triton),
        whose rows do not depend on the other rows of the step: ``deterministic=True`` on CUDA.
        The parameters stay the same tensors. ValueError for a layer kept quantized."""
        from deepinfer.runtime.kernels.batch_invariant import InvariantLinear, invariant_linear

        if type(self) is not LlamaForCausalLM:  # experts and MLA have other layers (models/moe.py, deepseek_v2.py)
            raise ValueError(f"deterministic=True on CUDA runs the dense Llama family only, not "
                             f"{type(self).__name__}")
        if self.quantized_head is not None:
            raise ValueError("deterministic=True on CUDA: the LM head is kept quantized "
                             f"({type(self.quantized_head).__name__}); load the model in bfloat16/float16")
        for i, module in enumerate(self.layers):
            layer = cast(LlamaLayer, module)
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                linear = getattr(layer, name)
                if type(linear) is not nn.Linear:
                    raise ValueError(f"deterministic=True on CUDA: layers.{i}.{name} is a "
                                     f"{type(linear).__name__}, not a plain linear layer the batch-invariant "
                                     "kernels can run")
                setattr(layer, name, InvariantLinear.sharing(linear))
            for norm in (layer.input_layernorm, layer.post_attention_layernorm, layer.q_norm, layer.k_norm):
                if norm is not None:
                    norm.batch_invariant = True
        self.norm.batch_invariant = True
        self.head_linear = invariant_linear

    @torch.no_grad()
    def store_wide_projections_input_major(self) -> None:
        """Re-lay the qkv, gate/up and LM-head weights in memory as [in, out] (the parameters keep
        their [out, in] shape as transposed views; values are unchanged).

        For the few rows of a CPU decode step ``x @ W`` over an [in, out] matrix runs 1.4-1.8x
        faster than over [out, in] (measured: SmolLM2's gate/up 625 -> 365 us, LM head 9.3 -> 5.2
        ms per row, one thread); from about 4 rows on both take the same GEMM path and give
        bitwise-equal results. o_proj and down_proj (narrow outputs) are not faster this way.
        The tied embedding lookup reads the same storage with a stride (cheap: a row per token).
        """
        def relayout(module: nn.Module | None) -> None:
            if isinstance(module, (nn.Linear, nn.Embedding)):  # quantized layers keep their packing
                module.weight.data = module.weight.data.t().contiguous().t()

        for module in self.layers:
            layer = cast(LlamaLayer, module)
            relayout(layer.qkv_proj)
            relayout(layer.gate_up_proj)
        if self.quantized_head is None:
            relayout(self.embed_tokens if self.lm_head is None else self.lm_head)

    @torch.no_grad()
    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights of the real shape (for throughput work), scaled to keep activations finite;
        drawn on the parameters' device (one parameter at a time, no host copy)."""
        gen: torch.Generator | None = None
        for name, param in self.named_parameters():
            if gen is None:
                gen = torch.Generator(device=param.device).manual_seed(seed)
            if name.endswith(("layernorm.weight", "_norm.weight")) or name == "norm.weight":
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen, device=param.device) * 0.02)
