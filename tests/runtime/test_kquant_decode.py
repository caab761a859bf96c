"""A Q4_K_M file end to end on the native CPU decode path: the default model re-quantized by
llama.cpp's own quantizer (``llama_model_quantize`` through llama-cpp-python: Q4_K and Q6_K where
a row has a multiple of 256 weights, its Q5_0/Q8_0 fall-backs elsewhere) decodes natively on the
file's blocks, and its greedy tokens equal those of the same file dequantized to float32 except
at near-ties.

Near-tie (stated): the step where the two runs first pick differently for a sequence must be one
where the float run's logit of the quantized run's token is within ``NEAR_TIE`` of its own best
logit. The quantized run differs from the float one by its 8-bit activations only (same weights);
the logit error that causes is measured here too (``LOGIT_BOUND``, in units of the float run's
largest logit), so a near-tie is a gap that error can close.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from deepinfer.runtime.loading.model_loader import load_model
from deepinfer.runtime.worker.model_runner import ModelRunner
from test_native_decode import BS, CPU, run_batch, runner_for

pytest.importorskip("deepinfer_engine._cpu_kernels", reason="engine built without _cpu_kernels")
gguf = pytest.importorskip("gguf", reason="gguf is not installed")
NEAR_TIE = 0.15  # logits (as tests/runtime/test_quantized_parity.py)
# max |quantized - float| logit / max |float logit| at a decode step with the same context: 8-bit
# activations in the native steps and bfloat16 ones in the (torch int4) prefill. Measured at most
# 0.053 here and 0.050 on the shipped Q4_1 file through the Q4_1/Q8_0 kernels (same prompts, 24
# steps): the K-quant path adds no error of its own.
LOGIT_BOUND = 0.08


@pytest.fixture(scope="module")
def q4_k_m(default_gguf, tmp_path_factory) -> str:
    lc = pytest.importorskip("llama_cpp", reason="llama-cpp-python (llama.cpp's quantizer) is not installed")
    import ctypes

    out = str(tmp_path_factory.mktemp("q4km") / "default.Q4_K_M.gguf")
    params = lc.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = lc.LLAMA_FTYPE_MOSTLY_Q4_K_M, True, 1
    assert lc.llama_model_quantize(default_gguf.encode(), out.encode(), ctypes.byref(params)) == 0
    return out


def runner(path: str, quantized: bool, monkeypatch) -> ModelRunner:
    r = runner_for(path, True, monkeypatch, keep_quantized=quantized)
    assert r.native_decode is not None
    return r


def test_q4_k_m_file_has_the_k_quants(q4_k_m):
    types = collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(q4_k_m).tensors)
    assert types["Q4_K"] > 0 and types["Q6_K"] > 0, types


def test_q4_k_m_decodes_natively_on_its_blocks(q4_k_m, monkeypatch):
    r = runner(q4_k_m, True, monkeypatch)
    assert r.native_decode.kind == "quantized"
    # every projection and the embedding/head run on the file's own types
    assert set(r.native_decode.weight_types) >= {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}
    assert "F32" not in r.native_decode.weight_types
    assert set(r.native_decode.parts["mlp down"]) == {"Q4_K", "Q6_K"}  # the rows of 1536 = 6 x 256 weights
    assert sum(r.native_decode.parts["q/k/v"].values()) == 3 * r.model.config.num_hidden_layers


def test_kernel_paths_say_what_runs(q4_k_m, monkeypatch):
    from deepinfer.runtime.worker.native_decode import kernel_paths

    r = runner(q4_k_m, True, monkeypatch)
    lines = {line.split(":")[0]: line for line in kernel_paths(r.model, r.native_decode)}
    assert list(lines) == ["embedding", "q/k/v", "attn o", "mlp gate/up", "mlp down", "lm head", "activations"]
    assert "decode native Q4_K x" in lines["mlp down"] and "Q6_K x" in lines["mlp down"]
    assert "int8 activations per 32" in lines["mlp down"]
    assert "prefill torch int4" in lines["lm head"]  # Q8_0 head: two int4 halves on torch
    monkeypatch.setenv("DEEPINFER_CPU_NATIVE", "0")
    loaded = load_model(q4_k_m, device=CPU, dtype=torch.float32, max_positions=64, keep_quantized=True)
    off = ModelRunner(loaded, num_blocks=8, block_size=BS, device=CPU, dtype=torch.float32)
    lines = kernel_paths(off.model, off.native_decode)
    assert lines[-1] == "activations: float32"
    assert all("decode and prefill torch" in line or "decode and prefill int8" in line for line in lines[:-1])


def test_q4_k_m_greedy_tokens_equal_the_dequantized_float_run(q4_k_m, tokenizer, monkeypatch):
    prompts = [tokenizer(p).input_ids for p in ("The capital of France is", "def fibonacci(n):",
                                        "Once upon a time, in a small village,", "1, 2, 3, 4,")]
    steps = 16  # run_batch gives each sequence 8 blocks of 4 tokens
    q_logits = run_batch(runner(q4_k_m, True, monkeypatch), prompts, steps)
    f_logits = run_batch(runner(q4_k_m, False, monkeypatch), prompts, steps)
    q_tokens, f_tokens = ([[int(lg[t][s].argmax()) for t in range(steps + 1)] for s in range(len(prompts))]
                          for lg in (q_logits, f_logits))
    agreed = 0
    for s in range(len(prompts)):
        for t in range(steps + 1):
            if q_tokens[s][t] == f_tokens[s][t]:
                agreed += 1
                # same context so far: the logits differ by the activation rounding only
                if t > 0:  # step 0 is the (torch) prefill
                    ref = f_logits[t][s]
                    err = float((q_logits[t][s] - ref).abs().max() / ref.abs().max())
                    assert err <= LOGIT_BOUND, f"seq {s} step {t}: logit error {err:.4f}"
                continue
            ref = f_logits[t][s]
            gap = float(ref.max() - ref[q_tokens[s][t]])
            assert gap <= NEAR_TIE, f"seq {s} step {t}: tokens differ at a float-logit gap of {gap:.3f}"
            break  # the contexts differ from here on
    assert agreed >= len(prompts) * (steps + 1) // 2, f"only {agreed} tokens agreed"


def test_env_report_lists_the_cpu_kernels_per_weight_type():
    from deepinfer.plugins.env_report import collect, render

    report = collect()
    ck = report["cpu_kernels"]
    assert ck["best_isa"] in ck["available_isas"]
    assert {"Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q4_1", "Q8_0"} <= set(ck["weight_kernels"])
    assert f"CPU decode kernels: {ck['best_isa']} (available: " in render(report)
    assert f"Q4_K {ck['weight_kernels']['Q4_K']}" in render(report)


@pytest.mark.parametrize("kind, block, scale_at", [("Q5_0", 22, 0), ("Q6_K", 210, 208)])
def test_torch_decoders_are_bitwise_gguf_quants(kind, block, scale_at):
    """The dense weights of torch's prefill (Q5_0 and Q6_K have no int4 form) decode with torch,
    bitwise what ``gguf.quants`` gives (what transformers' GGUF loader sees)."""
    from deepinfer.runtime.kernels.gguf_blocks import dequantize_torch
    from gguf.quants import dequantize

    rng = np.random.default_rng(2)
    raw = rng.integers(0, 256, (19, 12 * block), dtype=np.uint8)
    blocks = raw.reshape(19, 12, block)
    blocks[..., scale_at:scale_at + 2] = (rng.standard_normal((19, 12, 1)) * 0.01).astype(np.float16).view(np.uint8)
    want = dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(19, -1)
    got = dequantize_torch(torch.from_numpy(raw), kind)
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), want)
