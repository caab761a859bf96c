"""With DEEPINFER_CPU_NATIVE_PROMPTS=1, short prompt and mixed steps of an int4 GGUF model run on
the native kernels on CPUs below AVX-512 (``worker.native_decode.native_prompt_rows``): the runner
routes them there, bitwise the native step's logits, and keeps torch for long prompts, AVX-512
CPUs, float weights and the switch unset (the default) or off."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer.runtime.loading.model_loader import load_model
from deepinfer.runtime.models import quantized
from deepinfer.runtime.worker import native_decode
from deepinfer.runtime.worker.model_runner import ModelRunner


def _runner(path, keep_quantized=True):
    loaded = load_model(path, device=torch.device("cpu"), dtype=torch.float32, keep_quantized=keep_quantized,
                        max_positions=512)
    return ModelRunner(loaded, num_blocks=24, block_size=16, device=torch.device("cpu"), dtype=torch.float32)


def _prompt_step(n, seed=0):
    ids = np.random.default_rng(seed).integers(100, 1000, n)
    pos = np.arange(n)
    table = np.arange(1, 1 + -(-n // 16))[None, :]
    return dict(input_ids=ids, positions=pos, slot_mapping=table[0][pos // 16] * 16 + pos % 16,
                query_start_loc=np.array([0, n]), seq_lens=np.array([n]), block_tables=table,
                logits_indices=np.array([n - 1]))


@pytest.fixture
def below_avx512(monkeypatch):
    monkeypatch.setattr(quantized, "dense_from_rows", lambda: None)


def test_short_prompts_run_natively_and_long_ones_on_torch(default_gguf, below_avx512, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CPU_NATIVE_PROMPTS", "1")
    r = _runner(default_gguf)
    assert r.native_prompt_rows == native_decode.NATIVE_PROMPT_ROWS
    short = _prompt_step(40)
    got = r.execute(**short)
    assert torch.equal(got, r.native_decode.step(**{k: v for k, v in short.items()}))
    calls = []
    monkeypatch.setattr(r.native_decode, "step", lambda *a, **k: calls.append(1))
    r.execute(**_prompt_step(native_decode.NATIVE_PROMPT_ROWS + 1, seed=1))  # past the limit: torch
    assert calls == []
    r.execute(**_prompt_step(native_decode.NATIVE_PROMPT_ROWS, seed=2))
    assert calls == [1]


@pytest.mark.parametrize("why", ["switch unset (the default)", "switch off", "avx512", "float weights"])
def test_torch_keeps_prompts_otherwise(default_gguf, monkeypatch, why):
    monkeypatch.setattr(quantized, "dense_from_rows", lambda: 128 if why == "avx512" else None)
    monkeypatch.delenv("DEEPINFER_CPU_NATIVE_PROMPTS", raising=False)
    if why != "switch unset (the default)":
        monkeypatch.setenv("DEEPINFER_CPU_NATIVE_PROMPTS", "0" if why == "switch off" else "1")
    r = _runner(default_gguf, keep_quantized=why != "float weights")
    assert r.native_prompt_rows == 0
