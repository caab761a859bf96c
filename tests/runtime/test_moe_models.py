"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) on the CPU path against transformers.

Tiny random float32 checkpoints saved by transformers itself: logits within 1e-4 of
``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM`` / ``Qwen3MoeForCausalLM``, greedy tokens identical
over 32 tokens through the reference driver (whole prompts and chunked prefill) and through the real
serving loop (chunked prefill, prefix-cache hits, preemption, n > 1). Routing edge cases (every
token to one expert, experts with no tokens, tied scores) against transformers' own router and
expert modules, as vLLM's fused-MoE tests check them against a per-expert reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer.runtime.models.config import ModelConfig, MoeSpec
from deepinfer.runtime.models.moe import ExpertsSwiGLU, route
from deepinfer.runtime.sampling_params import SamplingParams
from reference_driver import greedy_generate
from tiny_moe_models import save_tiny_moe, tiny_config

CPU = torch.device("cpu")
ARCHS = ["mixtral", "qwen3_moe", "qwen2_moe"]
PROMPTS = [list(range(3, 40)), [5, 9, 13, 100, 3, 200], [42], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 11, 12]]
N_NEW = 32


def _load(path):
    from deepinfer.runtime.loading.model_loader import load_model

    return load_model(str(path), device=CPU, dtype=torch.float32)


def _runner(loaded, num_blocks=96, block_size=4):
    from deepinfer.runtime.worker.model_runner import ModelRunner

    return ModelRunner(loaded, num_blocks=num_blocks, block_size=block_size, device=CPU, dtype=torch.float32)


def hf_greedy(hf, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_moe(path, request.param)
    expected = [hf_greedy(hf, p, N_NEW) for p in PROMPTS]
    return request.param, path, hf, _load(path), expected


def test_config_reads_the_family(tiny):
    arch, _, hf, loaded, _ = tiny
    moe = loaded.config.moe
    assert loaded.config.architecture == arch and moe is not None
    hc = hf.config
    assert moe.num_experts == (hc.num_local_experts if arch == "mixtral" else hc.num_experts)
    assert moe.top_k == hc.num_experts_per_tok
    if arch == "qwen3_moe":
        assert moe.moe_layers == (0, 2) and loaded.config.qk_norm  # layer 1 is in mlp_only_layers
    if arch == "qwen2_moe":
        assert moe.shared_intermediate_size == 80 and moe.shared_expert_gate and loaded.config.attention_bias


def assert_logits_match(hf, loaded):
    """A whole prompt's logits in one step (blocks 20.. of the cache) within 1e-4 of transformers."""
    runner = _runner(loaded)
    prompt = PROMPTS[0]
    n = len(prompt)
    logits = runner.execute(
        input_ids=np.array(prompt), positions=np.arange(n), slot_mapping=np.arange(n) + 4 * 20,
        query_start_loc=np.array([0, n]), seq_lens=np.array([n]), block_tables=np.arange(20, 40, dtype=np.int32)[None],
        logits_indices=np.arange(n))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


def test_logits_match_transformers(tiny):
    assert_logits_match(tiny[2], tiny[3])


@pytest.mark.parametrize("chunk", [1 << 30, 5])
def test_greedy_32_tokens_equal_transformers(tiny, chunk):
    _, _, _, loaded, expected = tiny
    assert greedy_generate(_runner(loaded), PROMPTS, N_NEW, chunk=chunk) == expected


def _loop(loaded, tokenizer, **kw):
    from engine_helpers import make_loop

    return make_loop(loaded, tokenizer, **kw)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from deepinfer.runtime.loading.tokenizer_loader import load_tokenizer
    from tiny_models import save_tiny_tokenizer

    path = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(path)
    return load_tokenizer(str(path))


GREEDY = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)


def _check(outs, expected):
    for o, want in zip(outs, expected, strict=True):
        for sample in o.outputs:
            assert list(sample.token_ids) == want


def test_engine_chunked_prefill_and_n_above_one(tiny, tokenizer):
    from engine_helpers import run_all

    _, _, _, loaded, expected = tiny
    loop = _loop(loaded, tokenizer, prefix_caching=False, max_num_batched_tokens=16, block_size=4)
    outs, steps = run_all(loop, PROMPTS, GREEDY)
    _check(outs, expected)
    assert steps >= N_NEW + len(PROMPTS[0]) // 16
    two = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True, n=2)
    outs, _ = run_all(loop, PROMPTS[:2], two)
    assert all(len(o.outputs) == 2 for o in outs)
    _check(outs, expected[:2])


def test_engine_prefix_cache_hits(tiny, tokenizer):
    from engine_helpers import run_all

    _, _, _, loaded, expected = tiny
    loop = _loop(loaded, tokenizer, prefix_caching=True, block_size=4)
    first, _ = run_all(loop, PROMPTS, GREEDY)
    second, _ = run_all(loop, PROMPTS, GREEDY)
    _check(first, expected)
    _check(second, expected)
    assert second[0].metrics["num_cached_tokens"] >= 32
    assert loop.scheduler.get_stats()["prefix_cache_hits"] > 0


def test_engine_preemption(tiny, tokenizer):
    from engine_helpers import run_all

    _, _, _, loaded, expected = tiny
    loop = _loop(loaded, tokenizer, prefix_caching=False, num_blocks=24, block_size=4, max_model_len=96)
    outs, _ = run_all(loop, PROMPTS, GREEDY)
    _check(outs, expected)
    assert loop.scheduler.get_stats()["num_preemptions_total"] > 0


# ---- routing edge cases against transformers' own modules ---------------------------------------------

def _hf_block(arch, **over):
    """transformers' MoE block of ``arch`` with random weights, and our spec of the same config."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = tiny_config(arch, **over)
    cls = {"mixtral": MixtralSparseMoeBlock, "qwen3_moe": Qwen3MoeSparseMoeBlock,
           "qwen2_moe": Qwen2MoeSparseMoeBlock}[arch]
    torch.manual_seed(1)
    block = cls(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    spec = ModelConfig.from_hf_dict(cfg.to_dict()).moe
    assert spec is not None
    return block, spec


def _ours(block, spec):
    from deepinfer.runtime.models.moe import SparseMoe

    ours = SparseMoe(block.gate.weight.shape[1], spec)
    e = block.experts
    with torch.no_grad():
        ours.gate.weight.copy_(block.gate.weight)
        ours.experts.w13.copy_(e.gate_up_proj)
        ours.experts.w2.copy_(e.down_proj)
        if ours.shared is not None:
            s = block.shared_expert
            ours.shared.gate_up_proj.weight.copy_(torch.cat([s.gate_proj.weight, s.up_proj.weight]))
            ours.shared.down_proj.weight.copy_(s.down_proj.weight)
            ours.shared_gate.weight.copy_(block.shared_expert_gate.weight)
    return ours


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", ["random", "all_to_one_expert", "tied_scores", "one_token"])
def test_moe_block_equals_transformers(arch, case):
    block, spec = _hf_block(arch)
    ours = _ours(block, spec)
    hidden = block.gate.weight.shape[1]
    x = torch.randn(1 if case == "one_token" else 40, hidden, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        if case == "all_to_one_expert":  # expert 3's logit dominates for every token
            block.gate.weight.zero_()
            block.gate.weight[3] = 0.5
            block.gate.weight[5] = 0.25
            x = x.abs() + 1.0
        if case == "tied_scores":  # experts 1, 2 and 6 always score exactly alike (duplicate rows)
            block.gate.weight[2] = block.gate.weight[1]
            block.gate.weight[6] = block.gate.weight[1]
        ours.gate.weight.copy_(block.gate.weight)
        ref = block(x[None])[0]
        got = ours(x)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    logits = torch.nn.functional.linear(x, block.gate.weight)
    weights, ids = route(logits, spec)
    _, hf_weights, hf_ids = block.gate(x)
    assert torch.equal(ids, hf_ids)  # the same experts, in the same order, ties included
    torch.testing.assert_close(weights, hf_weights.float(), atol=1e-6, rtol=1e-6)
    if case == "all_to_one_expert":
        assert bool((ids[:, 0] == 3).all())
        # experts nobody chose: their rows are never computed (and their weights never read)
        assert len(set(ids.flatten().tolist())) < spec.num_experts


def test_ties_pick_the_lower_expert_index_as_torch_topk_does():
    spec = MoeSpec(num_experts=6, top_k=2, expert_intermediate_size=4, moe_layers=(0,), norm_topk_prob=True)
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    weights, ids = route(logits, spec)
    want = torch.topk(logits.softmax(-1), 2, dim=-1)[1]
    assert torch.equal(ids, want)
    torch.testing.assert_close(weights, torch.full((2, 2), 0.5))


def test_grouped_experts_compute_only_routed_rows():
    torch.manual_seed(0)
    experts = ExpertsSwiGLU(5, 8, 6)
    with torch.no_grad():
        experts.w13.normal_()
        experts.w2.normal_()
        experts.w13[4].fill_(float("nan"))  # never chosen: a NaN there must not reach the output
    x = torch.randn(7, 8)
    ids = torch.tensor([[0, 1], [1, 0], [2, 2], [3, 0], [0, 3], [1, 2], [2, 1]])
    w = torch.rand(7, 2)
    got = experts(x, w, ids)

    def expert(e, row):  # float64 per-expert reference
        w13, w2 = experts.w13[e].double(), experts.w2[e].double()
        g, u = (w13 @ row.double()).split(6)
        return w2 @ (torch.nn.functional.silu(g) * u)

    ref = torch.stack([sum(w[t, j].double() * expert(int(ids[t, j]), x[t]) for j in range(2)) for t in range(7)])
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("field,value,match", [
    ("hidden_act", "gelu", "hidden_act 'gelu'"),
    ("use_sliding_window", True, "use_sliding_window"),
    ("num_experts_per_tok", 99, "num_experts_per_tok must be in"),
    ("mlp_only_layers", [7], r"mlp_only_layers\[\] must be in"),
])
def test_unsupported_or_bad_fields_are_value_errors(field, value, match):
    d = tiny_config("qwen3_moe").to_dict()
    d[field] = value
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(d)


def test_gguf_layouts_match_transformers(tiny, tmp_path):
    """llama.cpp's layouts (qwen3moe, qwen2moe, and Mixtral as "llama" with expert_count): stacked
    experts, routers, shared experts, q/k permutation; float32 tensors."""
    pytest.importorskip("gguf", reason="gguf (the GGUF writer) is not installed")
    from tiny_moe_models import save_tiny_moe_gguf

    arch, _, hf, hf_dir_model, expected = tiny
    path = save_tiny_moe_gguf(tmp_path / "m.gguf", hf, arch)
    loaded = _load(path)
    assert loaded.config.architecture == arch and loaded.config.moe == hf_dir_model.config.moe
    assert_logits_match(hf, loaded)
    assert greedy_generate(_runner(loaded), PROMPTS, N_NEW, chunk=5) == expected


@pytest.mark.parametrize("key,value,match", [
    ("qwen3moe.expert_used_count", 99, r"qwen3moe.expert_used_count must be in \[1, 16\]"),
    ("qwen3moe.expert_count", -1, r"qwen3moe.expert_count must be"),
])
def test_bad_gguf_expert_metadata_names_the_key(key, value, match):
    from deepinfer.runtime.models.config import check_gguf_metadata

    meta = {"qwen3moe.expert_count": 16, "qwen3moe.expert_used_count": 4, "qwen3moe.embedding_length": 64,
            "qwen3moe.attention.head_count": 4, "qwen3moe.feed_forward_length": 96, "qwen3moe.block_count": 3}
    meta[key] = value
    with pytest.raises(ValueError, match=match):
        check_gguf_metadata(meta.get, "qwen3moe")


def test_fused_moe_kernels_in_tritons_interpreter():
    """The GPU kernels (sort by expert, grouped GEMMs with SiLU·mul fused, combine) under Triton's
    interpreter on CPU, float32, against a float64 per-expert reference."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton", reason="triton is not installed")
    here = os.path.dirname(__file__)
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([here] + sys.path))
    proc = subprocess.run([sys.executable, os.path.join(here, "fused_moe_check.py"), "cpu", "float32"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("(ok,") == 6, proc.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_moe_kernels_on_the_gpu(dtype):
    from fused_moe_check import main

    assert main("cuda", dtype) == 0


def test_align_by_expert_pads_each_expert_to_whole_blocks():
    from deepinfer.runtime.kernels.fused_moe import align_by_expert

    ids = torch.tensor([[3, 0], [3, 1], [0, 3]])  # pairs 0..5; expert 2 has none
    pairs, block_expert = align_by_expert(ids, 4, 4)
    # 6 pairs + 4 experts x 3 padding rows = 18 -> 20 slots (5 blocks), sentinel 6 in the padding
    assert pairs.tolist() == [1, 4, 6, 6, 3, 6, 6, 6, 0, 2, 5, 6] + [6] * 8
    assert block_expert.tolist() == [0, 1, 3, -1, -1]  # expert 2 gets no block


@pytest.mark.parametrize("tokens,top_k,experts,block", [(1, 1, 4, 16), (3, 2, 32, 16), (256, 8, 128, 16),
                                                        (257, 2, 160, 32), (64, 4, 8, 64), (33, 6, 257, 32)])
def test_align_by_expert_properties_as_vllm_checks_them(tokens, top_k, experts, block):
    """vLLM's test_moe_align_block_size behaviours: every pair exactly once, each expert's pairs in
    that expert's blocks only, each expert padded to whole blocks (experts without pairs get none),
    block experts valid, a padded length that depends only on the shapes, deterministic."""
    from deepinfer.runtime.kernels.fused_moe import align_by_expert

    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    pairs, block_expert = align_by_expert(ids, experts, block)
    n = tokens * top_k
    assert pairs.numel() % block == 0 and pairs.numel() >= n + experts * (block - 1)
    assert block_expert.numel() == pairs.numel() // block
    flat = ids.reshape(-1).tolist()
    seen: dict[int, list[int]] = {}
    for b, e in enumerate(block_expert.tolist()):
        chunk = [p for p in pairs[b * block:(b + 1) * block].tolist() if p < n]
        if e < 0:
            assert not chunk  # blocks past the last expert's run are empty
            continue
        assert 0 <= e < experts and all(flat[p] == e for p in chunk)
        seen.setdefault(e, []).extend(chunk)
    assert sorted(p for ps in seen.values() for p in ps) == list(range(n))
    counts = torch.bincount(ids.reshape(-1), minlength=experts).tolist()
    used_blocks = torch.bincount(block_expert[block_expert >= 0].long(), minlength=experts).tolist()
    assert used_blocks == [(c + block - 1) // block for c in counts]
    again = align_by_expert(ids, experts, block)
    assert torch.equal(again[0], pairs) and torch.equal(again[1], block_expert)
