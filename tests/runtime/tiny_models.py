"""Test helper: tiny random Hugging Face models (Llama, Qwen2 with qkv bias, Qwen3 with q/k norm) saved as
directories."""

from __future__ import annotations

import torch


def save_tiny_model(path, arch: str = "llama", seed: int = 0, vocab: int = 320):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    if arch == "qwen3":  # head_dim 24 != hidden / heads, as in the real Qwen3 shapes
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=24, rope_theta=1000000.0, tie_word_embeddings=True))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=10000.0, tie_word_embeddings=True))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=50000.0, tie_word_embeddings=False))
    with torch.no_grad():  # larger than init scale so greedy tokens are not all alike
        for name, p in model.named_parameters():
            if p.dim() == 2 or name.endswith(".bias"):
                p.normal_(0, 0.2)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):  # not all ones: the norms' weights count
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model.eval()


def save_tiny_tokenizer(path, vocab: int = 320):
    """A word-level tokenizer over ``vocab`` tokens "t0".."tN" saved beside a tiny model, so an
    ``LLM`` can load the directory (tests pass token ids; text is "t5 t17 ...")."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1",
                            eos_token="t2").save_pretrained(path)
