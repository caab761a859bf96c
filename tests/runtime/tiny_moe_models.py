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


GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}


def _permute(w, heads):
    """llama.cpp's convert script's q/k permutation of ``llama`` files (the loader undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def save_tiny_moe_gguf(path, hf, arch: str, qtype: str | None = None):
    """``hf`` (a tiny transformers MoE model) written as a GGUF file in llama.cpp's layout: experts
    stacked per layer (``ffn_{gate,up,down}_exps``), the router ``ffn_gate_inp``, Qwen2-MoE's shared
    expert ``*_shexp`` with its gate a vector, q/k permuted for Mixtral (``llama``). 2-D and 3-D
    projections in ``qtype`` (None: float32)."""
    import gguf
    import numpy as np

    g = GGUF_ARCH[arch]
    c = hf.config
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    w = gguf.GGUFWriter(str(path), g)
    ints = {"embedding_length": c.hidden_size, "attention.head_count": c.num_attention_heads,
            "attention.head_count_kv": c.num_key_value_heads, "block_count": c.num_hidden_layers,
            "context_length": c.max_position_embeddings, "vocab_size": c.vocab_size,
            "feed_forward_length": c.intermediate_size, "attention.key_length": getattr(c, "head_dim", None) or
            c.hidden_size // c.num_attention_heads, "expert_count": getattr(c, "num_local_experts", None) or
            c.num_experts, "expert_used_count": c.num_experts_per_tok}
    if arch != "mixtral":
        ints["expert_feed_forward_length"] = c.moe_intermediate_size
    if arch == "qwen2_moe":
        ints["expert_shared_feed_forward_length"] = c.shared_expert_intermediate_size
    for k, v in ints.items():
        w.add_uint32(f"{g}.{k}", int(v))
    w.add_float32(f"{g}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_float32(f"{g}.rope.freq_base", float(c.rope_parameters["rope_theta"]))
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
               "output.weight": sd["lm_head.weight"]}
    moe = "mlp"  # transformers 5's module names (its checkpoints say block_sparse_moe for Mixtral)
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if arch == "mixtral":
            q, k = _permute(q, c.num_attention_heads), _permute(k, c.num_key_value_heads)
        tensors.update({b + "attn_norm.weight": sd[p + "input_layernorm.weight"], b + "attn_q.weight": q,
                        b + "attn_k.weight": k, b + "attn_v.weight": sd[p + "self_attn.v_proj.weight"],
                        b + "attn_output.weight": sd[p + "self_attn.o_proj.weight"],
                        b + "ffn_norm.weight": sd[p + "post_attention_layernorm.weight"]})
        for n in ("q", "k", "v"):
            if p + f"self_attn.{n}_proj.bias" in sd:
                tensors[b + f"attn_{n}.bias"] = sd[p + f"self_attn.{n}_proj.bias"]
        if p + "self_attn.q_norm.weight" in sd:
            tensors[b + "attn_q_norm.weight"] = sd[p + "self_attn.q_norm.weight"]
            tensors[b + "attn_k_norm.weight"] = sd[p + "self_attn.k_norm.weight"]
        if p + f"{moe}.gate.weight" in sd:
            e = sd[p + f"{moe}.experts.gate_up_proj"]  # transformers 5 keeps them stacked: [E, 2I, H]
            half = e.shape[1] // 2
            tensors.update({b + "ffn_gate_inp.weight": sd[p + f"{moe}.gate.weight"],
                            b + "ffn_gate_exps.weight": e[:, :half], b + "ffn_up_exps.weight": e[:, half:],
                            b + "ffn_down_exps.weight": sd[p + f"{moe}.experts.down_proj"]})
            if p + "mlp.shared_expert.gate_proj.weight" in sd:
                for n in ("gate", "up", "down"):
                    tensors[b + f"ffn_{n}_shexp.weight"] = sd[p + f"mlp.shared_expert.{n}_proj.weight"]
                tensors[b + "ffn_gate_inp_shexp.weight"] = sd[p + "mlp.shared_expert_gate.weight"][0]
        else:
            for n in ("gate", "up", "down"):
                tensors[b + f"ffn_{n}.weight"] = sd[p + f"mlp.{n}_proj.weight"]
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if qtype is not None and arr.ndim >= 2 and "norm" not in name and "token_embd" not in name:
            kind = getattr(gguf.GGMLQuantizationType, qtype)
            raw = gguf.quants.quantize(arr, kind)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
