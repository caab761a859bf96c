"""Test helper: tiny random mixture-of-experts / MLA Hugging Face models saved as directories
(Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2, DeepSeek-V3), float32."""

from __future__ import annotations

import torch

COMMON = dict(vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)


def tiny_config(arch: str, **over):
    """A transformers config of ``arch`` with tiny shapes (``over`` replaces fields)."""
    import transformers as tf

    if arch == "mixtral":
        cfg = tf.MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
                               rope_theta=10000.0)
    elif arch == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32, head_dim=24,
                                num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1,
                                mlp_only_layers=[1], rope_theta=1000000.0)
    elif arch == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32, num_experts=12,
                                num_experts_per_tok=3, norm_topk_prob=False, shared_expert_intermediate_size=80,
                                decoder_sparse_step=1, mlp_only_layers=[], rope_theta=10000.0)
    elif arch in ("deepseek_v2", "deepseek_v3"):
        mla = dict(COMMON, num_key_value_heads=4)
        cls = tf.DeepseekV2Config if arch == "deepseek_v2" else tf.DeepseekV3Config
        extra = (dict(topk_method="group_limited_greedy") if arch == "deepseek_v2"
                 else dict(rope_interleave=True))
        cfg = cls(**mla, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=16,
                  num_experts_per_tok=4, n_shared_experts=2, n_group=4, topk_group=2, first_k_dense_replace=1,
                  kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                  routed_scaling_factor=1.5, norm_topk_prob=arch == "deepseek_v3", rope_theta=10000.0, **extra)
    else:
        raise ValueError(arch)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def save_tiny_moe(path, arch: str, seed: int = 0, std: float = 0.2, **over):
    """Random weights (larger than init scale so greedy tokens differ), saved to ``path``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **over), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, std)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.1, 0.1)
    model.save_pretrained(path)
    return model.eval()
