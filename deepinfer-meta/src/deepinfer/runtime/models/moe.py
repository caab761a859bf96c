"""Mixture-of-experts decoders on the Llama-family attention: Mixtral, Qwen2-MoE, Qwen3-MoE.

A routing layer scores every expert per token (softmax, or DeepSeek-V3's sigmoid), keeps the top-k
(``route``), and runs each expert on its own tokens only: the (token, expert) pairs are sorted by
expert and every expert with tokens runs one SwiGLU over its rows (``ExpertsSwiGLU``), whose
outputs are weighted and added back to their tokens. A shared expert (Qwen2-MoE, DeepSeek) runs on
every token. Ties between expert scores resolve as transformers resolves them: ``torch.topk`` over
the same float32 scores, with the family's ``sorted`` flag.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.runtime import switches
from deepinfer.runtime.models.config import ModelConfig, MoeSpec
from deepinfer.runtime.models.llama import LlamaForCausalLM, LlamaLayer


def route(logits: torch.Tensor, spec: MoeSpec, correction_bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64) from router logits [T, E].

    softmax scoring: probabilities over all experts, top-k (within the best ``topk_group`` groups
    for group_limited_greedy), renormalised when ``norm_topk_prob``. sigmoid scoring (noaux_tc):
    per-expert sigmoid; groups ranked by the sum of their two best bias-corrected scores, top-k of
    the corrected scores in the kept groups, weights the uncorrected scores (renormalised when
    ``norm_topk_prob``). Weights are then scaled by ``routed_scaling_factor``."""
    t, e = logits.shape
    k = spec.top_k
    scores = logits.float().softmax(dim=-1) if spec.scoring == "softmax" else logits.float().sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if spec.topk_method != "greedy":
        grouped = choice.view(t, spec.n_group, e // spec.n_group)
        group_scores = grouped.max(dim=-1).values if spec.topk_method == "group_limited_greedy" \
            else grouped.topk(2, dim=-1)[0].sum(dim=-1)
        keep_groups = torch.topk(group_scores, k=spec.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, keep_groups, 1.0).bool()
        keep = keep.unsqueeze(-1).expand(-1, -1, e // spec.n_group).reshape(t, e)
        choice = choice.masked_fill(~keep, 0.0 if spec.topk_method == "group_limited_greedy" else float("-inf"))
    if spec.scoring == "softmax" and correction_bias is None:
        weights, ids = torch.topk(choice, k, dim=-1, sorted=spec.sorted_topk)
    else:
        ids = torch.topk(choice, k, dim=-1, sorted=spec.sorted_topk)[1]
        weights = scores.gather(1, ids)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if spec.scoring == "sigmoid" else 0.0))
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    return weights, ids


def _triton_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


# Tests: run the Triton kernels on CPU tensors too (under TRITON_INTERPRET=1, Triton's interpreter).
KERNELS_ON_CPU = False


def _kernels(x: torch.Tensor) -> bool:
    return (x.is_cuda or KERNELS_ON_CPU) and _triton_available()


# Experts this large (bytes of one expert's w13 + w2) take the few-token kernels at one token only:
# the grouped GEMMs read each distinct expert once, the few-token kernels once per (token, slot)
# pair, and with large experts the re-reads cost more than the sort saves. H200, one Mixtral-8x7B
# layer (352 MB an expert in bf16; bench/moe_small_bench.py --quick, 2026-12-04): few-token against
# grouped 186.5 / 197.9 us at one token, 320.1 / 277.9 at two, 585.1 / 508.3 at four. Qwen3-30B-A3B
# (9.4 MB) and DeepSeek-V2-Lite (17 MB) gain up to four tokens.
LARGE_EXPERT_BYTES = 64 << 20


def _small_batch(x: torch.Tensor, experts: ExpertsSwiGLU) -> bool:
    """Whether the few-token kernels (``kernels.moe_decode``, no sort by expert) run these rows:
    up to ``DEEPINFER_MOE_SMALL_BATCH`` tokens, one for experts of ``LARGE_EXPERT_BYTES`` or more."""
    limit = switches.integer("DEEPINFER_MOE_SMALL_BATCH")
    if experts.expert_bytes() >= LARGE_EXPERT_BYTES:
        limit = min(limit, 1)
    return _kernels(x) and 0 < x.shape[0] <= limit


class ExpertsSwiGLU(nn.Module):
    """``num_experts`` SwiGLU experts stored stacked: ``w13`` [E, 2I, H] (gate rows, then up
    rows) and ``w2`` [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def expert_bytes(self) -> int:
        """Bytes of one expert's weights (w13 and w2)."""
        return (self.w13.shape[1] * self.w13.shape[2] + self.w2.shape[1] * self.w2.shape[2]) * self.w13.element_size()

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """Sum over each token's experts of weight * expert(x) [T, H] (plus ``residual``, given);
        only routed rows computed (on CUDA: the fused Triton kernels of ``kernels.fused_moe``, or
        for a few tokens those of ``kernels.moe_decode``)."""
        if _small_batch(x, self):
            from deepinfer.runtime.kernels.moe_decode import experts_small

            return experts_small(x, weights.float().contiguous(), ids.contiguous(), self.w13, self.w2,
                                 residual=residual)
        if _kernels(x):
            from deepinfer.runtime.kernels.fused_moe import fused_experts

            return fused_experts(x, weights, ids, self.w13, self.w2, residual=residual)
        out = self._forward_torch(x, weights, ids)
        return out if residual is None else residual + out

    def _forward_torch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.w13.shape[0]).tolist()
        tokens = order // k
        pair_w = weights.reshape(-1)[order].to(x.dtype).unsqueeze(1)
        xs = x[tokens]
        ys = torch.empty_like(xs)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue  # an expert no token chose costs nothing
            rows = slice(start, start + n)
            gate, up = F.linear(xs[rows], self.w13[expert]).split(self.intermediate, dim=-1)
            ys[rows] = F.linear(F.silu(gate).mul_(up), self.w2[expert])
            start += n
        out = torch.zeros_like(x)
        return out.index_add_(0, tokens, ys.mul_(pair_w))


class SwiGLU(nn.Module):
    """A dense SwiGLU MLP with fused gate/up rows (shared experts, DeepSeek's dense layers)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward(x).split(self.intermediate, dim=-1)
        return self.down_proj.forward(F.silu(gate).mul_(up))

    def slots(self, prefix: str) -> dict[str, tuple[torch.Tensor, slice]]:
        m = self.intermediate
        return {prefix + "gate_proj.weight": (self.gate_up_proj.weight, slice(0, m)),
                prefix + "up_proj.weight": (self.gate_up_proj.weight, slice(m, 2 * m)),
                prefix + "down_proj.weight": (self.down_proj.weight, slice(None))}


class SparseMoe(nn.Module):
    """Router + routed experts (+ shared expert) of one layer."""

    def __init__(self, hidden: int, spec: MoeSpec) -> None:
        super().__init__()
        self.spec = spec
        self.gate = nn.Linear(hidden, spec.num_experts, bias=False)
        self.experts = ExpertsSwiGLU(spec.num_experts, hidden, spec.expert_intermediate_size)
        self.shared = SwiGLU(hidden, spec.shared_intermediate_size) if spec.shared_intermediate_size else None
        self.shared_gate = nn.Linear(hidden, 1, bias=False) if spec.shared_expert_gate else None
        # DeepSeek-V3 (noaux_tc): a per-expert bias added to the scores for the choice only
        self.correction_bias = nn.Parameter(torch.empty(spec.num_experts)) if spec.topk_method == "noaux_tc" else None

    def _derived(self, name: str, sources: tuple[torch.Tensor, ...], make: Callable[[], object]) -> object:
        """``make()``, kept as attribute ``name`` until one of ``sources`` is written (a reload bumps
        its version) or replaced."""
        key = tuple((w.data_ptr(), w._version, w.device) for w in sources)
        cached = getattr(self, name, None)
        if cached is None or cached[0] != key:
            cached = (key, make())
            setattr(self, name, cached)
        return cached[1]

    def _gate_weight_f32(self) -> torch.Tensor:
        # the router runs in float32; a model in bf16 keeps a float32 copy of its (small) router
        # rather than casting it every step (two launches a layer, and a copy inside graphs)
        w = self.gate.weight
        if w.dtype == torch.float32:
            return w
        return cast(torch.Tensor, self._derived("_gate_f32", (w,), lambda: w.detach().float()))

    def _greedy(self) -> bool:
        return self.spec.topk_method == "greedy" and self.correction_bias is None

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, ids [T, k] int64) of the hidden rows ``h``: on CUDA, plain
        top-k routing runs as one Triton kernel after the router's matmul
        (``kernels.fused_moe.route_greedy``), or for a few tokens with it (``moe_decode.route_small``)."""
        spec = self.spec
        if self._greedy() and _small_batch(h, self.experts):
            from deepinfer.runtime.kernels.moe_decode import route_small

            return route_small(h, self._gate_weight_f32(), spec.top_k, spec.scoring == "sigmoid",
                               spec.norm_topk_prob, spec.routed_scaling_factor)
        logits = F.linear(h.float(), self._gate_weight_f32())
        if self._greedy() and _kernels(h):
            from deepinfer.runtime.kernels.fused_moe import route_greedy

            return route_greedy(logits, spec.top_k, spec.scoring == "sigmoid", spec.norm_topk_prob,
                                spec.routed_scaling_factor)
        return route(logits, spec, self.correction_bias)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output for the normed rows ``h`` [T, H]; ``residual`` given: residual +
        output (without a shared expert, added inside the experts' combine kernel on CUDA)."""
        weights, ids = self.route(h)
        if self.shared is None:
            return self.experts(h, weights, ids, residual)
        out = self.experts(h, weights, ids)
        s = self.shared(h)
        if self.shared_gate is not None:
            s = torch.sigmoid(self.shared_gate.forward(h)) * s
        out = out + s
        return out if residual is None else residual + out

    def fuses_norm(self, x: torch.Tensor) -> bool:
        """Whether ``forward_normed`` runs these rows: a few tokens, greedy routing, no shared expert."""
        return self.shared is None and self._greedy() and _small_batch(x, self.experts)

    def forward_normed(self, x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
        """``x + forward(RMSNorm(x) * norm weight)`` for the residual stream ``x`` [T, H] where
        ``fuses_norm(x)``: the norm runs inside the router and gate/up kernels, the residual add
        inside the down kernel (three launches; ``kernels.moe_decode``)."""
        from deepinfer.runtime.kernels.moe_decode import experts_small, route_small

        spec = self.spec
        # The router's program 0 keeps the normed rows: the gate/up programs then read them instead
        # of each reading x and the norm weight twice more (DEEPINFER_MOE_PRENORM=0: they do).
        normed = torch.empty(x.shape, dtype=x.dtype, device=x.device) if switches.enabled("DEEPINFER_MOE_PRENORM") else None
        weights, ids = route_small(x, self._gate_weight_f32(), spec.top_k, spec.scoring == "sigmoid",
                                   spec.norm_topk_prob, spec.routed_scaling_factor, norm=norm, normed_out=normed)
        if normed is not None:
            return experts_small(normed, weights, ids, self.experts.w13, self.experts.w2, residual=x)
        return experts_small(x, weights, ids, self.experts.w13, self.experts.w2, residual=x, norm=norm)

    def routes_in_o(self, x: torch.Tensor, o_proj: nn.Module) -> bool:
        """Whether ``forward_from_attention`` runs this one-row step: ``fuses_norm``, a plain
        ``o_proj`` (no bias, not quantized, not sharded) and ``DEEPINFER_MOE_ROUTER_IN_O=1``."""
        return (x.shape[0] == 1 and switches.enabled("DEEPINFER_MOE_ROUTER_IN_O") and type(o_proj) is nn.Linear
                and o_proj.bias is None and o_proj.weight.dtype == x.dtype and o_proj.weight.stride(1) == 1
                and self.fuses_norm(x))

    def _router_in_o(self, o_weight: torch.Tensor, norm_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (W_r diag(g), W_r diag(g) W_o) in float32 for route_in_o
        gate = self.gate.weight

        def make() -> tuple[torch.Tensor, torch.Tensor]:
            wx = (gate.detach().float() * norm_weight.detach().float()[None, :]).contiguous()
            return wx, (wx.double() @ o_weight.detach().double()).float().contiguous()

        return cast(tuple[torch.Tensor, torch.Tensor], self._derived("_router_o", (gate, o_weight, norm_weight), make))

    def forward_from_attention(self, a: torch.Tensor, x: torch.Tensor, o_proj: nn.Linear,
                               o_config: tuple[int, ...], norm: tuple[torch.Tensor, float]) -> torch.Tensor:
        """``h + forward(RMSNorm(h) * norm weight)`` with ``h = x + o_proj(a)`` for one row where
        ``routes_in_o``: the router runs in the o projection's launch (``moe_decode.route_in_o``),
        the routing weights are stored by the gate/up kernel: three launches for the o projection
        and the block instead of four."""
        from deepinfer.runtime.kernels.moe_decode import experts_small, route_in_o

        spec = self.spec
        wx, wa = self._router_in_o(o_proj.weight, norm[0])
        h, weights, ids, logits = route_in_o(a, o_proj.weight, x, wx, wa, spec.top_k, o_config)
        return experts_small(h, weights, ids, self.experts.w13, self.experts.w2, residual=h, norm=norm,
                             route_logits=(logits, spec.scoring == "sigmoid", spec.norm_topk_prob,
                                           spec.routed_scaling_factor))

    def slots(self, prefix: str, names: tuple[str, str, str, str]) -> dict[str, tuple[torch.Tensor, slice]]:
        """Checkpoint name -> (parameter, rows). ``names``: the routed experts' folder and their
        gate, up and down projection names (``experts``, ``gate_proj``...; Mixtral ``w1``...)."""
        folder, g, u, d = names
        m, full = self.experts.intermediate, slice(None)
        slots = {prefix + "gate.weight": (self.gate.weight, full)}
        for j in range(self.spec.num_experts):
            e = f"{prefix}{folder}.{j}."
            slots[e + g + ".weight"] = (self.experts.w13[j], slice(0, m))
            slots[e + u + ".weight"] = (self.experts.w13[j], slice(m, 2 * m))
            slots[e + d + ".weight"] = (self.experts.w2[j], full)
        if self.correction_bias is not None:
            slots[prefix + "gate.e_score_correction_bias"] = (self.correction_bias, full)
        if self.shared is not None:
            # Qwen2-MoE: one gated "shared_expert"; DeepSeek: "shared_experts" fused into one MLP
            slots.update(self.shared.slots(prefix + ("shared_expert." if self.shared_gate else "shared_experts.")))
        if self.shared_gate is not None:
            slots[prefix + "shared_expert_gate.weight"] = (self.shared_gate.weight, full)
        return slots


class MoeLayer(LlamaLayer):
    """A Llama-family attention layer whose MLP is a SparseMoe."""

    def __init__(self, cfg: ModelConfig, spec: MoeSpec) -> None:
        super().__init__(cfg)
        self.gate_up_proj = None  # type: ignore[assignment]
        self.down_proj = None  # type: ignore[assignment]
        self.moe = SparseMoe(cfg.hidden_size, spec)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.moe(h)


# The checkpoint folder of each family's MoE block and its experts' projection names.
_HF_NAMES = {"mixtral": ("block_sparse_moe.", ("experts", "w1", "w3", "w2"))}
_QWEN_NAMES = ("mlp.", ("experts", "gate_proj", "up_proj", "down_proj"))


def gguf_slots(moe: SparseMoe, prefix: str) -> dict[str, tuple[torch.Tensor, slice]]:
    """The GGUF loader's names (``loading.gguf_loader``): experts stacked [E, rows, cols] as
    llama.cpp stores them, the shared expert's gate a vector."""
    m, full = moe.experts.intermediate, slice(None)
    slots = {prefix + "gate.weight": (moe.gate.weight, full),
             prefix + "experts.gate_proj.weight": (moe.experts.w13[:, :m], full),
             prefix + "experts.up_proj.weight": (moe.experts.w13[:, m:], full),
             prefix + "experts.down_proj.weight": (moe.experts.w2, full)}
    if moe.shared is not None:
        slots.update(moe.shared.slots(prefix + "shared_expert."))
    if moe.shared_gate is not None:
        slots[prefix + "shared_expert_gate.weight"] = (moe.shared_gate.weight[0], full)
    return slots


class MoeForCausalLM(LlamaForCausalLM):
    """Mixtral / Qwen2-MoE / Qwen3-MoE: LlamaForCausalLM with SparseMoe layers where the config
    routes (``MoeSpec.moe_layers``), dense SwiGLU layers elsewhere."""

    # routing, the sort by expert and the grouped GEMMs keep fixed shapes and never sync the host
    supports_decode_graphs: ClassVar[bool] = True
    gguf_names = False  # set by the loader for GGUF files: weight_slots then names llama.cpp's layout

    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        if cfg.moe is not None and index in cfg.moe.moe_layers:
            return MoeLayer(cfg, cfg.moe)
        return LlamaLayer(cfg)

    def weight_slots(self) -> dict[str, tuple[torch.Tensor, slice]]:
        slots = super().weight_slots()  # attention, norms, dense MLPs, embeddings
        prefix, names = _HF_NAMES.get(self.config.architecture, _QWEN_NAMES)
        for i, module in enumerate(self.layers):
            if isinstance(module, MoeLayer):
                slots.update(gguf_slots(module.moe, f"model.layers.{i}.mlp.") if self.gguf_names
                             else module.moe.slots(f"model.layers.{i}.{prefix}", names))
        return slots

    @torch.no_grad()
    def init_dummy_weights(self, seed: int = 0) -> None:
        super().init_dummy_weights(seed)
        for module in self.layers:
            moe = getattr(module, "moe", None)
            if isinstance(moe, SparseMoe) and moe.correction_bias is not None:
                moe.correction_bias.zero_()


def moe_layers(model: nn.Module) -> list[SparseMoe]:
    """The SparseMoe blocks of a model (tests, benchmarks)."""
    return [m for m in model.modules() if isinstance(m, SparseMoe)]
