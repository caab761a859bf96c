"""FlopsEstimator against hand-computed Llama-3-8B / Mixtral-shaped values and a brute-force sum."""

import random

import pytest
from deepinfer_engine import _engine as E

# Llama-3-8B: hidden 4096, 32 layers, 32 heads, 8 KV heads (head_dim 128), MLP 14336, vocab 128256.
LLAMA3_8B = dict(hidden_size=4096, num_layers=32, num_attention_heads=32, num_kv_heads=8,
                 intermediate_size=14336, vocab_size=128256)
# Per layer: q 4096*4096 + k 4096*1024 + v 4096*1024 + o 4096*4096 = 41_943_040 params,
# MLP 3*4096*14336 = 176_160_768 -> 218_103_808 per layer, *32 layers, *2 FLOPs.
LLAMA_LINEAR = 13_958_643_712
LLAMA_LM_HEAD = 1_050_673_152      # 2 * 4096 * 128256
LLAMA_ATTN_PER_CTX = 524_288       # 32 layers * 4 * 32 heads * 128


def test_llama3_8b_constants():
    f = E.FlopsEstimator(**LLAMA3_8B)
    assert f.linear_flops_per_token == LLAMA_LINEAR
    assert f.lm_head_flops_per_row == LLAMA_LM_HEAD
    assert f.attention_flops(1) == LLAMA_ATTN_PER_CTX
    assert f.attention_flops(2048) == 1_073_741_824


def test_llama3_8b_prefill_and_decode_steps():
    f = E.FlopsEstimator(**LLAMA3_8B)
    # 8-token prompt from scratch, one logits row: contexts 1..8 sum to 36.
    assert f.step_flops([8], [8], 1) == 112_738_697_216
    # One decode token at context 2048.
    assert f.step_flops([1], [2048], 1) == 16_083_058_688
    # Both in one mixed step: the sum.
    assert f.step_flops([8, 1], [8, 2048], 2) == 112_738_697_216 + 16_083_058_688
    # A second prefill chunk of 4 tokens after 8 computed: contexts 9..12 sum to 42, no logits.
    assert f.step_flops([4], [12], 0) == 4 * LLAMA_LINEAR + 42 * LLAMA_ATTN_PER_CTX


def test_sliding_window_caps_context():
    f = E.FlopsEstimator(**LLAMA3_8B, sliding_window=4096)
    assert f.attention_flops(8192) == 4096 * LLAMA_ATTN_PER_CTX
    # Chunk of 4 ending at 4097: contexts 4094, 4095, 4096, min(4097, 4096) -> 16381.
    assert f.chunk_attention_flops(4, 4097) == 16381 * LLAMA_ATTN_PER_CTX
    # Half the layers sliding: 16 layers see 8192, 16 see 4096.
    half = E.FlopsEstimator(**LLAMA3_8B, sliding_window=4096, sliding_layers=[i % 2 == 0 for i in range(32)])
    assert half.attention_flops(8192) == (8192 + 4096) * LLAMA_ATTN_PER_CTX // 2


def test_moe_mixtral_shape():
    f = E.FlopsEstimator(hidden_size=4096, num_layers=32, num_attention_heads=32, num_kv_heads=8,
                         intermediate_size=14336, vocab_size=32000, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=14336)
    # attention 41_943_040 + 2 experts * 3*4096*14336 (352_321_536) + router 4096*8 per layer.
    assert f.linear_flops_per_token == 2 * 32 * (41_943_040 + 352_321_536 + 32_768)
    # DeepSeek-style: first layer dense, shared expert on the MoE layers.
    g = E.FlopsEstimator(hidden_size=64, num_layers=3, num_attention_heads=4, intermediate_size=256,
                         vocab_size=100, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         num_shared_experts=1, first_k_dense_layers=1)
    attn = 4 * 64 * 64
    assert g.linear_flops_per_token == 2 * (3 * attn + 3 * 64 * 256 + 2 * (3 * 64 * 32 * 3 + 64 * 4))


def test_chunk_attention_matches_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        layers = rng.randint(1, 6)
        window = rng.choice([0, rng.randint(1, 64)])
        sliding = [rng.random() < 0.5 for _ in range(layers)] if window else None
        f = E.FlopsEstimator(hidden_size=32, num_layers=layers, num_attention_heads=4, intermediate_size=8,
                             vocab_size=10, sliding_window=window, sliding_layers=sliding)
        ctx = rng.randint(1, 200)
        q = rng.randint(0, ctx)
        per = 4 * 32
        want = 0
        for j in range(q):
            seen = ctx - q + j + 1
            for l in range(layers):
                slides = window and (sliding is None or sliding[l])
                want += per * (min(seen, window) if slides else seen)
        assert f.chunk_attention_flops(q, ctx) == want


@pytest.mark.parametrize("kwargs, field", [
    (dict(hidden_size=0), "hidden_size"),
    (dict(num_kv_heads=5), "num_kv_heads"),
    (dict(num_experts=4, num_experts_per_tok=5, moe_intermediate_size=8), "num_experts_per_tok"),
    (dict(sliding_window=8, sliding_layers=[True]), "sliding_layers"),
    (dict(first_k_dense_layers=40), "first_k_dense_layers"),
])
def test_bad_config_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        E.FlopsEstimator(**{**LLAMA3_8B, **kwargs})


def test_bad_step_arguments():
    f = E.FlopsEstimator(**LLAMA3_8B)
    with pytest.raises(ValueError, match="query_lens"):
        f.step_flops([5], [4], 0)
    with pytest.raises(ValueError, match="context_lens"):
        f.step_flops([1, 1], [4], 0)
    with pytest.raises(ValueError, match="query_lens"):
        f.step_flops([-1], [4], 0)
    with pytest.raises(TypeError, match="query_lens"):
        f.step_flops("abc", [4], 0)
