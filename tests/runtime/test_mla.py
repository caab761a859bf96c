"""DeepSeek-V2/V3-style models (MLA attention over a latent paged cache, MoE with shared experts and
group-limited routing, first dense layers) on the CPU path against transformers'
``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM`` on tiny random float32 checkpoints.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer.runtime.attention.mla import mla_paged_attention
from deepinfer.runtime.models.config import ModelConfig
from deepinfer.runtime.models.moe import route
from deepinfer.runtime.sampling_params import SamplingParams
from reference_driver import greedy_generate
from test_moe_models import (  # noqa: F401  (tokenizer: a fixture)
    PROMPTS,
    _check,
    _load,
    _loop,
    _runner,
    assert_logits_match,
    hf_greedy,
    tokenizer,
)
from tiny_moe_models import save_tiny_moe, tiny_config

N_NEW = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_moe(path, request.param)
    expected = [hf_greedy(hf, p, N_NEW) for p in PROMPTS]
    return request.param, path, hf, _load(path), expected


def test_config_and_latent_cache_size(tiny):
    from deepinfer.runtime.worker.kv_cache import bytes_per_block

    arch, _, _, loaded, _ = tiny
    cfg = loaded.config
    assert cfg.mla is not None and cfg.moe is not None
    assert cfg.moe.moe_layers == (1, 2)  # first_k_dense_replace=1: layer 0 is dense
    assert cfg.moe.topk_method == ("group_limited_greedy" if arch == "deepseek_v2" else "noaux_tc")
    runner = _runner(loaded, num_blocks=16, block_size=4)
    assert tuple(runner.kv_caches[0].shape) == (1, 17, 4, 1, 32 + 8)  # latent + rope key per token
    # MHA over the same heads would keep keys (nope + rope) and values per head and token
    mha = cfg.num_attention_heads * (cfg.mla.qk_head_dim + cfg.mla.v_head_dim)
    assert bytes_per_block(cfg, 4, torch.float32) == 3 * 4 * (32 + 8) * 4
    assert (32 + 8) / mha == pytest.approx(40 / 160)


def test_logits_match_transformers(tiny):
    assert_logits_match(tiny[2], tiny[3])


@pytest.mark.parametrize("chunk", [1 << 30, 5, 1])
def test_greedy_32_tokens_equal_transformers(tiny, chunk):
    _, _, _, loaded, expected = tiny
    assert greedy_generate(_runner(loaded), PROMPTS, N_NEW, chunk=chunk) == expected


def test_engine_chunked_prefill_prefix_cache_preemption_n2(tiny, tokenizer):  # noqa: F811
    from engine_helpers import run_all

    _, _, _, loaded, expected = tiny
    loop = _loop(loaded, tokenizer, prefix_caching=True, max_num_batched_tokens=16, block_size=4)
    first, _ = run_all(loop, PROMPTS, GREEDY)
    second, _ = run_all(loop, PROMPTS, SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True, n=2))
    _check(first, expected)
    _check(second, expected)
    assert second[0].metrics["num_cached_tokens"] >= 32
    small = _loop(loaded, tokenizer, prefix_caching=False, num_blocks=24, block_size=4, max_model_len=96)
    outs, _ = run_all(small, PROMPTS, GREEDY)
    _check(outs, expected)
    assert small.scheduler.get_stats()["num_preemptions_total"] > 0


def test_absorbed_decode_equals_expanded_attention_in_float64():
    """The absorbed decode path over the latent cache against per-head keys/values expanded from it."""
    from deepinfer.runtime.attention.metadata import build_attention_metadata

    g = torch.Generator().manual_seed(0)
    heads, nope, rope, v, c, bs = 3, 8, 4, 6, 10, 4
    lens = [5, 9, 1]
    kv_b = torch.randn(heads, nope + v, c, generator=g, dtype=torch.float64)
    cache = torch.zeros(1, 13, bs, 1, c + rope, dtype=torch.float64)
    tables = np.array([[0, 1, 2], [3, 4, 5], [6, 7, 8]], dtype=np.int32)
    ctxs = [torch.randn(n, c + rope, generator=g, dtype=torch.float64) for n in lens]
    for table, ctx in zip(tables, ctxs, strict=True):  # the context already cached
        for p in range(len(ctx) - 1):
            cache.view(-1, c + rope)[table[p // bs] * bs + p % bs] = ctx[p]
    slots = np.array([table[(n - 1) // bs] * bs + (n - 1) % bs for table, n in zip(tables, lens, strict=True)])
    meta = build_attention_metadata(slot_mapping=slots, query_start_loc=np.arange(4), seq_lens=np.array(lens),
                                    block_tables=tables, block_size=bs, scratch_slot=12 * bs,
                                    device=torch.device("cpu"))
    q_nope = torch.randn(3, heads, nope, generator=g, dtype=torch.float64)
    q_pe = torch.randn(3, heads, rope, generator=g, dtype=torch.float64)
    latent = torch.stack([ctx[-1] for ctx in ctxs])
    got = mla_paged_attention(q_nope, q_pe, latent, cache, meta, kv_b, 0.3)
    for b, ctx in enumerate(ctxs):
        kv = torch.einsum("sc,hdc->hsd", ctx[:, :c], kv_b)
        k = torch.cat([kv[..., :nope], ctx[None, :, c:].expand(heads, -1, -1)], dim=-1)
        q = torch.cat([q_nope[b], q_pe[b]], dim=-1)  # [H, nope + rope]
        p = (torch.einsum("hd,hsd->hs", q, k) * 0.3).softmax(-1)
        torch.testing.assert_close(got[b], torch.einsum("hs,hsd->hd", p, kv[..., nope:]))


def _hf_router(arch):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = tiny_config(arch)
    router = (DeepseekV2TopkRouter if arch == "deepseek_v2" else DeepseekV3TopkRouter)(cfg)
    spec = ModelConfig.from_hf_dict(cfg.to_dict()).moe
    return router, spec


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("case", ["random", "one_group_dominates", "tied_groups"])
def test_group_limited_routing_equals_transformers(arch, case):
    router, spec = _hf_router(arch)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, router.hidden_dim, generator=g)
    with torch.no_grad():
        router.weight.normal_(0, 0.5, generator=g)
        if arch == "deepseek_v3":
            router.e_score_correction_bias.uniform_(-0.2, 0.2, generator=g)
        if case == "one_group_dominates":  # experts 4..7 (group 1) score highest for every token
            router.weight[4:8] = 0.0
            router.weight[4:8, 0] = 5.0
            x[:, 0] = x[:, 0].abs() + 2.0
        if case == "tied_groups":  # groups 0 and 2 hold the same experts' rows: tied group scores
            router.weight[8:12] = router.weight[0:4]
            if arch == "deepseek_v3":
                router.e_score_correction_bias[8:12] = router.e_score_correction_bias[0:4]
        _, hf_w, hf_ids = router(x)
    bias = router.e_score_correction_bias if arch == "deepseek_v3" else None
    w, ids = route(torch.nn.functional.linear(x, router.weight), spec, bias)
    # unsorted top-k: the same experts with the same weights (compare as sets per token)
    o1, o2 = ids.sort(dim=-1), hf_ids.sort(dim=-1)
    assert torch.equal(o1.values, o2.values)
    torch.testing.assert_close(w.gather(1, o1.indices), hf_w.gather(1, o2.indices), atol=1e-6, rtol=1e-6)
    groups = ids // (spec.num_experts // spec.n_group)
    assert all(len(set(r)) <= spec.topk_group for r in groups.tolist())  # only topk_group groups used
    if case == "one_group_dominates":
        assert bool((groups == 1).any(dim=-1).all())


@pytest.mark.parametrize("arch,field,value,match", [
    ("deepseek_v2", "topk_method", "noaux_tc", "topk_method 'noaux_tc' is not supported for deepseek_v2"),
    ("deepseek_v2", "topk_method", "random", "topk_method 'random' is not supported"),
    ("deepseek_v3", "topk_method", "greedy", "topk_method 'greedy' is not supported for deepseek_v3"),
    ("deepseek_v3", "scoring_func", "softmax", "scoring_func 'softmax'"),
    ("deepseek_v2", "norm_topk_prob", True, "norm_topk_prob=true is not supported for deepseek_v2"),
    ("deepseek_v2", "n_group", 3, "n_group=3 does not divide"),
    ("deepseek_v2", "moe_layer_freq", 2, "moe_layer_freq=2"),
    ("deepseek_v2", "attention_bias", True, "attention_bias=true"),
    ("deepseek_v3", "quantization_config", {"quant_method": "fp8"}, "quantization_config .quant_method 'fp8'"),
    ("deepseek_v3", "rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "lacks 'original_max_position_embeddings'"),
    ("deepseek_v3", "rope_scaling", {"rope_type": "dynamic", "factor": 4.0}, "rope_type 'dynamic' is not supported"),
])
def test_unsupported_variants_are_value_errors_naming_the_field(arch, field, value, match):
    d = tiny_config(arch).to_dict()
    d[field] = value
    d.pop("rope_parameters", None) if field == "rope_scaling" else None
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(d)


def test_deepseek_v2_lite_latent_cache_holds_8x_the_tokens_of_mha():
    """From the engine's block count: the same KV budget holds >= 8x the tokens of the equivalent
    MHA cache (16 heads of 192-value keys and 128-value values per layer)."""
    import dataclasses

    from deepinfer.runtime.worker.kv_cache import num_blocks_for
    from gpu_shapes import SHAPES

    cfg = ModelConfig.from_hf_dict(dict(SHAPES["deepseek-v2-lite"], eos_token_id=2))
    mha = dataclasses.replace(cfg, mla=None, head_dim=(192 + 128) // 2)  # 2 planes x 160 = keys + values
    budget = 1 << 30
    mla_blocks = num_blocks_for(cfg, 16, torch.bfloat16, torch.device("cpu"), cpu_kv_cache_bytes=budget)
    mha_blocks = num_blocks_for(mha, 16, torch.bfloat16, torch.device("cpu"), cpu_kv_cache_bytes=budget)
    assert cfg.kv_cache_layout() == (1, 1, 576)
    assert mla_blocks == budget // (27 * 16 * 576 * 2) == 2157
    assert mha_blocks == budget // (27 * 16 * 5120 * 2) == 242
    assert mla_blocks >= 8 * mha_blocks  # 5120 / 576 = 8.9x


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite"])
def test_benchmark_shapes_parse(shape):
    from gpu_shapes import SHAPES

    cfg = ModelConfig.from_hf_dict(dict(SHAPES[shape], eos_token_id=2))
    assert cfg.moe is not None and cfg.architecture == SHAPES[shape]["model_type"]


YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16, "beta_fast": 32,
        "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}


@pytest.mark.parametrize("arch,yarn", [("deepseek_v2", YARN),  # DeepSeek-V2-Lite's values, a short original context
                                       ("deepseek_v3", dict(YARN, factor=8.0, mscale=1.0, mscale_all_dim=1.0)),
                                       ("deepseek_v3", dict(YARN, factor=4.0, mscale=1.0, mscale_all_dim=0.5))])
def test_yarn_rope_scaling_matches_transformers(tmp_path, arch, yarn):
    """YaRN as the real DeepSeek configs use it: stretched frequencies, cos/sin attention factor,
    softmax scale mscale^2; positions past the original context (16 here)."""
    rope = dict(yarn, rope_theta=10000.0)
    hf = save_tiny_moe(tmp_path, arch, rope_parameters=rope)
    loaded = _load(tmp_path)
    assert loaded.config.rope_scaling["rope_type"] == "yarn"
    assert_logits_match(hf, loaded)  # 37 positions: beyond original_max_position_embeddings
    prompt = PROMPTS[0]
    assert greedy_generate(_runner(loaded), [prompt], 12, chunk=7)[0] == hf_greedy(hf, prompt, 12)


def test_yarn_is_refused_outside_mla_models():
    d = tiny_config("qwen3_moe").to_dict()
    d["rope_parameters"] = dict(YARN, rope_theta=10000.0)
    with pytest.raises(ValueError, match="yarn' is supported for MLA models only"):
        ModelConfig.from_hf_dict(d)


@pytest.mark.parametrize("shape", ["test-small-moe", "test-small-mla"])
def test_llm_runs_moe_and_mla_shapes_with_dummy_weights(tmp_path, shape):
    """The whole LLM path (engine args, KV sizing from the cache layout, scheduler, sampler) on
    random weights of a small MoE / MLA shape, as ``deepinfer bench --dummy-weights`` runs it;
    n=2 greedy samples agree, and a second identical request gets the same tokens."""
    from deepinfer import LLM
    from gpu_shapes import write_shape_dir

    path = write_shape_dir(str(tmp_path / shape), shape)
    llm = LLM(path, dummy_weights=True, device="cpu", dtype="float32", max_model_len=128,
              cpu_kv_cache_bytes=8 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=2)
    first = llm.generate([{"prompt_token_ids": list(range(5, 40))}], params)[0]
    again = llm.generate([{"prompt_token_ids": list(range(5, 40))}], params)[0]
    tokens = [list(o.token_ids) for o in first.outputs + again.outputs]
    assert all(len(t) == 12 for t in tokens) and all(t == tokens[0] for t in tokens)


def test_deepseek_v3_multi_token_prediction_layer_is_ignored():
    """DeepSeek-V3 checkpoints carry their MTP layer after the last decoder layer (unused here)."""
    from deepinfer.runtime.models.config import check_tensor_shapes

    cfg = ModelConfig.from_hf_dict(tiny_config("deepseek_v3").to_dict())
    shapes = {"model.embed_tokens.weight": (320, 64), **{f"model.layers.{i}.input_layernorm.weight": (64,)
                                                         for i in range(4)}}
    check_tensor_shapes(cfg, shapes)  # layers 0..2 + the MTP layer 3
    v2 = ModelConfig.from_hf_dict(tiny_config("deepseek_v2").to_dict())
    with pytest.raises(ValueError, match="num_hidden_layers=3 but the weights hold layers 0..3"):
        check_tensor_shapes(v2, shapes)
