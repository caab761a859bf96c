"""Read a GGUF file of a Llama-family model: its config and its weights under Hugging Face names.

Quantized tensors (Q4_0/Q4_1/Q8_0/K-quants/F16/...) are dequantized with ``gguf.quants``. llama.cpp
stores the Q and K projections of ``llama`` models permuted for its interleaved rotary layout; we
undo that exactly as transformers' GGUF loader does, so both see the same weights.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from deepinfer.runtime.model_config import ModelConfig, check_gguf_metadata, check_tensor_shapes

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
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freq_factors",
}
SUPPORTED_ARCHS = ("llama", "qwen2")


class GGUFError(ValueError):
    """The file is not a readable GGUF of a supported Llama-family model."""


def open_gguf(path: str | os.PathLike[str]) -> Any:
    """Open ``path`` with ``gguf.GGUFReader`` (memory-mapped), turning any parse failure into GGUFError."""
    import gguf

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model: GGUF file {path!r} does not exist")
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises a mix of ValueError/struct.error/IndexError
        raise GGUFError(f"model: {path!r} is not a valid GGUF file ({type(exc).__name__}: {exc})") from exc


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_config(reader: Any, path: str = "<gguf>") -> ModelConfig:
    """The ModelConfig described by a GGUF file's metadata, every field checked (also against
    the tensors' shapes): a bad one is a GGUFError naming the file and the key."""
    try:
        config = _gguf_config(reader, path)
        check_tensor_shapes(config, {name: tuple(int(d) for d in reversed(t.shape.tolist()))
                                     for t in reader.tensors if (name := hf_name(t.name)) is not None})
    except GGUFError:
        raise
    except (ValueError, TypeError) as exc:
        raise GGUFError(f"model: GGUF {path!r}: {exc}") from None
    return config


def _gguf_config(reader: Any, path: str) -> ModelConfig:
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
        vocab = len(tokens.data)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
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
        architecture=arch,
    )


def _reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's convert script interleaves each head's rotary halves; this undoes it.
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor, or None for tensors we do not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def load_gguf(path: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read config and float32 weights (HF names, HF layouts) from a GGUF file."""
    from gguf.quants import dequantize

    path = os.fspath(path)
    reader = open_gguf(path)
    config = gguf_config(reader, path)
    weights: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        try:
            arr = dequantize(t.data, t.tensor_type)
        except Exception as exc:
            raise GGUFError(
                f"model: GGUF {path!r} tensor {t.name!r} of type {t.tensor_type.name} cannot be read: {exc}"
            ) from exc
        arr = np.array(arr, dtype=np.float32)  # writable copy (F32 tensors are read-only mmap views)
        expected = tuple(int(d) for d in reversed(t.shape.tolist()))
        if arr.size != int(np.prod(expected)):
            raise GGUFError(f"model: GGUF {path!r} tensor {t.name!r} is truncated")
        arr = arr.reshape(expected) if len(expected) > 1 else arr.reshape(-1)
        if config.architecture == "llama" and ".attn_q." in t.name:
            arr = _reverse_permute(arr, config.num_attention_heads)
        elif config.architecture == "llama" and ".attn_k." in t.name:
            arr = _reverse_permute(arr, config.num_key_value_heads)
        weights[name] = arr
    return config, weights
