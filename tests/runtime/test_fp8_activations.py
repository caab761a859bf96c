"""FP8 activations of the several-row fp8 products (kernels/fp8_act.py) and the kernel choice by
row count (models/fp8_linear.gemm_path). The Triton row quantizer, the w8a8 GEMM and the one-row
GEMV maths run in Triton's interpreter in test_fp8_quantization.py (fp8_kernels_check.py); here:
the quantizer's torch twin against hand-computed codes and a property, the product through
torch._scaled_mm on the CPU against float64, the dispatch and the refusals."""

from __future__ import annotations

import pytest
import torch
from deepinfer.runtime.kernels.fp8_act import (
    FP8_MAX,
    fp8_scaled_mm,
    quantize_rows_fp8,
    quantize_rows_fp8_torch,
)
from deepinfer.runtime.models.fp8_linear import (
    SCALED_MM_MIN_ROWS,
    dequantize_fp8,
    gemm_path,
    quantize_fp8,
)
from hypothesis import given, settings
from hypothesis import strategies as st


def test_row_quantizer_hand_computed():
    x = torch.tensor([[1.0, -0.5, 0.25, 2.0],      # amax 2: scale 2/448, codes 224, -112, 56, 448
                      [0.0, 0.0, 0.0, 0.0],        # zero row: scale 1 (no 0/0), codes 0
                      [448.0, 272.0, 304.0, -1.0],  # scale 1: ties between E4M3 neighbours go to even
                      [3.0e38, -3.0e38, 1.0, 0.0]])  # huge: x / scale may round past 448, saturates (no NaN)
    q, s = quantize_rows_fp8(x)  # on CPU: the torch twin
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (4, 1)
    assert s[:3, 0].tolist() == pytest.approx([2 / 448, 1.0, 1.0], rel=1e-7)
    assert q[0].float().tolist() == [224.0, -112.0, 56.0, 448.0]
    assert q[1].float().tolist() == [0.0] * 4
    assert q[2].float().tolist() == [448.0, 256.0, 320.0, -1.0]
    assert q[3].float().tolist()[:2] == [448.0, -448.0] and q[3].float().tolist()[2:] == [0.0, 0.0]
    assert float(s[3, 0]) == pytest.approx(3.0e38 / 448, rel=1e-6)


@settings(max_examples=50, deadline=None)
@given(rows=st.integers(1, 5), cols=st.integers(1, 64), log_mag=st.floats(-20, 20), seed=st.integers(0, 2**31 - 1))
def test_row_quantizer_error_bound_property(rows, cols, log_mag, seed):
    """Each nonzero row's largest code is 448; every code is within E4M3's half step of x / scale
    (2^-4 relative for normal codes, 2^-10 absolute for subnormal ones)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g, dtype=torch.float64) * 10.0 ** log_mag).to(torch.bfloat16)
    q, s = quantize_rows_fp8_torch(x)
    c = q.double()
    nonzero = x.float().abs().amax(1) > 0
    assert (c.abs().amax(1)[nonzero] == FP8_MAX).all()
    target = x.double() / s.double()
    err = (c - target).abs()
    normal = c.abs() >= 2.0 ** -6
    assert (err[normal] <= target.abs()[normal] * 2.0 ** -4 + 1e-12).all()
    assert (err[~normal] <= 2.0 ** -10 + 1e-12).all()


def test_row_quantizer_refuses_bad_input():
    with pytest.raises(ValueError, match=r"x must be 2-D \[M, K\] with contiguous rows, got shape \(2, 3, 4\)"):
        quantize_rows_fp8(torch.ones(2, 3, 4))
    with pytest.raises(ValueError, match="x must be bfloat16, float16 or float32, got torch.int32"):
        quantize_rows_fp8(torch.ones(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous rows"):
        quantize_rows_fp8(torch.ones(4, 6)[:, ::2])


def _scaled_mm_on_cpu() -> bool:
    try:
        a, b = torch.ones(2, 16).to(torch.float8_e4m3fn), torch.ones(8, 16).to(torch.float8_e4m3fn)
        torch._scaled_mm(a, b.t(), scale_a=torch.ones(2, 1), scale_b=torch.ones(1, 8), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.skipif(not _scaled_mm_on_cpu(), reason="this torch has no CPU torch._scaled_mm with row-wise scales")
def test_scaled_mm_product_vs_float64():
    """fp8_scaled_mm = float64 product of the quantized activations and dequantized weights, up to the
    bfloat16 output (max-norm 2^-7). Against the unquantized bf16 product (what the fp8 path changes):
    weights and activations each move by <= 2^-4 of themselves, ~2.5 % rms each (random rounding),
    so ~3.5 % over the product; bound 6 %, and above 1 % (the activations really are quantized)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=g).to(torch.bfloat16) * 0.02
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    x[3] = 0.0  # a zero row comes out exactly zero
    bias = torch.randn(96, generator=g).to(torch.bfloat16)
    q, s = quantize_fp8(w)
    got = fp8_scaled_mm(x, q, s, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (5, 96)
    xq, xs = quantize_rows_fp8_torch(x)
    ref = (xq.double() * xs.double()) @ dequantize_fp8(q, s, torch.float64).T + bias.double()
    assert float((got.double() - ref).abs().max() / ref.abs().max()) < 2.0 ** -7
    assert torch.equal(got[3], bias)
    with pytest.raises(ValueError, match=r"N and K divisible by 16, got weight shape \(10, 256\)"):
        fp8_scaled_mm(x, q[:10].contiguous(), s[:10].contiguous())
    dense = x.double() @ w.double().T + bias.double()
    live = [0, 1, 2, 4]
    rel = float((got[live].double() - dense[live]).norm() / (x[live].double() @ w.double().T).norm())
    assert 0.01 < rel < 0.06, rel


def test_gemm_path_by_row_count(monkeypatch):
    monkeypatch.delenv("DEEPINFER_FP8_GEMM", raising=False)
    assert SCALED_MM_MIN_ROWS > 2
    assert [gemm_path(m) for m in (2, SCALED_MM_MIN_ROWS - 1)] == ["w8a8", "w8a8"]
    assert [gemm_path(m) for m in (SCALED_MM_MIN_ROWS, 4096)] == ["scaled_mm", "scaled_mm"]
    monkeypatch.setenv("DEEPINFER_FP8_GEMM", "triton")
    assert gemm_path(4096) == "triton"
    monkeypatch.setenv("DEEPINFER_FP8_GEMM", "Scaled_MM")
    assert gemm_path(2) == "scaled_mm"
    monkeypatch.setenv("DEEPINFER_FP8_GEMM", "w8a8")
    assert gemm_path(4096) == "w8a8"
    monkeypatch.setenv("DEEPINFER_FP8_GEMM", "cutlass")
    with pytest.raises(ValueError, match=r"DEEPINFER_FP8_GEMM must be one of \['auto', 'triton', 'w8a8', "
                                         r"'scaled_mm'\], got 'cutlass'"):
        gemm_path(8)


def test_one_row_gemv_refuses_unknown_maths_and_small_mma_tiles(monkeypatch):
    pytest.importorskip("triton", reason="triton is not installed")
    from deepinfer.runtime.kernels.fp8_gemv import fp8_gemv

    q, s = quantize_fp8(torch.randn(32, 64))
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"math must be one of \['f32', 'f16', 'mma', 'f16bits'\], got 'int8'"):
        fp8_gemv(x, q, s, math="int8")
    with pytest.raises(ValueError, match="math='mma' needs BLOCK_N >= 16 and BLOCK_K >= 32, got 2, 64"):
        fp8_gemv(x, q, s, math="mma", config=(2, 64, 4, 1))
    monkeypatch.setenv("DEEPINFER_FP8_ONE_ROW_MATH", "fast")
    with pytest.raises(ValueError, match=r"DEEPINFER_FP8_ONE_ROW_MATH must be one of .*got 'fast'"):
        fp8_gemv(x, q, s)
