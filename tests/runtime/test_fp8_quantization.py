"""FP8 weight-only quantization (``quantization="fp8"``, models/fp8_linear.py, kernels/fp8_gemv.py)
and the "what runs" describer (models/describe.py). CPU: the quantizer against hand-computed E4M3
codes, the refusals, the Triton kernels in Triton's interpreter, and a tiny model's logits with fp8
weights (emulated: dequantized float32) against a float64 reference; the GPU runs are
bench/fp8_check.py and ``test_fp8_kernels_on_the_gpu``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from deepinfer.runtime.loading.quantization import check_quantization
from deepinfer.runtime.models.fp8_linear import (
    FP8_MAX,
    Fp8Linear,
    dequantize_fp8,
    quantize_fp8,
    quantize_model,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

HERE = os.path.dirname(__file__)
CUDA0 = torch.device("cuda", 0)


# ---- the quantizer -------------------------------------------------------------------------------
def test_quantize_hand_computed_rows():
    w = torch.tensor([[1.0, -0.5, 0.25, 2.0],      # amax 2: scale 2/448, codes 224, -112, 56, 448 (all E4M3)
                      [0.0, 0.0, 0.0, 0.0],        # all zero: codes 0, scale 1 (not 0/448: no division by 0)
                      [448.0, 272.0, 304.0, -1.0]])  # scale 1: 272 and 304 are ties between E4M3 neighbours
    codes, scale = quantize_fp8(w)
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.tolist() == pytest.approx([2 / 448, 1.0, 1.0], rel=1e-7)
    assert codes[0].float().tolist() == [224.0, -112.0, 56.0, 448.0]
    assert codes[1].float().tolist() == [0.0] * 4
    # between 256 and 448 E4M3 steps by 32: ties go to the even mantissa (256: 000, 320: 010)
    assert codes[2].float().tolist() == [448.0, 256.0, 320.0, -1.0]
    assert torch.equal(dequantize_fp8(codes, scale)[0], w[0])  # exactly representable row: lossless


def test_quantize_saturates_instead_of_nan():
    w = torch.tensor([[3.0e38, -3.0e38, 1.0e30]])  # amax / 448 * 448 may round above amax
    codes, _ = quantize_fp8(w)
    assert not codes.float().isnan().any()
    assert codes.float().abs().max() == FP8_MAX


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), cols=st.integers(1, 40), log_mag=st.floats(-30, 30), seed=st.integers(0, 2**31 - 1))
def test_quantize_error_bound_property(rows, cols, log_mag, seed):
    """Every row: largest code 448, no NaN, and each weight within E4M3's half step: relative 2^-4
    for normal codes (|code| >= 2^-6), absolute 2^-10 * scale for subnormal ones."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g, dtype=torch.float64) * 10.0 ** log_mag
    codes, scale = quantize_fp8(w.float())
    c = codes.double()
    assert not c.isnan().any()
    assert (c.abs().amax(1) == FP8_MAX).all()
    target = w.float().double() / scale.double()[:, None]
    err = (c - target).abs()
    normal = c.abs() >= 2.0 ** -6
    assert (err[normal] <= target.abs()[normal] * 2.0 ** -4 + 1e-12).all()
    assert (err[~normal] <= 2.0 ** -10 + 1e-12).all()


def test_quantize_refuses_non_finite_weights():
    with pytest.raises(ValueError, match="non-finite"):
        quantize_fp8(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8(torch.ones(4))


# ---- refusals ------------------------------------------------------------------------------------
def test_refuses_cpu():
    with pytest.raises(ValueError, match=r"needs a CUDA GPU with compute capability >= 8\.9; this device is cpu"):
        check_quantization("fp8", torch.device("cpu"))


def test_refuses_a_gpu_below_sm89(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r">= 8\.9; NVIDIA A100-SXM4-80GB has 8\.0"):
        check_quantization("fp8", CUDA0)


def test_on_an_fp8_gpu_refuses_float32_and_tensor_parallel(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_quantization("fp8", CUDA0)  # accepted
    with pytest.raises(ValueError, match="bfloat16/float16 activations, got dtype torch.float32"):
        check_quantization("fp8", CUDA0, dtype=torch.float32)
    with pytest.raises(ValueError, match="one rank only"):
        check_quantization("fp8", CUDA0, tensor_parallel_size=2)


def test_refuses_a_quantized_gguf_file(default_gguf):
    with pytest.raises(ValueError, match=r"the file is already quantized: Q4_1, Q8_0"):
        check_quantization("fp8", CUDA0, default_gguf)


def test_unknown_method_lists_the_supported_ones():
    from deepinfer.runtime.engine_args import EngineArgs

    with pytest.raises(ValueError, match=r"quantization must be one of \['fp8', 'gguf'\], got 'awq'"):
        EngineArgs(quantization="awq")
    with pytest.raises(ValueError, match=r"supported methods: \['fp8', 'gguf'\]"):
        check_quantization("int8", CUDA0)
    assert EngineArgs().quantization is None


def test_quantize_model_refuses_models_it_would_leave_partly_dense():
    from deepinfer.runtime.models.moe import MoeForCausalLM

    fake = MoeForCausalLM.__new__(MoeForCausalLM)  # the type is what is checked: no weights needed
    nn.Module.__init__(fake)
    with pytest.raises(ValueError, match="dense Llama family only, not MoeForCausalLM"):
        quantize_model(fake, "fp8")
    with pytest.raises(ValueError, match=r"supported methods: \['fp8'\]"):  # (the layer swap: fp8 only)
        quantize_model(nn.Module(), "int4")


def test_llm_refuses_fp8_on_cpu_before_loading(tiny_model_dir):
    from deepinfer import LLM

    with pytest.raises(ValueError, match="this device is cpu"):
        LLM(tiny_model_dir, device="cpu", quantization="fp8")


def test_cli_takes_quantization():
    import argparse

    from deepinfer.runtime.engine_args import EngineArgs

    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    assert EngineArgs.from_cli_args(p.parse_args(["--quantization", "fp8"])).quantization == "fp8"
    with pytest.raises(SystemExit):
        p.parse_args(["--quantization", "gptq"])


# ---- the kernels -------------------------------------------------------------------------------
def test_fp8_gemv_refuses_tiles_it_cannot_run():
    pytest.importorskip("triton", reason="triton is not installed")
    from deepinfer.runtime.kernels.fp8_gemv import fp8_gemv

    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    q, s = torch.zeros(7, 64).to(torch.float8_e4m3fn), torch.ones(7)
    with pytest.raises(ValueError, match=r"silu_out needs an even number of weight rows .*got 7"):
        fp8_gemv(x, q, s, silu_out=True, config=(2, 64, 1, 1))
    q, s = torch.zeros(8, 64).to(torch.float8_e4m3fn), torch.ones(8)
    with pytest.raises(ValueError, match=r"an even BLOCK_N without split-K \(got 3, split 1\)"):
        fp8_gemv(x, q, s, silu_out=True, config=(3, 64, 1, 1))
    with pytest.raises(ValueError, match=r"3 row tiles a program need K in one chunk \(BLOCK_K >= 64\), got BLOCK_K 32"):
        fp8_gemv(x, q, s, config=(2, 32, 1, 1, 3))
    with pytest.raises(ValueError, match=r"config must be \(BLOCK_N, BLOCK_K, num_warps, num_stages\[, row tiles"):
        fp8_gemv(x, q, s, config=(2, 64, 1))
    with pytest.raises(ValueError, match="takes no residual"):
        fp8_gemv(x, q, s, silu_out=True, residual=torch.zeros(1, 8, dtype=torch.bfloat16), config=(2, 64, 1, 1))


def test_fp8_kernels_in_tritons_interpreter():
    """fp8_gemv (plain + bias, RMSNorm prologue, residual epilogue, SiLU·mul input, SiLU·mul
    output: the down projection after it bitwise the two-launch path's; several row tiles a program
    bitwise one's) and fp8_gemm (1-64 rows,
    bias) under Triton's interpreter, float32 activations, vs float64 of the dequantized
    weights (bound 1e-5: summation order only)."""
    pytest.importorskip("triton", reason="triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([HERE] + sys.path))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "fp8_kernels_check.py"), "cpu", "float32"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("(ok,") == 76 and "all ok" in proc.stdout, proc.stdout


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU with compute capability >= 8.9")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_kernels_on_the_gpu(dtype):
    sys.path.insert(0, HERE)
    from fp8_kernels_check import main

    assert main("cuda", dtype) == 0


# ---- the layer and a model ------------------------------------------------------------------------
def test_fp8_linear_matches_its_dequantized_weight():
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(40, 24, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(24, 40, generator=g))
        lin.bias.copy_(torch.randn(24, generator=g))
    f8 = Fp8Linear.from_linear(lin)
    assert f8.weight.dtype == torch.float8_e4m3fn and f8.weight_scale.shape == (24,)
    assert f8.weight_type == "fp8_e4m3 per-channel"
    assert "CPU emulation" in f8.kernel_path
    x = torch.randn(2, 3, 40, generator=g)
    ref = x.double() @ dequantize_fp8(f8.weight, f8.weight_scale, torch.float64).T + lin.bias.double()
    got = f8(x)
    assert got.shape == (2, 3, 24)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def _attention(q, k, v, cache, meta, scale):
    """Causal attention of one sequence without a cache (a prefill's logits)."""
    rep = q.shape[1] // k.shape[1]
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
                                       v.repeat_interleave(rep, 1).transpose(0, 1), is_causal=True, scale=scale)
    return o.transpose(0, 1)


def _logits(model, ids):
    pos = torch.arange(len(ids))
    return model.compute_logits(model.forward(ids, pos, [None] * len(model.layers), None, _attention))


@torch.no_grad()
def test_tiny_model_logits_with_fp8_weights(tiny_model_dir):
    """The quantized model's logits equal a float64 run of the dequantized weights (float32
    summation only: 1e-5). Against the unquantized model: each weight moves by at most 2^-4 of
    itself (E4M3's half step), 2.5 % rms over a projection (checked per projection: 1-4 %); the
    tiny model's sharp N(0, 0.2) weights amplify that to 11 % of the logits (L2, measured on both
    tiny models): bound 20 %."""
    from deepinfer.runtime.loading.model_loader import load_model

    loaded = load_model(tiny_model_dir, device=torch.device("cpu"), dtype=torch.float32)
    model = loaded.model
    ids = torch.randint(3, loaded.config.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    before = _logits(model, ids).double()
    assert quantize_model(model, "fp8") == 4 * len(model.layers)
    assert all(isinstance(getattr(layer, n), Fp8Linear) for layer in model.layers
               for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    assert [model.layers[0].qkv_proj.projection, model.layers[0].down_proj.projection] == ["qkv", "down"]  # tiles
    after = _logits(model, ids).double()
    # the float64 reference: the same model with each Fp8Linear replaced by its dequantized weight
    ref_model = load_model(tiny_model_dir, device=torch.device("cpu"), dtype=torch.float64).model
    for layer, ref_layer in zip(model.layers, ref_model.layers, strict=True):
        for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            f8, orig = getattr(layer, n), getattr(ref_layer, n).weight
            deq = dequantize_fp8(f8.weight, f8.weight_scale, torch.float64)
            assert 0.01 < float((deq - orig).norm() / orig.norm()) < 0.04, n
            orig.copy_(deq)
    ref = _logits(ref_model, ids)
    assert float((after - ref).norm() / ref.norm()) < 1e-5
    rel = float((after - before).norm() / before.norm())
    assert 0 < rel < 0.2, rel


@torch.no_grad()
def test_fp8_lm_head_switch_quantizes_the_head_too(tiny_model_dir, monkeypatch):
    """DEEPINFER_FP8_LM_HEAD=1 (experimental): the LM head becomes an Fp8Linear as well (an untied
    head's bf16 weight is dropped; a tied model keeps its table for the lookup and gets an fp8 copy
    for the head), and the logits equal a float64 run whose projections and head hold the
    dequantized fp8 weights. Off (default), the head stays the model's own weight."""
    from deepinfer.runtime.loading.model_loader import load_model
    from deepinfer.runtime.models.fp8_linear import quantize_head

    loaded = load_model(tiny_model_dir, device=torch.device("cpu"), dtype=torch.float32)
    model, cfg = loaded.model, loaded.config
    tied = model.lm_head is None
    head_weight = (model.embed_tokens.weight if tied else model.lm_head.weight).detach().clone()
    monkeypatch.setenv("DEEPINFER_FP8_LM_HEAD", "1")
    assert quantize_model(model, "fp8") == 4 * len(model.layers) + 1
    head = model.quantized_head
    assert isinstance(head, Fp8Linear) and model.lm_head is None
    assert head.weight.shape == (cfg.vocab_size, cfg.hidden_size)
    if tied:  # the lookup still reads the unquantized table
        assert torch.equal(model.embed_tokens.weight, head_weight)
    assert not quantize_head(model)  # once only
    from deepinfer.runtime.models.describe import describe_model

    # what `deepinfer env` prints for the head: the fp8 layer, not the (tied) table
    assert describe_model(model)["lm_head"] == [("fp8_e4m3 per-channel",
                                                 "dequantize + torch matmul (CPU emulation)", 1)]
    ids = torch.randint(3, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(1))
    got = _logits(model, ids).double()
    ref_model = load_model(tiny_model_dir, device=torch.device("cpu"), dtype=torch.float64).model
    for layer, ref_layer in zip(model.layers, ref_model.layers, strict=True):
        for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            f8 = getattr(layer, n)
            getattr(ref_layer, n).weight.copy_(dequantize_fp8(f8.weight, f8.weight_scale, torch.float64))
    deq_head = dequantize_fp8(head.weight, head.weight_scale, torch.float64)
    assert 0.01 < float((deq_head - head_weight.double()).norm() / head_weight.double().norm()) < 0.04
    ref_model.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=torch.float64)
    ref_model.lm_head.weight.copy_(deq_head)  # (a tied reference reads this head, the table for lookups)
    ref = _logits(ref_model, ids)
    assert float((got - ref).norm() / ref.norm()) < 1e-5
    monkeypatch.setenv("DEEPINFER_FP8_LM_HEAD", "0")
    plain = load_model(tiny_model_dir, device=torch.device("cpu"), dtype=torch.float32).model
    quantize_model(plain, "fp8")
    assert plain.quantized_head is None


def test_llm_with_fp8_layers_runs_the_dequantized_weights_greedy(tiny_model_dir, monkeypatch):
    """End to end through the worker (CPU emulation: the device check patched out, torch decode
    steps): the greedy tokens of LLM(quantization="fp8") equal those of the plain model whose
    projection weights were replaced by their fp8 round trip (the same values as nn.Linear)."""
    import deepinfer.runtime.loading.quantization as quantization
    from deepinfer import LLM, SamplingParams

    monkeypatch.setenv("DEEPINFER_CPU_NATIVE", "0")
    monkeypatch.setattr(quantization, "check_quantization", lambda *a, **k: None)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [40, 3, 99, 17, 250]}]
    llm = LLM(tiny_model_dir, device="cpu", quantization="fp8")
    assert "weights='fp8_e4m3'" in repr(llm)
    assert all(isinstance(getattr(layer, n), Fp8Linear) for layer in llm.runner.model.layers
               for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    ref_llm = LLM(tiny_model_dir, device="cpu")
    with torch.no_grad():
        for layer in ref_llm.runner.model.layers:
            for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                w = getattr(layer, n).weight
                w.copy_(dequantize_fp8(*quantize_fp8(w)))
    want = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


# ---- what runs -----------------------------------------------------------------------------------
def test_describer_on_the_default_model(default_gguf, loaded_default):
    from deepinfer.runtime.loading.model_loader import load_model
    from deepinfer.runtime.models.describe import activation_dtype, describe_lines, describe_model

    # as LLM() loads it on CPU: SmolLM2's Q4_1 projections and Q8_0 table/head kept quantized
    kept = load_model(default_gguf, device=torch.device("cpu"), dtype=torch.float32, keep_quantized=True).model
    table = describe_model(kept)
    assert list(table) == ["qkv", "o", "gate_up", "down", "lm_head", "embedding"]
    for kind in ("qkv", "o", "gate_up", "down"):
        assert [(wt, n) for wt, _, n in table[kind]] == [("int4 per-32", kept.config.num_hidden_layers)], kind
        assert table[kind][0][1].startswith("torch int4 weight-only matmul (bfloat16 activations")
    assert table["lm_head"][0][0] == "Q8_0 as two int4 halves per-32"
    assert table["embedding"] == [("Q8_0 int8 per-32", "int8 rows dequantized on lookup", 1)]
    assert activation_dtype(kept) == "float32"
    # dequantized to float32 (an explicit dtype): plain torch layers, the head tied to the table
    dense = describe_model(loaded_default.model)
    assert dense["qkv"][0][0] == "float32" and dense["qkv"][0][1].startswith("torch matmul")
    assert dense["lm_head"] == [("float32 (tied to the embedding)", "torch matmul", 1)]
    assert describe_lines(loaded_default.model)[-1] == "activations: float32"


@torch.no_grad()
def test_describer_on_a_tiny_fp8_model(tiny_model_dir):
    from deepinfer.runtime.loading.model_loader import load_model
    from deepinfer.runtime.models.describe import describe_lines, describe_model

    model = load_model(tiny_model_dir, device=torch.device("cpu"), dtype=torch.float32).model
    layers = len(model.layers)
    plain = describe_model(model)
    assert [(wt, n) for wt, _, n in plain["qkv"]] == [("float32", layers)]
    assert plain["qkv"][0][1].startswith("torch matmul")  # (+ oneDNN from 4 rows where torch has it)
    quantize_model(model, "fp8")
    table = describe_model(model)
    for kind in ("qkv", "o", "gate_up", "down"):
        assert table[kind] == [("fp8_e4m3 per-channel", "dequantize + torch matmul (CPU emulation)", layers)], kind
    head = table["lm_head"][0][0]  # untied (llama) or tied to the embedding (qwen2)
    assert head in ("float32", "float32 (tied to the embedding)")
    assert table["embedding"] == [("float32", "row lookup", 1)]
    assert describe_lines(model)[0] == "qkv: weights fp8_e4m3 per-channel, dequantize + torch matmul (CPU emulation)"
