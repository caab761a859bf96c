"""Corrupt and inconsistent model configurations (a tiny GGUF file and a tiny Hugging Face
directory, one field mutated per case: wrong type, zero, negative, NaN, huge, inconsistent with
the tensors): every case is a ValueError naming the file and the field, raised while the config
is read — before any weight is read or any buffer sized from the config is allocated."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from deepinfer.runtime.loading.model_loader import read_config

gguf = pytest.importorskip("gguf")

# tiny llama: vocab 96, hidden 32, 4 heads of 8, 2 KV heads, ffn 48, 2 layers
V, H, HEADS, KV, HD, FF, L = 96, 32, 4, 2, 8, 48, 2
GOOD = {
    "llama.embedding_length": ("uint32", H), "llama.attention.head_count": ("uint32", HEADS),
    "llama.attention.head_count_kv": ("uint32", KV), "llama.feed_forward_length": ("uint32", FF),
    "llama.block_count": ("uint32", L), "llama.context_length": ("uint32", 256),
    "llama.vocab_size": ("uint32", V), "llama.attention.layer_norm_rms_epsilon": ("float32", 1e-5),
    "llama.rope.freq_base": ("float32", 10000.0), "tokenizer.ggml.eos_token_id": ("uint32", 2),
    "tokenizer.ggml.bos_token_id": ("uint32", 1),
}


def _tensors(layers=L):
    rng = np.random.default_rng(0)
    t = {"token_embd.weight": (V, H), "output_norm.weight": (H,), "output.weight": (V, H)}
    for i in range(layers):
        t.update({f"blk.{i}.attn_norm.weight": (H,), f"blk.{i}.ffn_norm.weight": (H,),
                  f"blk.{i}.attn_q.weight": (HEADS * HD, H), f"blk.{i}.attn_k.weight": (KV * HD, H),
                  f"blk.{i}.attn_v.weight": (KV * HD, H), f"blk.{i}.attn_output.weight": (H, HEADS * HD),
                  f"blk.{i}.ffn_gate.weight": (FF, H), f"blk.{i}.ffn_up.weight": (FF, H),
                  f"blk.{i}.ffn_down.weight": (H, FF)})
    return {k: rng.normal(0, 0.1, s).astype(np.float32) for k, s in t.items()}


def _write_gguf(path, meta, tensors):
    w = gguf.GGUFWriter(str(path), "llama")
    for key, (kind, value) in meta.items():
        getattr(w, f"add_{kind}")(key, value)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


INT_KEYS = [k for k, (kind, _) in GOOD.items() if kind == "uint32"]
FLOAT_KEYS = ["llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base"]
GGUF_CASES = (
    [(k, ("string", "abc")) for k in INT_KEYS + FLOAT_KEYS]
    + [(k, ("uint32", 0)) for k in INT_KEYS if "token_id" not in k]
    + [(k, ("int32", -5)) for k in INT_KEYS]
    + [(k, ("uint32", 2**32 - 1)) for k in INT_KEYS]
    + [(k, ("uint64", 2**40)) for k in INT_KEYS]
    + [(k, ("float32", v)) for k in FLOAT_KEYS for v in (0.0, -1.0, math.nan, math.inf)]
    + [("llama.attention.layer_norm_rms_epsilon", ("float32", 1e30)),
       ("llama.rope.scaling.type", ("string", "yarn")), ("llama.rope.scaling.factor", ("float32", math.nan)),
       ("llama.attention.head_count", ("int32", 3))]
    # inconsistent with the tensors or the other fields
    + [("llama.block_count", ("uint32", L - 1)), ("llama.block_count", ("uint32", L + 1)),
       ("llama.vocab_size", ("uint32", V + 1)), ("llama.embedding_length", ("uint32", 2 * H)),
       ("llama.attention.head_count", ("uint32", 2 * HEADS)), ("llama.attention.head_count_kv", ("uint32", 1)),
       ("llama.feed_forward_length", ("uint32", FF + 1)), ("tokenizer.ggml.eos_token_id", ("uint32", V)),
       ("tokenizer.ggml.eos_token_id", ("uint32", 10**9)), ("llama.attention.key_length", ("uint32", 2 * HD))]
)


def test_the_unmutated_tiny_gguf_is_accepted(tmp_path):
    cfg = read_config(_write_gguf(tmp_path / "ok.gguf", GOOD, _tensors()))
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim) == (V, H, L, HD)


@pytest.mark.parametrize(("key", "value"), GGUF_CASES, ids=[f"{k}={v[1]!r}" for k, v in GGUF_CASES])
def test_a_corrupt_gguf_field_is_a_value_error_naming_file_and_field(tmp_path, key, value):
    from deepinfer.runtime.loading.gguf_loader import load_gguf

    path = _write_gguf(tmp_path / "bad.gguf", {**GOOD, key: value}, _tensors())
    for load in (read_config, load_gguf):
        with pytest.raises(ValueError) as err:
            load(path)
        msg = str(err.value)
        assert path in msg and (key in msg or _names_field(msg, key)), msg


def _names_field(msg, key):
    # a cross-field or tensor check names the config field that the GGUF key feeds
    feeds = {"block_count": "num_hidden_layers", "vocab_size": "vocab_size", "embedding_length": "hidden_size",
             "head_count": "num_attention_heads", "head_count_kv": "num_key_value_heads",
             "feed_forward_length": "intermediate_size", "eos_token_id": "eos_token_id", "key_length": "head_dim"}
    return feeds.get(key.split(".")[-1], "\0") in msg


# ---- Hugging Face directories ---------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from tiny_models import save_tiny_model

    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_model(path)
    return path


HF_INT = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "max_position_embeddings", "head_dim"]
HF_CASES = (
    [(k, v) for k in HF_INT for v in ("abc", 0, -5, 2**40, 1.5, True, None if k == "vocab_size" else [])]
    + [(k, v) for k in ("rms_norm_eps", "rope_theta") for v in ("abc", 0, -1.0, math.nan, math.inf, [1])]
    + [("rope_scaling", "linear"), ("rope_scaling", {"rope_type": "linear"}),
       ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}), ("rope_scaling", {"rope_type": "linear", "factor": -1}),
       ("tie_word_embeddings", "no"), ("bos_token_id", -1), ("eos_token_id", 10**9), ("eos_token_id", "x"),
       ("eos_token_id", [2, "x"]), ("rope_parameters", "x"), ("attention_bias", 1)]
    # inconsistent with the tensors or the other fields
    + [("num_hidden_layers", 1), ("num_hidden_layers", 3), ("vocab_size", 321), ("hidden_size", 128),
       ("num_key_value_heads", 1), ("num_key_value_heads", 3), ("intermediate_size", 97), ("head_dim", 32)]
)


def _write_hf(src, dst, mutate):
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f != "config.json":
            os.symlink(os.path.join(src, f), os.path.join(dst, f))
    with open(os.path.join(src, "config.json")) as fh:
        cfg = json.load(fh)
    cfg = mutate(cfg)
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return os.path.join(dst, "config.json")


def test_the_unmutated_tiny_directory_is_accepted(hf_dir):
    assert read_config(str(hf_dir)).num_hidden_layers == 2


@pytest.mark.parametrize(("key", "value"), HF_CASES, ids=[f"{k}={v!r}" for k, v in HF_CASES])
def test_a_corrupt_config_json_field_is_a_value_error_naming_file_and_field(hf_dir, tmp_path, key, value):
    cfg_path = _write_hf(hf_dir, tmp_path / "m", lambda c: {**c, key: value})
    with pytest.raises(ValueError) as err:
        read_config(str(tmp_path / "m"))
    msg = str(err.value)
    assert cfg_path in msg and key in msg, msg


@pytest.mark.parametrize("config", [[], "x", 5, None])
def test_a_config_json_that_is_not_an_object_is_named(hf_dir, tmp_path, config):
    cfg_path = _write_hf(hf_dir, tmp_path / "m", lambda c: config)
    with pytest.raises(ValueError, match="JSON object") as err:
        read_config(str(tmp_path / "m"))
    assert cfg_path in str(err.value)
