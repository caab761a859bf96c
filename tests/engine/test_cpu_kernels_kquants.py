"""deepinfer_engine._cpu_kernels on the types of a Q4_K_M file: the K-quants Q4_K, Q5_K, Q6_K (run
in ggml's super-block layout as stored) and Q5_0 (widened to Q8_0's layout at registration).

* GEMV against the float64 product with the weight dequantized by ``gguf.quants`` (not our
  decoder), for random blocks, random shapes, 1-64 activation rows, every instruction set this CPU
  runs (``isa=`` forces each table), 1 and 2 threads. Stated bound: the activations are rounded to
  8 bits per block of 32 (error <= max|x_block| / 254 per value), so
  |y - x W^T| <= sum over blocks of max|x_block| / 254 * sum|W_block|, plus 1e-5 sum|x||W| of
  float32 summation slack. The weights are used exactly: with activations already on their 8-bit
  grid (integers, each block's maximum 127) the products agree with float64 to float32 summation.
* ``dequantize`` (the embedding lookup's values) bitwise equal to ``gguf.quants``' float32 result.
* Every ISA agrees with the generic kernels (same integer dots; float order only).
* Bad input: a row that is not whole super-blocks is a ValueError naming the weight and type.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

# (skips this module too where the engine has no _cpu_kernels or gguf is missing)
from test_cpu_kernels import assert_linear_within_bound, assert_rows_as_alone, ck

# type -> (weights per block, bytes per block)
LAYOUT = {"Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "Q5_0": (32, 22)}
ISAS = ck.available_isas()
SHAPES = [(96, 256), (40, 512), (33, 1536), (17, 768), (130, 2048), (1, 256)]
ROWS = (1, 2, 3, 4, 5, 7, 16, 33, 64)


def random_blocks(rng: np.random.Generator, kind: str, n: int, k: int) -> np.ndarray:
    """[n, bytes] of random codes and scales, with fp16 super-scales small and finite."""
    bw, bb = LAYOUT[kind]
    raw = rng.integers(0, 256, (n, k // bw * bb), dtype=np.uint8)
    blocks = raw.reshape(n, k // bw, bb)

    def f16(shape, scale):
        return (rng.random(shape) * scale).astype(np.float16).view(np.uint8)

    if kind in ("Q4_K", "Q5_K"):  # d, dmin at 0 and 2 (sub-block scales/mins 0..63 are bytes)
        blocks[..., 0:2] = f16((n, k // bw, 1), 1e-3)
        blocks[..., 2:4] = f16((n, k // bw, 1), 1e-3)
    elif kind == "Q6_K":  # d at 208 (scales: int8 bytes)
        blocks[..., 208:210] = f16((n, k // bw, 1), 1e-3)
    else:  # Q5_0: d at 0
        blocks[..., 0:2] = f16((n, k // bw, 1), 0.02)
    return raw


def dequantized(kind: str, raw: np.ndarray, dtype=np.float64) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(raw, GGMLQuantizationType[kind]).astype(dtype)


@pytest.mark.parametrize("kind", sorted(LAYOUT))
def test_gemv_within_the_activation_rounding_bound(kind):
    rng = np.random.default_rng(28)
    # Q5_0 (blocks of 32): odd block counts too (a regrouped row's last block stands alone)
    for n, k in SHAPES + ([(9, 96), (5, 32), (20, 608)] if LAYOUT[kind][0] == 32 else []):
        raw = random_blocks(rng, kind, n, k)
        w = dequantized(kind, raw)
        for rows in ROWS:
            assert_linear_within_bound(kind, raw, w, rng.standard_normal((rows, k)).astype(np.float32))


@pytest.mark.parametrize("kind", sorted(LAYOUT))
def test_weights_are_used_exactly(kind):
    """Activations on their own 8-bit grid (integers in [-127, 127], every block reaching 127)
    quantize without error: the product is then x W^T to float32 summation error -- a wrong code,
    scale, min or sub-block order would be far off."""
    rng = np.random.default_rng(5)
    for (n, k), rows in itertools.product([(48, 1024)] + ([(7, 224)] if LAYOUT[kind][0] == 32 else []), (1, 4, 9)):
        raw = random_blocks(rng, kind, n, k)
        w = dequantized(kind, raw)
        x = rng.integers(-127, 128, (rows, k)).astype(np.float32)
        x[:, ::32] = 127
        ref = x.astype(np.float64) @ w.T
        tol = 2e-6 * (np.abs(x).astype(np.float64) @ np.abs(w).T) + 1e-30
        for isa in ISAS:
            y = ck.linear((kind, raw), x, isa=isa)
            assert (np.abs(y - ref) <= tol).all(), f"{kind} rows={rows} {isa}: {np.abs(y - ref).max()}"


@pytest.mark.parametrize("kind", sorted(LAYOUT))
def test_isas_agree_with_the_generic_kernels(kind):
    rng = np.random.default_rng(11)
    raw = random_blocks(rng, kind, 70, 1280)
    x = rng.standard_normal((6, 1280)).astype(np.float32)
    generic = ck.linear((kind, raw), x, isa="generic")
    scale = float(np.abs(generic).max())
    for isa in ISAS:
        np.testing.assert_allclose(ck.linear((kind, raw), x, isa=isa, num_threads=2), generic,
                                   rtol=0, atol=1e-5 * scale, err_msg=isa)


@pytest.mark.parametrize("kind", sorted(LAYOUT))
def test_a_row_is_bitwise_the_same_in_any_tile(kind):
    """As test_cpu_kernels' test of Q4_0/Q4_1/Q8_0: rows go through tiles of 1-4 rows (registers)
    or 5-8 (codes unpacked once per tile) on AVX2, of 1-8 on AVX-512, and a row's output must not
    depend on which (2..20 rows: every tile size, 16 rows, tiles after full ones). Weights of 37
    and 18 rows: the AVX-512 table's groups of 16 weight rows and the rows after them. Q5_0 rows of
    whole groups of 8 blocks (the AVX2 table's fifth-bit planes), of blocks after the last group,
    and an odd last block."""
    rng = np.random.default_rng(12)
    shapes = [(37, 576), (11, 608), (9, 256)] if LAYOUT[kind][0] == 32 else [(37, 512), (18, 1536)]
    for n, k in shapes:
        assert_rows_as_alone(kind, random_blocks(rng, kind, n, k), rng.standard_normal((20, k)).astype(np.float32))


@pytest.mark.parametrize("kind", sorted(LAYOUT) + ["Q4_0", "Q4_1", "Q8_0"])
def test_dequantize_is_bitwise_gguf_quants(kind):
    rng = np.random.default_rng(3)
    bw, bb = LAYOUT.get(kind, (32, {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}.get(kind)))
    raw = rng.integers(0, 256, (9, 4 * 256 // bw * bb), dtype=np.uint8)
    blocks = raw.reshape(9, -1, bb)
    # finite fp16 scales everywhere (random bytes can be NaN/inf)
    for at in {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q4_1": (0, 2)}.get(kind, (0,)):
        blocks[..., at:at + 2] = (rng.standard_normal(blocks.shape[:2] + (1,)) * 0.01).astype(np.float16).view(np.uint8)
    got = ck.dequantize((kind, raw))
    want = dequantized(kind, raw, np.float32)
    assert got.dtype == np.float32 and got.shape == want.shape == (9, 1024)
    np.testing.assert_array_equal(got, want)


def test_bad_k_quant_input_is_a_clear_error():
    x = np.zeros((1, 256), np.float32)
    with pytest.raises(ValueError, match=r"weight: rows of 145 bytes are not whole 144-byte blocks of 256 weights \(Q4_K\)"):
        ck.linear(("Q4_K", np.zeros((2, 145), np.uint8)), x)
    with pytest.raises(ValueError, match="weight type must be one of .*Q6_K.*got 'Q3_K'"):
        ck.linear(("Q3_K", np.zeros((2, 110), np.uint8)), x)
    with pytest.raises(ValueError, match="x: expected 512 columns"):
        ck.linear(("Q6_K", np.zeros((2, 420), np.uint8)), x)
    with pytest.raises(TypeError, match="weight: expected dtype uint8"):
        ck.dequantize(("Q5_K", np.zeros((2, 176), np.int8)))


def test_weight_kernels_name_the_table_that_runs_each_type():
    for isa in ISAS:
        table = ck.weight_kernels(isa)
        assert set(table) == {"F32", "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}
        for kind, runs in table.items():
            assert runs == isa, (isa, kind, runs)  # every table runs every type itself
    assert ck.weight_kernels() == ck.weight_kernels(ck.best_isa())
    with pytest.raises(ValueError, match="isa must be"):
        ck.weight_kernels("sse2")
