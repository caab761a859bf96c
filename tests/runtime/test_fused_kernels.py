"""The fused Triton kernels and the split-K decode attention equal the torch ops they replace
(run in Triton's CPU interpreter; tests/cuda runs the same check on a GPU, in bf16 too)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _interpreted(script: str) -> str:
    """stdout of ``script cpu`` run under Triton's interpreter (set before triton loads), checked to end in ok."""
    pytest.importorskip("triton", reason="Triton is not installed (it ships with torch's CUDA wheels)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    here = os.path.dirname(__file__)
    out = subprocess.run([sys.executable, os.path.join(here, script), "cpu"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
    return out.stdout


def test_fused_kernels_match_torch_ops():
    _interpreted("fused_kernels_check.py")


def test_argmax_rows_equals_torch_argmax():
    """``kernels.argmax.argmax_rows`` (the greedy pick of decode graphs whose LM head does not fold
    the argmax) equals ``torch.argmax``: first index on ties, also across its chunks, NaN above
    +inf, -0.0 tied with +0.0, bf16/fp16/float32, rows of a wider buffer; bad input is a
    ValueError (``argmax_check.py``; on a GPU: ``python argmax_check.py cuda``)."""
    assert _interpreted("argmax_check.py").count(": ok") == 16


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe"])
def test_fused_eager_steps_match_the_models_own_forward(tmp_path, arch):
    """Prompt chunks, a mixed step and a one-row step through ``fused_step_forward`` (what eager
    CUDA steps of dense and mixture-of-experts models run) give the hidden states and KV cache of
    the model's forward with the torch attention and torch experts (float32, Triton's interpreter;
    Qwen2-MoE brings a shared expert)."""
    pytest.importorskip("triton", reason="Triton is not installed (it ships with torch's CUDA wheels)")
    from tiny_models import save_tiny_model
    from tiny_moe_models import save_tiny_moe

    if arch in ("qwen3_moe", "mixtral", "qwen2_moe"):
        save_tiny_moe(tmp_path, arch)
    else:
        save_tiny_model(tmp_path, arch=arch)
    env = dict(os.environ, TRITON_INTERPRET="1")
    here = os.path.dirname(__file__)
    out = subprocess.run([sys.executable, os.path.join(here, "fused_step_check.py"), str(tmp_path), "cpu"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
    assert out.stdout.count("step ") == 3, out.stdout


@pytest.mark.parametrize("text,want", [("", (64, 4)), ("split=32,2", (32, 2)), ("split=16,8", (16, 8)),
                                       ("split=24,4", "power of two"), ("split=8,4", "power of two"),
                                       ("split=32", "KERNEL=N,N"), ("merge=32,4", "KERNEL=N,N")])
def test_decode_attention_tile_switch(monkeypatch, text, want):
    """DEEPINFER_DECODE_TILES (benchmarks) sets the split kernel's (BLOCK_N, num_warps); a bad value
    is a ValueError naming the switch."""
    pytest.importorskip("triton", reason="triton is not installed")
    from deepinfer.runtime.attention.triton_decode import split_tile

    monkeypatch.setenv("DEEPINFER_DECODE_TILES", text)
    if isinstance(want, tuple):
        assert split_tile(16) == want
    else:
        with pytest.raises(ValueError, match=f"DEEPINFER_DECODE_TILES.*{want}"):
            split_tile(16)
