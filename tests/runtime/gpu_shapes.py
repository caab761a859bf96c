"""Test/bench helper: a model folder of a given shape (config.json + a word-level tokenizer over
the whole vocabulary), for random-weight runs that need no downloaded files."""

from __future__ import annotations

import json
import os
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    # SmolLM2-135M
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True),
    # Llama-3-8B
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                      max_position_embeddings=8192, tie_word_embeddings=False),
    # Llama-3.2-1B and -3B (tied heads; their llama3 rope scaling is left out: random weights)
    "llama3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                        max_position_embeddings=8192, tie_word_embeddings=True),
    "llama3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                        max_position_embeddings=8192, tie_word_embeddings=True),
    # Qwen3-0.6B (q/k norm, head_dim 128 != hidden / heads)
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1000000.0,
                       max_position_embeddings=40960, tie_word_embeddings=True, rms_norm_eps=1e-6,
                       model_type="qwen3", architectures=["Qwen3ForCausalLM"]),
    # small enough for float32 parity tests in seconds, with GQA groups of 4 and head_dim 64
    "test-small": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=1, vocab_size=1024, rope_theta=10000.0,
                       max_position_embeddings=1024, tie_word_embeddings=False),
    # the same with Qwen3's q/k norm and a head_dim that is not hidden / heads
    "test-small-qwen3": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=32, vocab_size=1024, rope_theta=1000000.0,
                             max_position_embeddings=1024, tie_word_embeddings=True, rms_norm_eps=1e-6,
                             model_type="qwen3", architectures=["Qwen3ForCausalLM"]),
    # the same with 2 KV heads: splits 2 ways (tensor-parallel smoke runs)
    "test-small-kv2": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=1024, rope_theta=10000.0,
                           max_position_embeddings=1024, tie_word_embeddings=False),
    # Qwen3-30B-A3B: 128 experts of 768, top-8, q/k norm (about 3.3 B active parameters a token)
    "qwen3-30b-a3b": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=40960,
                          tie_word_embeddings=False, rms_norm_eps=1e-6, model_type="qwen3_moe",
                          architectures=["Qwen3MoeForCausalLM"]),
    # Mixtral-8x7B: 8 experts of 14336, top-2 (46.7 B parameters: 93 GB in bf16, fits one H200)
    "mixtral-8x7b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                         rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=False,
                         model_type="mixtral", architectures=["MixtralForCausalLM"]),
    # DeepSeek-V2-Lite: MLA (kv_lora_rank 512 + rope 64), 64 routed experts top-6 + 2 shared, layer 0 dense,
    # YaRN rope scaling as in its config.json
    "deepseek-v2-lite": dict(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                             num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
                             n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
                             kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
                             v_head_dim=128, topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0,
                             norm_topk_prob=False, vocab_size=102400, rope_theta=10000.0, max_position_embeddings=163840,
                             tie_word_embeddings=False, rms_norm_eps=1e-6, model_type="deepseek_v2",
                             rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                           "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
                             architectures=["DeepseekV2ForCausalLM"]),
    # small mixture-of-experts / MLA shapes for CPU smoke runs of the whole LLM path
    "test-small-moe": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=16,
                           num_experts_per_tok=4, norm_topk_prob=True, vocab_size=1024, rope_theta=1000000.0,
                           max_position_embeddings=1024, tie_word_embeddings=False, rms_norm_eps=1e-6,
                           model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"]),
    "test-small-mla": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                           num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=None,
                           qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, topk_method="greedy",
                           vocab_size=1024, rope_theta=10000.0, max_position_embeddings=1024,
                           tie_word_embeddings=False, rms_norm_eps=1e-6, model_type="deepseek_v2",
                           architectures=["DeepseekV2ForCausalLM"]),
}


def write_shape_dir(path: str, shape: str) -> str:
    """Write ``config.json`` and a tokenizer for ``shape`` into ``path``; returns ``path``."""

    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5, bos_token_id=1,
               eos_token_id=2, hidden_act="silu", torch_dtype="bfloat16")
    cfg.update(SHAPES[shape])
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    write_tokenizer(path, cfg["vocab_size"])
    return path


def write_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer over ``vocab_size`` tokens ("t0".."tN"), saved into ``path``."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(path)
