"""The draft model of speculative decoding (method "draft_model"), loaded and checked against
the target: it must share the target's tokenizer, which vLLM checks as the same vocabulary size."""

from __future__ import annotations

import os
from typing import Any

import torch


def check_draft_config(draft: Any, target: Any, path: str) -> None:
    """ValueError unless the draft model at ``path`` can draft for the target (vLLM's rule: the
    same vocabulary size; the tokenizer itself is the caller's promise)."""
    if int(draft.vocab_size) != int(target.vocab_size):
        raise ValueError(f"speculative_config['model'] ({path!r}): the draft model's vocab_size {draft.vocab_size} "
                         f"differs from the target model's {target.vocab_size}; a draft model must share the "
                         "target's tokenizer")


def load_draft_model(path: str, target_config: Any, *, device: torch.device, dtype: torch.dtype,
                     dummy_weights: bool, max_positions: int, seed: int, keep_quantized: bool = False) -> Any:
    """The draft model at ``path`` (a GGUF file or a model folder), checked against the target;
    ``keep_quantized``: as for the target (CPU, GGUF, no dtype asked: quantized projections kept)."""
    from deepinfer.runtime.loading.model_loader import load_model, read_config

    if not (os.path.isfile(path) or os.path.isdir(path)):
        raise ValueError(f"speculative_config['model'] ({path!r}) is neither a GGUF file nor a model directory")
    check_draft_config(read_config(path), target_config, path)
    return load_model(path, device=device, dtype=dtype, dummy_weights=dummy_weights, max_positions=max_positions,
                      seed=seed + 1, keep_quantized=keep_quantized)
