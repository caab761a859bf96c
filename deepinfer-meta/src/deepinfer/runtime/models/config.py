"""The architecture of a Llama-family decoder, read from a HF ``config.json`` or GGUF metadata.

Every field is validated (type, range, consistency with the other fields and with the tensors
present) before anything is allocated: a corrupt or inconsistent file is a ValueError naming the
file and the field, never a foreign error or a huge allocation.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Upper bounds far above every released Llama-family model; a larger value is taken as corrupt
# (it would otherwise size a huge allocation: the rotary tables grow with the context length).
MAX_CONTEXT_LENGTH = 1 << 20
_INT_FIELDS: dict[str, int] = {
    "vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 18,
    "num_hidden_layers": 1024, "num_attention_heads": 1024, "num_key_value_heads": 1024,
    "head_dim": 1024, "max_position_embeddings": MAX_CONTEXT_LENGTH,
}
_ROPE_TYPES = ("linear", "llama3", "yarn")


def _int_field(name: str, value: Any, hi: int, lo: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    v = int(value)
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value!r}")
    return v


def _float_field(name: str, value: Any, ok: Callable[[float], bool], what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if not ok(float(value)):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return float(value)


def _bool_field(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def _token_id(name: str, value: Any, vocab: int) -> int:
    return _int_field(name, value, vocab - 1, lo=0)


def check_rope_scaling(name: str, sc: Any) -> dict[str, Any] | None:
    """A supported rope scaling dict (linear, llama3) with finite positive numbers, or None."""
    if sc is None:
        return None
    if not isinstance(sc, Mapping):
        raise ValueError(f"{name} must be an object like {{\"rope_type\": \"linear\", \"factor\": 2.0}}, got {sc!r}")
    kind = sc.get("rope_type", sc.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in _ROPE_TYPES:
        raise ValueError(f"{name}.rope_type {kind!r} is not supported (default, {', '.join(_ROPE_TYPES)})")
    extra = {"llama3": ["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"],
             "yarn": ["original_max_position_embeddings"]}.get(kind, [])
    keys = ["factor", *extra]
    for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
        if kind == "yarn" and sc.get(k) is not None:
            _float_field(f"{name}.{k}", sc[k], lambda v: v >= 0, ">= 0")
    for k in keys:
        if k not in sc:
            raise ValueError(f"{name} of type {kind!r} lacks {k!r}")
        _float_field(f"{name}.{k}", sc[k], lambda v: v > 0, "> 0")
    if kind == "llama3" and not float(sc["high_freq_factor"]) > float(sc["low_freq_factor"]):
        raise ValueError(f"{name}: high_freq_factor must be > low_freq_factor, got {dict(sc)!r}")
    return dict(sc)

_DENSE_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")
_ARCHITECTURES = _DENSE_ARCHITECTURES + MOE_ARCHITECTURES
_HF_CLASSES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class MoeSpec:
    """The mixture-of-experts part of a config (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3).

    ``scoring``: "softmax" over all experts, or "sigmoid" per expert (DeepSeek-V3); ``topk_method``:
    "greedy" (top-k of all experts), "group_limited_greedy" (DeepSeek-V2: the ``topk_group`` groups
    of ``n_group`` with the highest expert score, then top-k inside them) or "noaux_tc" (V3: groups
    ranked by the sum of their two best bias-corrected scores). ``moe_layers``: the layer indices
    that route (the others keep the dense MLP of ``intermediate_size``)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    moe_layers: tuple[int, ...]
    norm_topk_prob: bool = False
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(x . w) scales the shared expert
    scoring: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    sorted_topk: bool = True  # transformers' torch.topk(sorted=...) of the family (ties pick alike)


@dataclass(frozen=True)
class MlaSpec:
    """Multi-head latent attention (DeepSeek-V2/V3): the cache keeps ``kv_lora_rank`` latent values
    plus ``qk_rope_head_dim`` rotated key values per token, shared by every head."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True  # the rotary dims pair up as (x0, x1), (x2, x3), ...

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _moe_layers(cfg: dict[str, Any], model_type: str, layers: int) -> tuple[int, ...]:
    if model_type == "mixtral":
        return tuple(range(layers))
    if model_type.startswith("deepseek"):
        first = _int_field("first_k_dense_replace", cfg.get("first_k_dense_replace", 0), layers, lo=0)
        if cfg.get("moe_layer_freq", 1) != 1:
            raise ValueError(f"moe_layer_freq={cfg['moe_layer_freq']!r} is not supported (1: every layer from "
                             "first_k_dense_replace on routes)")
        return tuple(range(first, layers))
    step = _int_field("decoder_sparse_step", cfg.get("decoder_sparse_step", 1), layers)
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list):
        raise ValueError(f"mlp_only_layers must be a list of layer indices, got {only!r}")
    dense = {_int_field("mlp_only_layers[]", i, layers - 1, lo=0) for i in only}
    return tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)


def parse_moe(cfg: dict[str, Any], model_type: str, layers: int) -> MoeSpec:
    """The MoeSpec of a Hugging Face config of a MOE_ARCHITECTURES model; ValueError naming the
    field for a variant that does not run here."""
    deepseek = model_type.startswith("deepseek")
    # the family's own key first; transformers 5 may save another name of the same field
    keys: tuple[str, ...] = {"mixtral": ("num_local_experts",), "deepseek_v2": ("n_routed_experts",),
            "deepseek_v3": ("n_routed_experts",)}.get(model_type, ("num_experts",))
    keys += tuple(k for k in ("num_experts", "num_local_experts", "n_routed_experts") if k not in keys)
    experts_key = next((k for k in keys if cfg.get(k) is not None), keys[0])
    if cfg.get(experts_key) is None:
        raise KeyError(experts_key)
    experts = _int_field(experts_key, cfg[experts_key], 1 << 12)
    top_k = _int_field("num_experts_per_tok", cfg.get("num_experts_per_tok", 2), experts)
    expert_size = _int_field("intermediate_size" if model_type == "mixtral" else "moe_intermediate_size",
                             cfg["intermediate_size"] if model_type == "mixtral" else cfg.get("moe_intermediate_size"),
                             _INT_FIELDS["intermediate_size"])
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (silu)")
    if cfg.get("use_sliding_window"):
        raise ValueError("use_sliding_window=true is not supported (full attention only)")
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    norm = _bool_field("norm_topk_prob", cfg.get("norm_topk_prob", model_type == "mixtral"))
    if model_type == "mixtral" and not norm:
        raise ValueError("norm_topk_prob=false is not supported for mixtral (Mixtral always renormalises)")
    spec: dict[str, Any] = dict(num_experts=experts, top_k=top_k, expert_intermediate_size=expert_size,
                                moe_layers=_moe_layers(cfg, model_type, layers), norm_topk_prob=norm)
    if model_type == "qwen2_moe":
        spec["shared_intermediate_size"] = _int_field(
            "shared_expert_intermediate_size", cfg.get("shared_expert_intermediate_size", 0),
            _INT_FIELDS["intermediate_size"], lo=0)
        spec["shared_expert_gate"] = spec["shared_intermediate_size"] > 0
    if deepseek:
        shared = _int_field("n_shared_experts", cfg.get("n_shared_experts") or 0, 1 << 8, lo=0)
        spec["shared_intermediate_size"] = shared * expert_size
        method = cfg.get("topk_method", "noaux_tc" if model_type == "deepseek_v3" else "greedy")
        wanted = "noaux_tc" if model_type == "deepseek_v3" else ("greedy", "group_limited_greedy")
        if method not in TOPK_METHODS or (method not in wanted):
            raise ValueError(f"topk_method {method!r} is not supported for {model_type} "
                             f"(supported: {wanted if isinstance(wanted, str) else ', '.join(wanted)})")
        scoring = cfg.get("scoring_func", "sigmoid" if method == "noaux_tc" else "softmax")
        if scoring != ("sigmoid" if method == "noaux_tc" else "softmax"):
            raise ValueError(f"scoring_func {scoring!r} is not supported with topk_method {method!r}")
        if model_type == "deepseek_v2" and norm:
            raise ValueError("norm_topk_prob=true is not supported for deepseek_v2 (transformers' DeepseekV2 "
                             "ignores it and DeepSeek's reference code applies it: no single answer to match)")
        spec.update(scoring=scoring, topk_method=method, sorted_topk=False,
                    routed_scaling_factor=_float_field("routed_scaling_factor", cfg.get("routed_scaling_factor", 1.0),
                                                       lambda v: v > 0, "> 0"))
        if method != "greedy":
            n_group = _int_field("n_group", cfg.get("n_group"), experts)
            if experts % n_group:
                raise ValueError(f"n_group={n_group} does not divide the {experts} experts ({experts_key})")
            topk_group = _int_field("topk_group", cfg.get("topk_group"), n_group)
            if method == "noaux_tc" and experts // n_group < 2:
                raise ValueError(f"n_group={n_group}: noaux_tc ranks groups by their two best experts; "
                                 f"groups of {experts // n_group} expert(s) are too small")
            if top_k > topk_group * (experts // n_group):
                raise ValueError(f"num_experts_per_tok={top_k} exceeds the experts of topk_group={topk_group} "
                                 f"groups ({topk_group * (experts // n_group)})")
            spec.update(n_group=n_group, topk_group=topk_group)
    return MoeSpec(**spec)


def parse_mla(cfg: dict[str, Any], model_type: str) -> MlaSpec:
    """The MlaSpec of a DeepSeek-V2/V3 config; ValueError naming the field."""
    hi = _INT_FIELDS["head_dim"]
    q_lora = cfg.get("q_lora_rank")
    if cfg.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported for MLA models")
    interleave = cfg.get("rope_interleave", True)
    rope = _int_field("qk_rope_head_dim", cfg.get("qk_rope_head_dim"), hi)
    if rope % 2:
        raise ValueError(f"qk_rope_head_dim must be even (rotary pairs), got {rope}")
    return MlaSpec(kv_lora_rank=_int_field("kv_lora_rank", cfg.get("kv_lora_rank"), 1 << 14),
                   qk_nope_head_dim=_int_field("qk_nope_head_dim", cfg.get("qk_nope_head_dim"), hi),
                   qk_rope_head_dim=rope,
                   v_head_dim=_int_field("v_head_dim", cfg.get("v_head_dim"), hi),
                   q_lora_rank=None if q_lora is None else _int_field("q_lora_rank", q_lora, 1 << 16),
                   rope_interleave=model_type == "deepseek_v2" or _bool_field("rope_interleave", interleave))


@dataclass
class ModelConfig:
    """Shape and hyper-parameters of a Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: q/k/v projections carry a bias
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k before rotary
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "llama"
    moe: MoeSpec | None = None  # mixture-of-experts layers (MOE_ARCHITECTURES)
    mla: MlaSpec | None = None  # multi-head latent attention (DeepSeek-V2/V3)

    def kv_cache_layout(self) -> tuple[int, int, int]:
        """(planes, heads, values) of one token's cache entry in a layer: (2, kv_heads, head_dim)
        for keys and values, (1, 1, kv_lora_rank + qk_rope_head_dim) for an MLA latent."""
        if self.mla is not None:
            return 1, 1, self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return 2, self.num_key_value_heads, self.head_dim

    def __post_init__(self) -> None:
        for name, hi in _INT_FIELDS.items():
            _int_field(name, getattr(self, name), hi)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple "
                f"of num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary pairs), got {self.head_dim}")
        _float_field("rms_norm_eps", self.rms_norm_eps, lambda v: 0 < v < 1, "in (0, 1)")
        _float_field("rope_theta", self.rope_theta, lambda v: v > 1, "> 1")
        self.rope_scaling = check_rope_scaling("rope_scaling", self.rope_scaling)
        _bool_field("tie_word_embeddings", self.tie_word_embeddings)
        _bool_field("attention_bias", self.attention_bias)
        _bool_field("qk_norm", self.qk_norm)
        if self.bos_token_id is not None:
            _token_id("bos_token_id", self.bos_token_id, self.vocab_size)
        for e in self.eos_token_ids:
            _token_id("eos_token_id", e, self.vocab_size)
        if self.architecture not in _ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not supported ({', '.join(_ARCHITECTURES)})")

    @classmethod
    def from_hf_dict(cls, cfg: Any) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` of a Llama/Qwen2/Qwen3/Mistral-style model.

        ValueError naming the JSON field for a missing, mistyped, out-of-range or inconsistent one."""
        if not isinstance(cfg, dict):
            raise ValueError(f"the config must be a JSON object, got {type(cfg).__name__}")
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type", "llama")
        supported = set(_ARCHITECTURES)
        if model_type == "deepseek_v2" and cfg.get("topk_method") == "noaux_tc":
            raise ValueError("topk_method 'noaux_tc' is not supported for deepseek_v2 (supported: greedy, "
                             "group_limited_greedy; noaux_tc is DeepSeek-V3's, model_type deepseek_v3)")
        if model_type not in supported:
            raise ValueError(
                f"model_type {model_type!r} (architectures {archs}) is not supported; "
                f"supported: {sorted(supported)}")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in cfg:
                raise KeyError(key)
        ints = {k: _int_field(k, cfg[k], hi) for k, hi in _INT_FIELDS.items() if cfg.get(k) is not None}
        heads, hidden = ints["num_attention_heads"], ints["hidden_size"]
        if "head_dim" not in ints and hidden % heads:
            raise ValueError(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads} "
                             "(and no head_dim is given)")
        eos = cfg.get("eos_token_id")
        eos_ids: list[int] = [_token_id("eos_token_id", e, ints["vocab_size"])
                              for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
        bos = cfg.get("bos_token_id")
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        if rope_theta is not None:  # checked even when rope_parameters overrides it
            _float_field("rope_theta", rope_theta, lambda v: v > 1, "> 1")
        rope_params = cfg.get("rope_parameters")  # transformers 5 layout
        if rope_params is not None:
            if not isinstance(rope_params, dict):
                raise ValueError(f"rope_parameters must be an object, got {rope_params!r}")
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        floats = {"rms_norm_eps": cfg.get("rms_norm_eps", 1e-5), "rope_theta": 10000.0 if rope_theta is None else rope_theta}
        _float_field("rms_norm_eps", floats["rms_norm_eps"], lambda v: 0 < v < 1, "in (0, 1)")
        _float_field("rope_parameters.rope_theta" if rope_params else "rope_theta", floats["rope_theta"],
                     lambda v: v > 1, "> 1")
        quant = cfg.get("quantization_config")
        if model_type in MOE_ARCHITECTURES and quant:  # e.g. DeepSeek-V3's FP8 blocks with weight_scale_inv
            method = quant.get("quant_method") if isinstance(quant, dict) else quant
            raise ValueError(f"quantization_config (quant_method {method!r}) is not supported for "
                             f"{model_type}: load a bf16/fp16/fp32 checkpoint")
        moe = parse_moe(cfg, model_type, ints["num_hidden_layers"]) if model_type in MOE_ARCHITECTURES else None
        mla = parse_mla(cfg, model_type) if model_type.startswith("deepseek") else None
        scaling = check_rope_scaling("rope_scaling", rope_scaling)
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "yarn" and mla is None:
            raise ValueError(f"rope_scaling.rope_type 'yarn' is supported for MLA models only (deepseek_v2, "
                             f"deepseek_v3), not model_type {model_type!r}")
        if mla is not None:  # the rotary tables cover the rope part of each head only
            ints["head_dim"] = mla.qk_rope_head_dim
            ints["num_key_value_heads"] = heads
        return cls(
            moe=moe, mla=mla,
            vocab_size=ints["vocab_size"],
            hidden_size=hidden,
            intermediate_size=ints["intermediate_size"],
            num_hidden_layers=ints["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=ints.get("num_key_value_heads", heads),
            head_dim=ints.get("head_dim", hidden // heads),
            rms_norm_eps=float(floats["rms_norm_eps"]),
            rope_theta=float(floats["rope_theta"]),
            rope_scaling=check_rope_scaling("rope_scaling", rope_scaling),
            max_position_embeddings=ints.get("max_position_embeddings", 4096),
            tie_word_embeddings=_bool_field("tie_word_embeddings", cfg.get("tie_word_embeddings", False)),
            attention_bias=(_bool_field("qkv_bias", cfg.get("qkv_bias", True)) if model_type == "qwen2_moe" else
                            mla is None and _bool_field("attention_bias",
                                                        cfg.get("attention_bias", model_type == "qwen2"))),
            bos_token_id=None if bos is None else _token_id("bos_token_id", bos, ints["vocab_size"]),
            eos_token_ids=eos_ids,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            architecture=model_type,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` transformers can build the same architecture from (used by tests)."""
        out: dict[str, Any] = {
            "architectures": [_HF_CLASSES.get(self.architecture, "LlamaForCausalLM")],
            "model_type": self.architecture if self.architecture in _HF_CLASSES else "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else self.eos_token_ids,
        }
        if self.rope_scaling:
            out["rope_scaling"] = dict(self.rope_scaling)
        return out


_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def check_tensor_shapes(cfg: ModelConfig, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """ValueError naming the field when the config disagrees with the tensors present.

    ``shapes``: Hugging Face parameter name -> shape (Hugging Face layout, [out, in]) of every
    tensor in the file(s); names the model does not use are ignored."""
    h, v, inter = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    expected_global = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,)}
    per_layer = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q), "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,), "self_attn.q_norm.weight": (cfg.head_dim,),
        "self_attn.k_norm.weight": (cfg.head_dim,), "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
    }
    if cfg.mla is not None:  # MLA projections: their shapes are checked as they load (load_weights)
        per_layer = {k: v for k, v in per_layer.items() if not k.startswith("self_attn.")}
    fields = "vocab_size, hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim"
    if "model.embed_tokens.weight" not in shapes:
        raise ValueError("the weights have no token embedding (model.embed_tokens.weight / token_embd.weight)")
    layers: set[int] = set()
    for name, shape in shapes.items():
        m = _LAYER_TENSOR.match(name)
        if m:
            layers.add(int(m.group(1)))
            want = per_layer.get(f"{m.group(2)}.{m.group(3)}")
        else:
            want = expected_global.get(name)
        if want is not None and tuple(shape) != want:
            raise ValueError(f"tensor {name} has shape {list(shape)} but the config ({fields}) implies {list(want)}")
    if cfg.architecture == "deepseek_v3":  # its multi-token-prediction layers follow the last one (unused)
        layers = {i for i in layers if i < cfg.num_hidden_layers}
    if layers != set(range(cfg.num_hidden_layers)):
        raise ValueError(f"num_hidden_layers={cfg.num_hidden_layers} but the weights hold layers "
                         f"{_ranges(sorted(layers))}")


def _ranges(xs: list[int]) -> str:
    if not xs:
        return "none"
    return f"0..{xs[-1]}" if xs == list(range(xs[-1] + 1)) else str(xs[:8])


def check_gguf_metadata(get: Callable[[str], Any], arch: str) -> None:
    """Check the raw GGUF metadata values a ModelConfig is built from (``get(key)``: the value
    or None when absent) before they are converted: ValueError naming the GGUF key."""
    experts = get(f"{arch}.expert_count")
    if experts is not None and experts != 0:
        e = _int_field(f"{arch}.expert_count", experts, 1 << 12)
        _int_field(f"{arch}.expert_used_count", get(f"{arch}.expert_used_count"), e)
        for suffix in ("expert_feed_forward_length", "expert_shared_feed_forward_length"):
            if get(f"{arch}.{suffix}") is not None:
                _int_field(f"{arch}.{suffix}", get(f"{arch}.{suffix}"), _INT_FIELDS["intermediate_size"])
    ints = {"embedding_length": "hidden_size", "attention.head_count": "num_attention_heads",
            "attention.head_count_kv": "num_key_value_heads", "attention.key_length": "head_dim",
            "vocab_size": "vocab_size", "feed_forward_length": "intermediate_size",
            "block_count": "num_hidden_layers", "context_length": "max_position_embeddings"}
    for suffix, fname in ints.items():
        key = f"{arch}.{suffix}"
        value = get(key)
        if value is None:
            if suffix in ("embedding_length", "attention.head_count", "feed_forward_length", "block_count"):
                raise ValueError(f"{key} is missing")
            continue
        if isinstance(value, list):
            raise ValueError(f"{key} has one value per layer ({value[:4]}...); only one value is supported")
        _int_field(key, value, _INT_FIELDS[fname])
    emb, heads = get(f"{arch}.embedding_length"), get(f"{arch}.attention.head_count")
    if get(f"{arch}.attention.key_length") is None and emb % heads:
        raise ValueError(f"{arch}.embedding_length={emb} is not a multiple of {arch}.attention.head_count={heads}")
    floats = {"attention.layer_norm_rms_epsilon": (lambda v: 0 < v < 1, "in (0, 1)"),
              "rope.freq_base": (lambda v: v > 1, "> 1"), "rope.scaling.factor": (lambda v: v > 0, "> 0")}
    for suffix, (ok, what) in floats.items():
        value = get(f"{arch}.{suffix}")
        if value is not None:
            _float_field(f"{arch}.{suffix}", value, ok, what)
    scaling = get(f"{arch}.rope.scaling.type")
    if scaling is not None and scaling not in ("none", "linear"):
        raise ValueError(f"{arch}.rope.scaling.type={scaling!r} is not supported (none, linear)")
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        value = get(key)
        if value is not None:
            _int_field(key, value, (1 << 31) - 1, lo=0)  # the vocabulary bound is checked once known
