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
_ROPE_TYPES = ("linear", "llama3")


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
    keys = ["factor"] + (["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
                         if kind == "llama3" else [])
    for k in keys:
        if k not in sc:
            raise ValueError(f"{name} of type {kind!r} lacks {k!r}")
        _float_field(f"{name}.{k}", sc[k], lambda v: v > 0, "> 0")
    if kind == "llama3" and not float(sc["high_freq_factor"]) > float(sc["low_freq_factor"]):
        raise ValueError(f"{name}: high_freq_factor must be > low_freq_factor, got {dict(sc)!r}")
    return dict(sc)

_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
_HF_CLASSES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


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
        return cls(
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
            attention_bias=_bool_field("attention_bias", cfg.get("attention_bias", model_type == "qwen2")),
            bos_token_id=None if bos is None else _token_id("bos_token_id", bos, ints["vocab_size"]),
            eos_token_ids=eos_ids,
            qk_norm=model_type == "qwen3",
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
