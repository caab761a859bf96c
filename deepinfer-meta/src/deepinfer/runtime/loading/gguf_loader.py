"""Read a GGUF file of a Llama-family model: its config and its weights under Hugging Face names.

The file stays memory-mapped; tensors are read one at a time, either dequantized to float32 (with
``gguf_blocks``, bitwise what ``gguf.quants`` gives) or, for Q4_0/Q4_1/Q4_K/Q8_0, as int4 groups
for the quantized CPU layers. llama.cpp stores the Q and K projections of ``llama`` models
permuted for its interleaved rotary layout; we undo that exactly as transformers' GGUF loader
does, so both see the same weights.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from deepinfer.runtime.kernels import gguf_blocks
from deepinfer.runtime.loading.gguf_file import GGUFFile
from deepinfer.runtime.models.config import (
    ModelConfig,
    MoeSpec,
    check_gguf_metadata,
    check_tensor_shapes,
)

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    # mixture of experts: the router, the experts stacked [E, rows, cols] (models.moe's GGUF slots)
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# GGUF architectures with experts -> our architecture (llama.cpp writes Mixtral as "llama")
_MOE_ARCHS = {"llama": "mixtral", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freq_factors",
}
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen2moe", "qwen3moe")


class GGUFError(ValueError):
    """The file is not a readable GGUF of a supported Llama-family model."""


# Block types: (bytes per block, byte offsets of its fp16 scale fields). Finite scales make every
# dequantized value finite, so a quantized tensor is checked on its scales alone (a strided read
# of the raw blocks, no dequantization).
_F16_SCALES: dict[str, tuple[int, tuple[int, ...]]] = {
    "Q4_0": (18, (0,)), "Q4_1": (20, (0, 2)), "Q5_0": (22, (0,)), "Q5_1": (24, (0, 2)), "Q8_0": (34, (0,)),
    "Q8_1": (36, (0, 2)), "Q2_K": (84, (80, 82)), "Q3_K": (110, (108,)), "Q4_K": (144, (0, 2)),
    "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,)),
}
# dense types: (numpy dtype read as, exponent mask of a NaN/inf as uint16 or None for float32)
_F16_EXP, _BF16_EXP = 0x7C00, 0x7F80


def _nonfinite(t: Any) -> tuple[int, int] | None:
    """(count, first flat index of a bad value or block) of a GGUF tensor's non-finite values
    (dense types) or block scales (quantized types); None when all are finite."""
    kind = t.tensor_type.name
    raw = np.asarray(t.data)
    if kind == "F32":
        bad = ~np.isfinite(raw.view(np.float32))
    elif kind in ("F16", "BF16"):
        mask = _F16_EXP if kind == "F16" else _BF16_EXP
        bad = (raw.view(np.uint16) & mask) == mask
    elif kind in _F16_SCALES:
        block, offsets = _F16_SCALES[kind]
        fields = raw.view(np.uint16).reshape(-1, block // 2)
        bad = np.zeros(fields.shape[0], dtype=bool)
        for off in offsets:
            bad |= (fields[:, off // 2] & _F16_EXP) == _F16_EXP
    else:  # other types (IQ*, ...): dequantize and look (slower, rare)
        from gguf.quants import dequantize

        bad = ~np.isfinite(dequantize(raw, t.tensor_type))
    if not bad.any():
        return None
    bad = bad.reshape(-1)
    return int(bad.sum()), int(np.argmax(bad))


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Open ``path`` (memory-mapped), turning any parse failure into GGUFError."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model: GGUF file {path!r} does not exist")
    try:
        return GGUFFile(path)
    except Exception as exc:  # struct.error, ValueError, UnicodeError, ... from a damaged file
        raise GGUFError(f"model: {path!r} is not a valid GGUF file ({type(exc).__name__}: {exc})") from exc


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def gguf_config(reader: GGUFFile, path: str = "<gguf>") -> ModelConfig:
    """The ModelConfig described by a GGUF file's metadata, every field checked (also against
    the tensors' shapes): a bad one is a GGUFError naming the file and the key."""
    try:
        config = _gguf_config(reader, path)
        check_tensor_shapes(config, {name: tuple(int(d) for d in reversed(t.shape))
                                     for t in reader.tensors if (name := hf_name(t.name)) is not None})
    except GGUFError:
        raise
    except (ValueError, TypeError) as exc:
        raise GGUFError(f"model: GGUF {path!r}: {exc}") from None
    return config


def _gguf_config(reader: GGUFFile, path: str) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(
            f"model: GGUF {path!r} has general.architecture={arch!r}; supported: {list(SUPPORTED_ARCHS)}")
    check_gguf_metadata(lambda key: _field(reader, key), arch)
    emb = _field(reader, f"{arch}.embedding_length")
    heads = _field(reader, f"{arch}.attention.head_count")
    if emb is None or heads is None:
        raise GGUFError(f"model: GGUF {path!r} lacks {arch}.embedding_length/attention.head_count")
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv", heads)
    head_dim = _field(reader, f"{arch}.attention.key_length", emb // heads)
    tensor_names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise GGUFError(f"model: GGUF {path!r} has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
        vocab = len(tokens)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    moe = None
    architecture = arch
    if _field(reader, f"{arch}.expert_count"):
        moe = _gguf_moe(reader, arch, tensor_names)
        architecture = _MOE_ARCHS[arch]
    elif arch in ("qwen2moe", "qwen3moe"):
        raise GGUFError(f"model: GGUF {path!r} of architecture {arch!r} lacks {arch}.expert_count")
    rope_scaling = None
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))}
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=int(emb),
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
        num_attention_heads=int(heads),
        num_key_value_heads=int(kv_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[int(eos)] if eos is not None else [],
        architecture=architecture,
        qk_norm=arch == "qwen3moe",
        moe=moe,
    )


def _gguf_moe(reader: GGUFFile, arch: str, tensor_names: set[str]) -> MoeSpec:
    """The MoeSpec of a GGUF file with experts (metadata checked by check_gguf_metadata). Routed
    layers are those with a router (``ffn_gate_inp``); llama.cpp renormalises the top-k weights of
    Mixtral and Qwen3-MoE, not of Qwen2-MoE."""
    layers = int(_field(reader, f"{arch}.block_count"))
    size = _field(reader, f"{arch}.expert_feed_forward_length", _field(reader, f"{arch}.feed_forward_length"))
    shared = int(_field(reader, f"{arch}.expert_shared_feed_forward_length", 0)) if arch == "qwen2moe" else 0
    return MoeSpec(num_experts=int(_field(reader, f"{arch}.expert_count")),
                   top_k=int(_field(reader, f"{arch}.expert_used_count")),
                   expert_intermediate_size=int(size),
                   moe_layers=tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_names),
                   norm_topk_prob=arch != "qwen2moe", shared_intermediate_size=shared,
                   shared_expert_gate=shared > 0 and "blk.0.ffn_gate_inp_shexp.weight" in tensor_names)


def unpermute_index(rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's interleaving of each head's rotary halves (its convert
    script's permute), as transformers' GGUF loader does."""
    dim = rows // n_head // 2
    return torch.arange(rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(-1)


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor, or None for tensors we do not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


class GGUFModel:
    """A memory-mapped GGUF file: its config and its tensors under Hugging Face names, read one
    at a time either as dense float32 or, for int4-mappable types, as int4 groups."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.reader = open_gguf(self.path)
        self.config = gguf_config(self.reader, self.path)
        self.tensors: dict[str, Any] = {}
        for t in self.reader.tensors:
            name = hf_name(t.name)
            if name is not None:
                self.tensors[name] = t

    def check_values(self, names: Iterable[str] | None = None) -> None:
        """GGUFError naming the tensor when one of ``names`` (default: all the model uses) holds a
        NaN or infinite value -- for quantized types, a non-finite block scale. Vectorized over the
        memory-mapped data (the default model: tens of ms)."""
        for name in self.tensors if names is None else names:
            t = self.tensors[name]
            found = _nonfinite(t)
            if found is not None:
                count, first = found
                what = ("block scale(s)" if t.tensor_type.name in _F16_SCALES else "value(s)")
                raise GGUFError(f"model: GGUF {self.path!r} tensor {t.name!r} ({name}, {t.tensor_type.name}) holds "
                                f"{count} non-finite {what} (NaN or inf; the first at {'block' if what[0] == 'b' else 'index'} "
                                f"{first}): the weights are damaged")

    def rope_freq_factors(self) -> torch.Tensor | None:
        """The file's ``rope_freqs`` (per-frequency divisors of the rotary, Llama 3.1 style), checked:
        head_dim / 2 values, each finite and positive (zeros would make the rotary infinite); None
        when the file has none. A bad one is a GGUFError naming the tensor."""
        name = "rope_freq_factors"
        if name not in self.tensors:
            return None
        t = self.tensors[name]
        want = self.config.head_dim // 2
        shape = [int(d) for d in reversed(t.shape)]
        if shape != [want]:
            raise GGUFError(f"model: GGUF {self.path!r} tensor {t.name!r} has shape {shape}; the rotary needs "
                            f"[{want}] (head_dim / 2)")
        w = self.dense(name)
        bad = ~(torch.isfinite(w) & (w > 0))
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise GGUFError(f"model: GGUF {self.path!r} tensor {t.name!r} must hold finite positive frequency factors; "
                            f"{int(bad.sum())} of {want} are not (the first: index {i} = {float(w[i])})")
        return w

    def type_name(self, name: str) -> str:
        return str(self.tensors[name].tensor_type.name)

    def row_index(self, name: str, rows: int) -> torch.Tensor | None:
        """The row order that undoes llama.cpp's q/k permutation for tensor ``name``, or None."""
        if self.config.architecture not in ("llama", "mixtral"):  # llama.cpp's "llama" files
            return None
        if ".self_attn.q_proj." in name:
            return unpermute_index(rows, self.config.num_attention_heads)
        if ".self_attn.k_proj." in name:
            return unpermute_index(rows, self.config.num_key_value_heads)
        return None

    def load_error(self, name: str, exc: Exception) -> GGUFError:
        """The GGUFError to raise when tensor ``name`` cannot be read (``exc``: why)."""
        t = self.tensors[name]
        return GGUFError(f"model: GGUF {self.path!r} tensor {t.name!r} of type {t.tensor_type.name} "
                         f"cannot be read: {exc}")

    def dense(self, name: str) -> torch.Tensor:
        """Float32 weights of ``name`` in the Hugging Face layout (dequantized as read)."""
        t = self.tensors[name]
        expected = [int(d) for d in reversed(t.shape)]
        try:
            w = gguf_blocks.dequantize(t)
        except Exception as exc:
            raise self.load_error(name, exc) from exc
        if w.numel() != int(np.prod(expected)):
            raise GGUFError(f"model: GGUF {self.path!r} tensor {t.name!r} is truncated")
        index = self.row_index(name, w.shape[0])
        return w if index is None else w[index]

    def int4(self, name: str) -> list[gguf_blocks.Int4Groups] | None:
        """``name`` as int4 groups in the Hugging Face row order, or None if its type has no int4 form."""
        t = self.tensors[name]
        kind = t.tensor_type.name
        if kind not in gguf_blocks.INT4_TYPES + gguf_blocks.SPLIT_INT4_TYPES or len(t.shape) != 2:
            return None
        rows = int(t.shape[1])
        try:
            parts = gguf_blocks.int4_groups(gguf_blocks.raw_blocks(t.data, rows), kind)
        except Exception as exc:
            raise self.load_error(name, exc) from exc
        index = self.row_index(name, rows)
        return parts if index is None else [p.permute_rows(index) for p in parts]

    def q8_codes(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A Q8_0 tensor as int8 codes [rows, K] and float32 scales [rows, K / 32]; None for other types."""
        t = self.tensors[name]
        if t.tensor_type.name != "Q8_0" or len(t.shape) != 2:
            return None
        rows = int(t.shape[1])
        b = gguf_blocks.raw_blocks(t.data, rows).reshape(rows, -1, 34)
        codes = b[..., 2:].contiguous().view(torch.int8).reshape(rows, -1)
        scales = b[..., :2].contiguous().view(torch.float16).float().reshape(rows, -1)
        return codes, scales

    def dense_tensors(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 tensor) one at a time for ``names`` (default: all)."""
        for name in self.tensors if names is None else names:
            yield name, self.dense(name)


def load_gguf(path: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and all float32 weights (HF names, HF layouts) of a GGUF file, in memory at once.
    The runtime streams them instead (``GGUFModel``); this is for tools and tests."""
    model = GGUFModel(path)
    model.check_values()
    model.rope_freq_factors()
    return model.config, dict(model.dense_tensors())
