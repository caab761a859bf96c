"""Valid GGUF files of any vocabulary load on the default CPU path, and damaged values are refused
at load (issue 29, items 6 and 7).

- A Q8_0 / Q4_0 / Q4_1 file with 32,002 tokens (Llama-2/Mistral fine-tunes with added tokens; the
  int4 kernel's packing needs rows in multiples of 16) loads by default: the int4 layers pad their
  rows and slice the output, and generate the same greedy tokens as ``dtype="float32"``.
- One NaN or inf in any tensor (a dense value, or a block scale of a quantized one), or a
  ``rope_freqs`` of the wrong length, zero or negative, is a ``GGUFError`` naming the tensor,
  raised by ``load_model`` before anything runs; a safetensors directory's NaN likewise.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from deepinfer.runtime.loading.gguf_loader import GGUFError, GGUFModel
from deepinfer.runtime.loading.model_loader import load_model
from deepinfer.runtime.worker.model_runner import ModelRunner

gguf = pytest.importorskip("gguf")
CPU = torch.device("cpu")
V, H, HEADS, KV, HD, FF, L = 32002, 64, 4, 2, 16, 96, 2


def _tensors(seed=0):
    rng = np.random.default_rng(seed)
    t = {"token_embd.weight": (V, H), "output_norm.weight": (H,), "output.weight": (V, H)}
    for i in range(L):
        t.update({f"blk.{i}.attn_norm.weight": (H,), f"blk.{i}.ffn_norm.weight": (H,),
                  f"blk.{i}.attn_q.weight": (HEADS * HD, H), f"blk.{i}.attn_k.weight": (KV * HD, H),
                  f"blk.{i}.attn_v.weight": (KV * HD, H), f"blk.{i}.attn_output.weight": (H, HEADS * HD),
                  f"blk.{i}.ffn_gate.weight": (FF, H), f"blk.{i}.ffn_up.weight": (FF, H),
                  f"blk.{i}.ffn_down.weight": (H, FF)})
    out = {k: rng.normal(0, 0.2, s).astype(np.float32) for k, s in t.items()}
    for k in out:
        if k.endswith("norm.weight"):
            out[k] = 1.0 + 0.1 * out[k]
    return out


def write_gguf(path, qtype="Q8_0", tensors=None, rope_freqs=None, patch=None):
    """A tiny llama GGUF with 32,002 tokens: projections, embedding and head in ``qtype`` (None:
    float32), norms float32. ``patch(name, raw)`` may damage a tensor's stored array."""
    tensors = _tensors() if tensors is None else tensors
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"llama.embedding_length": H, "llama.attention.head_count": HEADS,
                       "llama.attention.head_count_kv": KV, "llama.feed_forward_length": FF,
                       "llama.block_count": L, "llama.context_length": 256, "llama.vocab_size": V}.items():
        w.add_uint32(key, value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)
    if rope_freqs is not None:
        tensors = {**tensors, "rope_freqs.weight": np.asarray(rope_freqs, dtype=np.float32)}
    for name, arr in tensors.items():
        if qtype is not None and arr.ndim == 2:
            kind = getattr(gguf.GGMLQuantizationType, qtype)
            raw = gguf.quants.quantize(arr, kind)
            if patch:
                raw = patch(name, raw)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)
        else:
            w.add_tensor(name, patch(name, arr.copy()) if patch else arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _greedy(path, steps=6, **kw):
    loaded = load_model(path, device=CPU, max_positions=64, **kw)
    runner = ModelRunner(loaded, num_blocks=16, block_size=4, device=CPU, dtype=torch.float32)
    seq = [5, 31999, 32001, 17, 2]
    table = np.arange(16, dtype=np.int32)[None]
    first = None
    for _ in range(steps):
        pos = np.arange(len(seq))
        logits = runner.execute(input_ids=np.array(seq), positions=pos, slot_mapping=pos,
                                query_start_loc=np.array([0, len(seq)]), seq_lens=np.array([len(seq)]),
                                block_tables=table, logits_indices=np.array([len(seq) - 1]))
        assert logits.shape == (1, V) and bool(torch.isfinite(logits).all())
        first = logits[0] if first is None else first
        seq.append(int(logits[0].argmax()))
    return first, loaded


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_a_vocabulary_of_32002_loads_on_the_int4_path(tmp_path, qtype, caplog):
    from deepinfer.runtime.models.quantized import Int4Linear

    path = write_gguf(tmp_path / "v32002.gguf", qtype)
    with caplog.at_level(logging.INFO, logger="deepinfer.runtime.loading.model_loader"):
        quantized, loaded = _greedy(path, dtype=torch.float32, keep_quantized=True)  # prompt: torch int4 path
    head = loaded.model.quantized_head
    assert isinstance(head, Int4Linear) and head.out_features == V and head.padded_rows == 32064
    assert "padded with zero rows" in caplog.text and "32002 -> 32064" in caplog.text
    dense, _ = _greedy(path, dtype=torch.float32)
    # bfloat16 activations on the int4 path: the prompt's logits agree with the dense ones to a few %
    assert float((quantized - dense).abs().max()) <= 0.03 * float(dense.abs().max())


def test_int4_linear_of_any_row_count_equals_the_dense_product():
    from deepinfer.runtime.kernels.gguf_blocks import Int4Groups
    from deepinfer.runtime.models.quantized import Int4Linear

    gen = torch.Generator().manual_seed(0)
    for n in (1, 15, 50, 80, 130):
        for parts in (1, 2):
            gs = [Int4Groups(torch.randint(0, 16, (n, 64), dtype=torch.uint8, generator=gen),
                             torch.rand(n, 2, generator=gen), torch.rand(n, 2, generator=gen)) for _ in range(parts)]
            layer = Int4Linear(gs)
            w = sum((g.q.float() - 8) * g.scale.bfloat16().float().repeat_interleave(32, 1)
                    + g.zero.bfloat16().float().repeat_interleave(32, 1) for g in gs)
            for rows in (3, 130):  # the int4 kernel and the long-prefill bfloat16 GEMM
                x = torch.randn(rows, 64, generator=gen)
                y = layer(x)
                ref = x.bfloat16().float() @ w.t()
                assert y.shape == (rows, n)
                assert float((y - ref).abs().max()) <= 2 ** -6 * float((x.abs() @ w.abs().t()).max())


def _set_nan_scale(target, value=np.nan):
    def patch(name, raw):
        if name == target:
            raw = raw.copy()
            raw.view(np.uint8).reshape(raw.shape[0], -1)[3, 0:2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
        return raw
    return patch


def _set_value(target, value=np.nan):
    def patch(name, arr):
        if name == target:
            arr.reshape(-1)[7] = value
        return arr
    return patch


@pytest.mark.parametrize("qtype,target,patch", [
    ("Q8_0", "blk.1.attn_k.weight", _set_nan_scale("blk.1.attn_k.weight")),
    ("Q4_1", "blk.0.ffn_down.weight", _set_nan_scale("blk.0.ffn_down.weight", np.inf)),
    ("Q4_0", "token_embd.weight", _set_nan_scale("token_embd.weight")),
    ("Q8_0", "blk.0.attn_norm.weight", _set_value("blk.0.attn_norm.weight")),
    (None, "blk.1.attn_q.weight", _set_value("blk.1.attn_q.weight", -np.inf)),
    (None, "output.weight", _set_value("output.weight")),
])
def test_a_non_finite_weight_is_a_gguf_error_naming_the_tensor(tmp_path, qtype, target, patch):
    path = write_gguf(tmp_path / "bad.gguf", qtype, patch=patch)
    for kw in ({"keep_quantized": True}, {}):
        with pytest.raises(GGUFError, match=rf"tensor '{target}'.*non-finite"):
            load_model(path, device=CPU, dtype=torch.float32, **kw)


@pytest.mark.parametrize("freqs,match", [
    (np.zeros(HD // 2), "finite positive"),
    (np.r_[np.ones(HD // 2 - 1), np.nan], "finite positive"),
    (-np.ones(HD // 2), "finite positive"),
    (np.ones(HD // 2 + 1), r"shape \[9\].*\[8\]"),
    (np.ones(HD), r"shape \[16\].*\[8\]"),
])
def test_a_bad_rope_freqs_is_a_gguf_error(tmp_path, freqs, match):
    path = write_gguf(tmp_path / "rope.gguf", "Q8_0", rope_freqs=freqs)
    with pytest.raises(GGUFError, match=rf"'rope_freqs.weight'.*{match}"):
        load_model(path, device=CPU, dtype=torch.float32, keep_quantized=True)


def test_good_rope_freqs_load(tmp_path):
    path = write_gguf(tmp_path / "rope.gguf", "Q8_0", rope_freqs=np.linspace(1.0, 8.0, HD // 2))
    assert GGUFModel(path).rope_freq_factors() is not None
    _greedy(path, steps=1, dtype=torch.float32, keep_quantized=True)


def test_a_nan_in_a_safetensors_directory_is_refused(tmp_path):
    pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file
    from tiny_models import save_tiny_model

    save_tiny_model(tmp_path)
    files = sorted(tmp_path.glob("*.safetensors"))
    weights = load_file(str(files[0]))
    name = next(n for n in weights if "v_proj" in n)
    weights[name][0, 3] = float("nan")
    save_file(weights, str(files[0]))
    with pytest.raises(ValueError, match=rf"tensor '{name}'.*non-finite"):
        load_model(str(tmp_path), device=CPU, dtype=torch.float32)


def test_the_default_model_loads_with_the_value_checks():
    from deepinfer.runtime.loading.default_model import default_model_path

    GGUFModel(default_model_path()).check_values()
