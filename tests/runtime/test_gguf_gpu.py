"""GGUF weights kept quantized on the GPU (issue 28): the load-time layout, the Triton kernels and the
layer, checked on the CPU (the kernels under Triton's interpreter, in a subprocess: it must be set
before triton loads) and on CUDA where there is one.

* ``gguf_layout.regroup``'s planes decode bitwise to ``gguf.quants.dequantize`` for every GPU type.
* The kernels (``gguf_gpu_check.py``): GEMV (plain, bias + residual, RMSNorm prologue, SiLU·mul
  input) and GEMM (2..64 rows, bias, a column slice of a wider output) against a float64 matmul of
  gguf's dequantization, within the bounds that script states.
* A tiny GGUF mixing all six types (``gguf_gpu_model_check.py``): the model with
  ``GGUFLinearCUDA`` layers gives the logits of the same file dequantized, prompt (GEMM) and one
  token (GEMV); a fused qkv whose parts differ in type (Q4_K + Q6_K) runs as two parts.
* ``DEEPINFER_GGUF_DENSE_ROWS``' weights decoded ahead (``models.gguf_dense_chain``,
  ``gguf_dense_chain_check.py``): a chain of four projections run as a forward pass, in and out
  of order, against gguf's dequantization in float64; on CUDA also captured in a graph and replayed.
* Bad input is a ValueError naming what is wrong; GGUF files on CUDA keep their quantization only
  with quantization="gguf", no dtype asked and not deterministic (opt-in: slower than bf16 yet).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from deepinfer.runtime.kernels.gguf_layout import GPU_TYPES, PACKED_SCALE_KINDS, GGUFPlanes, regroup

gguf = pytest.importorskip("gguf", reason="gguf is not installed")
HERE = Path(__file__).parent


def _run(script: str, *args: str, interpret: bool = True, **extra: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]), **extra}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, str(HERE / script), *args], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("ok"), proc.stdout[-2000:]
    return proc.stdout


@pytest.mark.parametrize("kind", GPU_TYPES)
def test_planes_decode_bitwise_to_gguf(kind):
    from gguf_gpu_check import random_blocks, reference_weight

    raw = random_blocks(kind, 12, 512, seed=3)
    planes = regroup(torch.from_numpy(raw), kind)
    assert torch.equal(planes.dequantize().double(), reference_weight(raw, kind, 12))
    # the layer's row selection (q/k unpermute, tensor-parallel shards) keeps every plane in step
    index = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    assert torch.equal(planes.permute_rows(index).dequantize(), planes.dequantize()[index])
    assert torch.equal(planes.rows(4, 9).dequantize(), planes.dequantize()[4:9])


# bits a weight of the planes: codes (4 packed, else 8) + per 32 (Q6_K: 16) the scale (and min), + per
# 256 the K-quants' d (and dmin); Q4_K/Q5_K pack scale+min and d+dmin in the same bytes
PLANE_BITS = {"Q4_0": 4 + 16 / 32, "Q4_1": 4 + 32 / 32, "Q8_0": 8 + 16 / 32, "Q4_K": 4 + 16 / 32 + 32 / 256,
              "Q5_K": 8 + 16 / 32 + 32 / 256, "Q6_K": 8 + 8 / 16 + 16 / 256}


@pytest.mark.parametrize("kind", GPU_TYPES)
def test_planes_take_the_bytes_of_their_fields_once(kind):
    """No plane is stored twice: Q4_K's packed scales replace its four planes (4.625 bits a weight)."""
    from gguf_gpu_check import random_blocks

    planes = regroup(torch.from_numpy(random_blocks(kind, 12, 512, seed=3)), kind)
    assert planes.nbytes() * 8 == PLANE_BITS[kind] * 12 * 512
    if kind in PACKED_SCALE_KINDS:  # unpacked: 6-bit scales and mins, float16 d and dmin (their values
        # are checked through dequantize() by test_planes_decode_bitwise_to_gguf)
        scale, minimum, d, dmin = planes.four_planes()
        assert planes.minimum is None and planes.dmin is None and minimum is not None and dmin is not None
        assert scale.dtype == minimum.dtype == torch.uint8 and int(max(scale.max(), minimum.max())) < 64
        assert d.dtype == dmin.dtype == torch.float16 and d.shape == dmin.shape == (12, 2)


def test_q6k_codes_at_6_bits_read_back_where_the_layout_puts_them(monkeypatch):
    """DEEPINFER_GGUF_Q6K_6BIT=1: Q6_K's codes as low nibbles packed as a 4-bit type's (byte j: columns
    j and j + K/2) and the high 2 bits in ``high`` (byte 8 (j // 16) + j % 8, bit 2 ((j // 8) % 2), + 4
    for column j + K/2), each code read back from there equal to gguf's; 6 bits a code in all."""
    from gguf.quants import dequantize
    from gguf_gpu_check import random_blocks

    raw = random_blocks("Q6_K", 12, 512, seed=5)
    plain = regroup(torch.from_numpy(raw), "Q6_K")
    assert plain.high is None and not plain.packed  # off by default: one byte a code
    monkeypatch.setenv("DEEPINFER_GGUF_Q6K_6BIT", "1")
    planes = regroup(torch.from_numpy(raw), "Q6_K")
    assert planes.high is not None and planes.packed
    assert planes.codes.shape == (12, 256) and planes.high.shape == (12, 128)
    assert (plain.nbytes() - planes.nbytes()) * 8 == 2 * 12 * 512
    assert torch.equal(planes.code_values(), plain.codes)
    index = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    assert torch.equal(planes.permute_rows(index).rows(2, 7).dequantize(), plain.dequantize()[index][2:7])
    low, high = planes.codes.numpy(), planes.high.numpy()
    # gguf's codes: the weights over their group scales (d * sc), plus the bias 32
    w = dequantize(raw, gguf.GGMLQuantizationType.Q6_K).reshape(12, 512).astype(np.float64)
    scale = np.repeat(planes.d.numpy().astype(np.float64), 16, axis=1) * planes.scale.numpy().astype(np.float64)
    want = np.rint(np.divide(w, np.repeat(scale, 16, axis=1), out=np.zeros_like(w),
                             where=np.repeat(scale, 16, axis=1) != 0)) + 32
    nonzero = np.repeat(scale, 16, axis=1) != 0
    for c in range(512):
        j, h = c % 256, c // 256
        code = ((low[:, j] >> (4 * h)) & 0x0F) | (((high[:, 8 * (j // 16) + j % 8] >> (2 * ((j // 8) % 2) + 4 * h))
                                                  & 0x03) << 4)
        assert np.array_equal(code[nonzero[:, c]], want[nonzero[:, c], c]), c
    assert torch.equal(planes.code_values()[torch.from_numpy(nonzero)].double(),
                       torch.from_numpy(want[nonzero]))


def test_q6k_at_6_bits_takes_the_packed_types_gemm_choices(monkeypatch):
    """Q6_K at 6 bits is tiled as a packed type (two decoded halves a K step): its several-row GEMM
    takes Q4_K's tile, swap and split choices, where one-byte Q6_K keeps its own (which differ: not
    swapped at 32 rows, three stages); DEEPINFER_GGUF_Q6K_6BIT_TUNING=byte gives it those back."""
    from deepinfer.runtime.kernels.gguf_gemv import gemm_swapped, gemm_tile_for, gemm_tuning_kind
    from gguf_gpu_check import random_blocks

    raw = torch.from_numpy(random_blocks("Q6_K", 4, 256, seed=2))
    one_byte = regroup(raw, "Q6_K")
    monkeypatch.setenv("DEEPINFER_GGUF_Q6K_6BIT", "1")
    six = regroup(raw, "Q6_K")
    assert (gemm_tuning_kind(one_byte), gemm_tuning_kind(six)) == ("Q6_K", "Q4_K")
    assert gemm_swapped("Q4_K", 32, False) and not gemm_swapped("Q6_K", 32, False)
    assert gemm_tile_for("Q4_K", 32, True)[4] == 2 and gemm_tile_for("Q6_K", 32, False)[4] == 3
    monkeypatch.setenv("DEEPINFER_GGUF_Q6K_6BIT_TUNING", "byte")
    assert gemm_tuning_kind(six) == "Q6_K"
    monkeypatch.setenv("DEEPINFER_GGUF_Q6K_6BIT_TUNING", "bits")
    with pytest.raises(ValueError, match="DEEPINFER_GGUF_Q6K_6BIT_TUNING"):
        gemm_tuning_kind(six)


def test_q6k_at_6_bits_k64_steps_only_its_own_k(monkeypatch):
    """DEEPINFER_GGUF_Q6K_6BIT_TUNING=packed-k64: a 6-bit Q6_K weight takes Q4_K's tiles with K
    steps of 64 where Q4_K's are wider; one-byte Q6_K, Q4_K itself and tiles already 64 wide keep
    theirs (the products under it: test_q6k_at_6_bits_matches_gguf_in_float64)."""
    from deepinfer.runtime.kernels.gguf_gemv import gemm_tile_for, gemm_weight_tile
    from gguf_gpu_check import random_blocks

    raw = torch.from_numpy(random_blocks("Q6_K", 32, 512, seed=3))
    one_byte = regroup(raw, "Q6_K")
    monkeypatch.setenv("DEEPINFER_GGUF_Q6K_6BIT", "1")
    six = regroup(raw, "Q6_K")
    monkeypatch.setenv("DEEPINFER_GGUF_Q6K_6BIT_TUNING", "packed-k64")
    q4k_32 = gemm_tile_for("Q4_K", 32, True)
    assert q4k_32[2] == 128  # what the switch narrows
    assert gemm_weight_tile(six, 32, True) == (*q4k_32[:2], 64, *q4k_32[3:])
    assert gemm_weight_tile(one_byte, 32, True) == gemm_tile_for("Q6_K", 32, True)
    assert gemm_weight_tile(six, 64, True) == gemm_tile_for("Q4_K", 64, True)  # 64 wide already
    monkeypatch.setenv("DEEPINFER_GGUF_Q6K_6BIT_TUNING", "packed")
    assert gemm_weight_tile(six, 32, True) == q4k_32


# the word GEMV with 8-bit and with float32 activations; the byte GEMV (DEEPINFER_GGUF_WORDS=0);
# the GEMM's default tiles with K steps of 64 (DEEPINFER_GGUF_Q6K_6BIT_TUNING=packed-k64)
@pytest.mark.parametrize(("words", "dp4a", "tuning"), [("1", "1", "packed"), ("1", "0", "packed"),
                                                       ("0", "0", "packed"), ("1", "1", "packed-k64")])
def test_q6k_at_6_bits_matches_gguf_in_float64(words, dp4a, tuning):
    """Every kernel on Q6_K's 6-bit planes (GEMVs with their tilings and fusions, GEMM plain, swapped
    and split, the whole-weight decode, MMQ) against float64, as gguf_gpu_check checks the others."""
    out = _run("gguf_gpu_check.py", "cpu", "quick", "Q6_K", DEEPINFER_GGUF_Q6K_6BIT="1", DEEPINFER_GGUF_WORDS=words,
               DEEPINFER_GGUF_DP4A=dp4a, DEEPINFER_GGUF_Q6K_6BIT_TUNING=tuning)
    assert "ok   Q6_K planes at 6 bits" in out, out[-3000:]


@pytest.mark.parametrize("kind", GPU_TYPES)
def test_quantizer_blocks_are_gguf_blocks_close_to_the_weights(kind):
    """The bench/test quantizer writes valid blocks: gguf reads them back within the type's step."""
    from gguf.quants import dequantize
    from gguf_quantizer import quantize

    w = torch.randn(6, 512, generator=torch.Generator().manual_seed(1)) * 0.02
    raw = quantize(w, kind).numpy()
    back = torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(6, 512).astype(np.float32))
    rel = float((back - w).norm() / w.norm())
    assert rel < {"Q8_0": 0.01, "Q6_K": 0.03, "Q5_K": 0.06}.get(kind, 0.12), rel


# (GEMV code words, scales broadcast per group, dp4a): float32 activations; the defaults (8-bit
# activations, dp4a emulated: the interpreter runs no PTX); the byte GEMV with tiled scales; the
# byte GEMV and the GEMM with scales gathered per column (the first version)
@pytest.mark.parametrize(("words", "tiled", "dp4a"), [("1", "1", "0"), ("1", "1", "1"), ("0", "1", "0"),
                                                      ("0", "0", "0")])
def test_kernels_match_gguf_dequantization_in_float64(words, tiled, dp4a):
    out = _run("gguf_gpu_check.py", "cpu", DEEPINFER_GGUF_WORDS=words, DEEPINFER_GGUF_TILED_SCALES=tiled,
               DEEPINFER_GGUF_DP4A=dp4a)
    # 6 types x (4 GEMV + 3 GEMV tilings + 1 narrow projection of K 4096 and its dp4a tile + 3 with
    # the first chunk preloaded or not + 1 row at an odd offset + 5 GEMM sizes + 2 of them swapped
    # + 1 of 150 rows swapped (3 row blocks) + 3 with K split 3 ways (6 rows plain and swapped, 1
    # row) + 1 slice plain, swapped and both split 2 ways + 3 of shapes the tiles divide (Q4_0,
    # Q4_1, Q8_0 with no weight masks: plain, swapped, swapped split 2) + 5 MMQ sizes + 1 MMQ slice + the weight
    # decoded whole and a layer of two types through it); with 8-bit activations also a residual
    # GEMV from activations stored by the kernel before it (three tilings) and 3 refusals
    stored = 6 * (3 + 3) if (words, dp4a) == ("1", "1") else 0
    assert out.count("ok  ") == 234 + stored, out[-3000:]


def test_mixed_type_model_matches_its_dequantized_self():
    # float32 activations (DEEPINFER_GGUF_DP4A=0): the same numbers as the dense model up to the
    # summation order; the 8-bit activations' bound is checked per kernel (gguf_gpu_check.py)
    out = _run("gguf_gpu_model_check.py", "cpu", DEEPINFER_GGUF_DP4A="0")
    assert "Q4_K+Q6_K" in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dp4a", ["0", "1"])  # 1: the PTX dp4a the CPU run emulates
def test_kernels_on_cuda(dp4a):
    _run("gguf_gpu_check.py", "cuda", interpret=False, DEEPINFER_GGUF_DP4A=dp4a)


def test_lean_word_gemv_gives_the_default_forms_bits():
    # DEEPINFER_GGUF_GEMV_LEAN=1 (experimental): where the tiles divide the weight, the form without
    # load masks and with chained dp4a; 6 types x (2 activation kinds x (4 tiles + the narrow tile
    # with a residual)) x (bound against float64 + taken and bitwise equal to the default form)
    out = _run("gguf_gpu_check.py", "cpu", "lean")
    assert out.count("ok  ") == 6 * 2 * 5 * 2 and "lean form taken (True), the default form's bits" in out, out[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_lean_word_gemv_on_cuda():
    _run("gguf_gpu_check.py", "cuda", "lean", interpret=False)


def test_dense_weight_refuses_a_dtype_it_cannot_write():
    from deepinfer.runtime.kernels.gguf_gemv import dense_weight
    from gguf_gpu_check import random_blocks

    planes = regroup(torch.from_numpy(random_blocks("Q4_0", 4, 64, seed=0)), "Q4_0")
    for dtype in (torch.int8, torch.float64):
        with pytest.raises(ValueError, match=f"dense_weight: dtype must be float32, float16 or bfloat16, got {dtype}"):
            dense_weight(planes, dtype)


@pytest.mark.parametrize("out", [torch.empty(4, 32), torch.empty(4, 64, dtype=torch.bfloat16),
                                 torch.empty(64, 4).T], ids=["shape", "dtype", "strided"])
def test_dense_weight_refuses_an_out_it_cannot_fill(out):
    from deepinfer.runtime.kernels.gguf_gemv import dense_weight
    from gguf_gpu_check import random_blocks

    planes = regroup(torch.from_numpy(random_blocks("Q4_0", 4, 64, seed=0)), "Q4_0")
    with pytest.raises(ValueError, match=r"dense_weight: out must be a contiguous \[4, 64\] torch.float32 on cpu"):
        dense_weight(planes, torch.float32, out=out)


def test_dense_tiles_fill_the_gpu_and_stop_at_8_rows():
    from deepinfer.runtime.kernels import gguf_gemv

    if gguf_gemv._INTERPRET:
        pytest.skip("TRITON_INTERPRET=1 decodes in one large tile (the interpreter's speed)")
    # hand-computed on 132 multiprocessors (the H200): SmolLM2's qkv [960, 288 code bytes] has
    # 3 column tiles, so 2 * 132 programs need 88 row tiles -> 8 rows (120); the 8B LM head
    # [128256, 2048] fills the GPU at 64 rows
    assert gguf_gemv.dense_tile(960, 288, 132) == (8, 128, 2)
    assert gguf_gemv.dense_tile(3072, 288, 132) == (32, 128, 4)
    assert gguf_gemv.dense_tile(128256, 2048, 132) == (64, 128, 4)
    assert gguf_gemv.dense_tile(16, 64, 132) == (8, 128, 2)  # never below 8 rows


def test_dense_chain_decodes_each_weight_ahead_in_its_turn():
    out = _run("gguf_dense_chain_check.py", "cpu")
    # 2 passes x (4 products + 1 count) + 4 out of order
    assert out.count("ok  ") == 14, out
    assert out.count("3 weights decoded ahead, 0 left pending") == 2, out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dense_chain_on_cuda_and_in_a_cuda_graph():
    out = _run("gguf_dense_chain_check.py", "cuda", interpret=False)
    assert "a pass captured in a CUDA graph and replayed equals the eager pass" in out, out


def test_dense_chain_refuses_a_projection_twice():
    from deepinfer.runtime.models.gguf_dense_chain import DenseChain
    from deepinfer.runtime.models.gguf_linear import GGUFLinearCUDA
    from gguf_gpu_check import random_blocks

    layer = GGUFLinearCUDA([regroup(torch.from_numpy(random_blocks("Q4_0", 4, 64, seed=0)), "Q4_0")])
    with pytest.raises(ValueError, match="DenseChain: a projection appears twice in the chain"):
        DenseChain([layer, layer])


def test_the_quantizer_refuses_rows_of_partial_blocks():
    from gguf_quantizer import quantize

    with pytest.raises(ValueError, match="K = 576, not a multiple of 256"):
        quantize(torch.zeros(4, 576), "Q4_K")  # SmolLM2's hidden size: no K-quants
    with pytest.raises(ValueError, match="not a multiple of 32"):
        quantize(torch.zeros(4, 48), "Q4_0")
    assert quantize(torch.zeros(4, 576), "Q4_0").shape == (4, 576 // 32 * 18)


def test_unsupported_type_and_width_are_value_errors():
    with pytest.raises(ValueError, match="Q2_K has no GPU kernel"):
        regroup(torch.zeros(1, 84, dtype=torch.uint8), "Q2_K")
    with pytest.raises(ValueError, match="not whole blocks of 144"):
        regroup(torch.zeros(2, 100, dtype=torch.uint8), "Q4_K")
    with pytest.raises(ValueError, match="multiple of 64"):
        regroup(torch.zeros(2, 18, dtype=torch.uint8), "Q4_0")  # 32 weights a row


def test_kernel_entry_points_refuse_bad_shapes():
    from deepinfer.runtime.kernels.gguf_gemv import gguf_gemm, gguf_gemv
    from gguf_gpu_check import random_blocks

    planes = regroup(torch.from_numpy(random_blocks("Q4_0", 8, 64, seed=0)), "Q4_0")
    with pytest.raises(ValueError, match="x has 32 columns"):
        gguf_gemv(torch.zeros(1, 32), planes)
    with pytest.raises(ValueError, match="one contiguous row"):
        gguf_gemv(torch.zeros(2, 64), planes)
    with pytest.raises(ValueError, match="residual must be one contiguous row"):
        gguf_gemv(torch.zeros(1, 64), planes, residual=torch.zeros(1, 9))
    with pytest.raises(ValueError, match="silu_mul and norm"):
        gguf_gemv(torch.zeros(1, 128), planes, silu_mul=True, norm=(torch.ones(64), 1e-5))
    with pytest.raises(ValueError, match="BLOCK_K a power of two"):
        gguf_gemv(torch.zeros(1, 64), planes, config=(4, 100, 4, 2))
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        gguf_gemm(torch.zeros(3, 63), planes)
    with pytest.raises(ValueError, match="bias must be a contiguous"):
        gguf_gemm(torch.zeros(3, 64), planes, torch.zeros(5))
    with pytest.raises(ValueError, match="split_k must be >= 0, got -1"):
        gguf_gemm(torch.zeros(3, 64), planes, split_k=-1)


def test_split_k_only_where_the_tiles_leave_multiprocessors_idle(monkeypatch):
    """choose_split_k on the 8B shapes (132 multiprocessors, 64 x 128-byte tiles), and its limits."""
    from deepinfer.runtime.kernels import gguf_gemv as gk

    assert gk.choose_split_k("Q4_0", 64, 32, 56, 132) == 6     # down at 32 rows: 64 tiles
    assert gk.choose_split_k("Q4_K", 64, 32, 56, 132) == 6
    assert gk.choose_split_k("Q4_0", 64, 33, 56, 132) == 4     # ... at more rows, 4 (6 for the heavier decode)
    assert gk.choose_split_k("Q4_K", 128, 64, 56, 132) == 6
    assert gk.choose_split_k("Q8_0", 96, 8, 32, 132) == 6      # qkv
    assert gk.choose_split_k("Q4_0", 96, 32, 16, 132) == 4     # ... 4-bit codes: 16 steps, at least 4 a split
    assert gk.choose_split_k("Q4_0", 448, 32, 16, 132) == 1    # gate_up at 32 rows: Q4_0's tiles fill one wave
    assert gk.choose_split_k("Q6_K", 448, 32, 32, 132) == 2
    assert gk.choose_split_k("Q5_K", 448, 16, 16, 132) == 3    # the heavier decode takes more
    assert gk.choose_split_k("Q6_K", 448, 64, 16, 132) == 1    # ... and not at 64 (the sweep)
    assert gk.choose_split_k("Q4_0", 1024, 8, 64, 132) == 1    # the tiles fill the GPU
    assert gk.choose_split_k("Q4_0", 64, 32, 9, 132) == 2      # at least SPLIT_K_MIN_STEPS steps a split
    assert gk.choose_split_k("Q4_0", 9, 256, 3, 132) == 1      # SmolLM2's few steps: no split
    assert gk.choose_split_k("Q4_0", 5, 4, 64, 0) == 1         # no multiprocessors: no split
    for tiles in (1, 7, 64, 263, 264, 527, 528, 1000):
        for rows in (2, 32, 33):
            for steps in (1, 3, 4, 9, 64):
                split = gk.choose_split_k("Q6_K", tiles, rows, steps, 132)
                assert split == 1 or split * gk.SPLIT_K_MIN_STEPS <= steps
                assert split == 1 or tiles < 264 or (tiles < 528 and rows <= 32)
    monkeypatch.setenv("DEEPINFER_GGUF_GEMM_SPLIT_K", "two")
    with pytest.raises(ValueError, match="DEEPINFER_GGUF_GEMM_SPLIT_K='two' is not an integer"):
        gk.gemm_split_k()


def test_few_row_gemm_tile_by_type_and_row_count():
    """``gemm_tile_for``: swapped, up to 32 rows, Q4_0 takes two pipeline stages at any row count
    and Q4_K from 17 rows (the end-to-end A/Bs in guide 08), the other types three; more rows and
    the plain tile as before. (Its products: gguf_gpu_check.py's swapped GEMM cases of 3 and 17
    rows take these tiles; the interpreter ignores the stages, a GPU run does not.)"""
    from deepinfer.runtime.kernels.gguf_gemv import gemm_tile_for

    two, three = (32, 64, 128, 4, 2), (32, 64, 128, 4, 3)
    assert gemm_tile_for("Q4_0", 1, True) == gemm_tile_for("Q4_0", 32, True) == two
    assert gemm_tile_for("Q4_K", 16, True) == three and gemm_tile_for("Q4_K", 17, True) == two
    assert gemm_tile_for("Q6_K", 32, True) == gemm_tile_for("Q5_K", 20, True) == three
    # above 32 rows 64-byte K steps in two stages, but Q8_0's 128 in three
    assert gemm_tile_for("Q4_0", 33, True) == gemm_tile_for("Q4_K", 1024, True) == (64, 64, 64, 4, 2)
    assert gemm_tile_for("Q4_1", 256, True) == gemm_tile_for("Q6_K", 256, True) == (64, 64, 64, 4, 2)
    assert gemm_tile_for("Q8_0", 33, True) == gemm_tile_for("Q8_0", 1024, True) == (64, 64, 128, 4, 3)
    assert gemm_tile_for("Q4_0", 32, False) == three and gemm_tile_for("Q4_K", 33, False) == (64, 64, 64, 4, 3)



def test_gemm_swaps_where_measured(monkeypatch):
    """``gemm_swapped``: above 32 rows up to DEEPINFER_GGUF_GEMM_SWAP_ROWS every type; up to 32
    rows the K-quants Q4_K and Q5_K, and Q4_0 only while a CUDA graph is captured."""
    from deepinfer.runtime.kernels.gguf_gemv import gemm_swapped

    monkeypatch.delenv("DEEPINFER_GGUF_GEMM_SWAP_ROWS", raising=False)
    assert not gemm_swapped("Q4_0", 32, False) and gemm_swapped("Q4_0", 32, True)
    assert gemm_swapped("Q4_K", 8, False) and gemm_swapped("Q5_K", 32, False)
    assert not gemm_swapped("Q6_K", 32, True) and gemm_swapped("Q6_K", 33, False)
    assert gemm_swapped("Q8_0", 1024, False) and not gemm_swapped("Q8_0", 1025, False)
    monkeypatch.setenv("DEEPINFER_GGUF_GEMM_SWAP_ROWS", "0")
    assert not gemm_swapped("Q4_K", 8, True)


def test_mmq_refuses_what_it_cannot_multiply():
    from deepinfer.runtime.kernels.gguf_mmq import gguf_mmq, mmq_supports, quantize_rows
    from gguf_gpu_check import random_blocks

    q8 = regroup(torch.from_numpy(random_blocks("Q8_0", 3, 96, seed=0)), "Q8_0")
    assert mmq_supports(q8)  # (the layout itself refuses 4-bit rows whose K/2 is not whole 32-byte groups)

    def rows(m: int, k: int):  # quantize_rows' output shapes, without running its kernel here
        return torch.zeros(m, k, dtype=torch.int8), torch.zeros(m, k // 32), torch.zeros(m, k // 32)

    with pytest.raises(ValueError, match="the activations have 64 columns, the Q8_0 weight 96"):
        gguf_mmq(rows(2, 64), q8)
    with pytest.raises(ValueError, match="K a multiple of 32"):
        quantize_rows(torch.randn(2, 40))
    with pytest.raises(ValueError, match=r"out must be \[2, 3\]"):
        gguf_mmq(rows(2, 96), q8, out=torch.empty(3, 3))
    with pytest.raises(ValueError, match=r"bias must be a contiguous \[3\] vector"):
        gguf_mmq(rows(2, 96), q8, torch.zeros(4))


def test_layer_merges_runs_of_one_type_and_names_its_types(monkeypatch):
    from deepinfer.runtime.models.gguf_linear import GGUFLinearCUDA
    from gguf_gpu_check import random_blocks

    def part(kind: str, rows: int) -> GGUFPlanes:
        return regroup(torch.from_numpy(random_blocks(kind, rows, 256, seed=rows)), kind)

    layer = GGUFLinearCUDA([part("Q4_K", 8), part("Q4_K", 4), part("Q6_K", 4)])
    assert [p.n for p in layer.parts] == [12, 4] and layer.offsets == [0, 12]
    assert layer.weight_type == "Q4_K+Q6_K"
    monkeypatch.delenv("DEEPINFER_GGUF_DP4A", raising=False)
    monkeypatch.delenv("DEEPINFER_GGUF_WORDS", raising=False)
    monkeypatch.delenv("DEEPINFER_GGUF_MMQ_ROWS", raising=False)
    monkeypatch.delenv("DEEPINFER_GGUF_GEMM_DECODE", raising=False)
    monkeypatch.delenv("DEEPINFER_GGUF_DENSE_ROWS", raising=False)
    # auto: a model of hidden size <= 1024 (here an unchained layer of K = 256) decodes whole weights from 64 rows
    assert layer.kernel_path == ("triton gguf word gemv, 8-bit activations (dp4a) (one row) / gemm, bf16 decode "
                                 "(below 64 rows) / decoded weight + cuBLAS (64 rows or more)")
    monkeypatch.setenv("DEEPINFER_GGUF_DENSE_ROWS", "0")
    assert layer.kernel_path == ("triton gguf word gemv, 8-bit activations (dp4a) (one row) / gemm, bf16 decode "
                                 "(more rows)")
    monkeypatch.setenv("DEEPINFER_GGUF_GEMM_DECODE", "f32")
    assert layer.kernel_path == "triton gguf word gemv, 8-bit activations (dp4a) (one row) / gemm (more rows)"
    monkeypatch.setenv("DEEPINFER_GGUF_DP4A", "0")
    monkeypatch.setenv("DEEPINFER_GGUF_MMQ_ROWS", "64")
    assert layer.kernel_path == ("triton gguf word gemv, float32 activations (one row) / int8 tensor-core mmq, "
                                 "8-bit activations (2-64 rows) / gemm (more rows)")
    monkeypatch.setenv("DEEPINFER_GGUF_MMQ_ROWS", "0")
    assert layer.kernel_path == "triton gguf word gemv, float32 activations (one row) / gemm (more rows)"
    # Q8_0's signed bytes do not fit bf16's mantissa: its parts keep the float32 decode
    monkeypatch.delenv("DEEPINFER_GGUF_GEMM_DECODE")
    mixed = GGUFLinearCUDA([part("Q4_0", 4), part("Q8_0", 4)])
    assert mixed.kernel_path.endswith("/ gemm, bf16 decode of Q4_0 (more rows)"), mixed.kernel_path
    assert GGUFLinearCUDA([part("Q8_0", 4)]).kernel_path.endswith("/ gemm (more rows)")
    monkeypatch.setenv("DEEPINFER_GGUF_GEMM_DECODE", "fp8")
    with pytest.raises(ValueError, match="DEEPINFER_GGUF_GEMM_DECODE"):
        layer.kernel_path  # noqa: B018
    monkeypatch.delenv("DEEPINFER_GGUF_GEMM_DECODE")
    monkeypatch.setenv("DEEPINFER_GGUF_MMQ_ROWS", "many")
    with pytest.raises(ValueError, match=r"DEEPINFER_GGUF_MMQ_ROWS='many' is not an integer \(default 0: "):
        layer.kernel_path  # noqa: B018
    monkeypatch.setenv("DEEPINFER_GGUF_MMQ_ROWS", "-1")
    with pytest.raises(ValueError, match="DEEPINFER_GGUF_MMQ_ROWS=-1 must be at least 0"):
        layer.kernel_path  # noqa: B018
    assert layer.out_features == 16 and layer.in_features == 256
    with pytest.raises(ValueError, match="one width"):
        GGUFLinearCUDA([part("Q4_K", 8), regroup(torch.from_numpy(random_blocks("Q4_K", 4, 512, seed=1)), "Q4_K")])


def test_gemm_swap_rows_switch(monkeypatch):
    from deepinfer.runtime.kernels.gguf_gemv import gemm_swap_rows

    monkeypatch.delenv("DEEPINFER_GGUF_GEMM_SWAP_ROWS", raising=False)
    assert gemm_swap_rows() == 1024
    monkeypatch.setenv("DEEPINFER_GGUF_GEMM_SWAP_ROWS", "0")
    assert gemm_swap_rows() == 0
    monkeypatch.setenv("DEEPINFER_GGUF_GEMM_SWAP_ROWS", "many")
    with pytest.raises(ValueError, match="DEEPINFER_GGUF_GEMM_SWAP_ROWS='many' is not an integer"):
        gemm_swap_rows()
    monkeypatch.setenv("DEEPINFER_GGUF_GEMM_SWAP_ROWS", "-1")
    with pytest.raises(ValueError, match="DEEPINFER_GGUF_GEMM_SWAP_ROWS=-1 must be at least 0"):
        gemm_swap_rows()


@pytest.mark.parametrize("device,dtype,deterministic,quantization,want", [
    ("cuda", None, False, "gguf", True), ("cuda", None, False, None, False),  # opt-in on CUDA (slower than bf16 yet)
    ("cuda", "bfloat16", False, "gguf", False), ("cuda", None, True, "gguf", False),
    ("cpu", None, False, None, True), ("cpu", None, True, None, True), ("cpu", None, False, "gguf", True),
    ("mps", None, False, "gguf", False)])
def test_which_loads_keep_the_gguf_quantization(tmp_path, device, dtype, deterministic, quantization, want):
    from deepinfer.runtime.engine_args import EngineArgs
    from deepinfer.runtime.worker.worker import keeps_gguf_quantization

    path = tmp_path / "m.gguf"
    path.write_bytes(b"")
    args = EngineArgs(dtype=dtype, deterministic=deterministic, quantization=quantization)
    assert keeps_gguf_quantization(args, torch.device(device), str(path)) is want
    assert keeps_gguf_quantization(args, torch.device(device), str(tmp_path)) is False  # a directory


def test_quantization_gguf_is_refused_where_it_cannot_run(tmp_path):
    """``quantization="gguf"`` names a GGUF file's own blocks: a checkpoint directory, a missing
    file or several tensor-parallel ranks are ValueErrors naming the option."""
    from deepinfer.runtime.loading.quantization import check_quantization

    path = tmp_path / "m.gguf"
    path.write_bytes(b"")
    check_quantization("gguf", torch.device("cpu"), str(path))  # a GGUF file on the CPU: accepted
    with pytest.raises(ValueError, match="quantization='gguf'.*is not a GGUF file"):
        check_quantization("gguf", torch.device("cpu"), str(tmp_path))
    with pytest.raises(ValueError, match="quantization='gguf'.*is not a GGUF file"):
        check_quantization("gguf", torch.device("cpu"), str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="quantization='gguf' runs on one rank"):
        check_quantization("gguf", torch.device("cpu"), str(path), tensor_parallel_size=2)


def test_gemm_decode_switch_is_checked_and_off_where_no_ptx_runs(monkeypatch):
    """``DEEPINFER_GGUF_GEMM_DECODE`` picks the GEMM's decode: a value other than bf16/f32 is a
    ValueError naming the switch before any launch; CPU tensors (Triton's interpreter, which runs no
    PTX) and Q8_0 never take the bf16 decode (its GPU cases are in gguf_gpu_check.py)."""
    from deepinfer.runtime.kernels.gguf_gemv import bf16_codes, gguf_gemm
    from gguf_gpu_check import random_blocks

    planes = {kind: regroup(torch.from_numpy(random_blocks(kind, 4, 256, seed=1)), kind) for kind in ("Q4_0", "Q8_0")}
    monkeypatch.setenv("DEEPINFER_GGUF_GEMM_DECODE", "fp16")
    with pytest.raises(ValueError, match="DEEPINFER_GGUF_GEMM_DECODE"):
        gguf_gemm(torch.zeros(3, 256, dtype=torch.bfloat16), planes["Q4_0"])
    for value in ("bf16", "f32"):
        monkeypatch.setenv("DEEPINFER_GGUF_GEMM_DECODE", value)
        assert not any(bf16_codes(p, torch.bfloat16) for p in planes.values())  # CPU planes


def test_gemm_drops_its_weight_masks_only_where_measured_and_the_tiles_divide():
    """``unmasked_tiles``: the types without super-blocks whose code plane the tiles divide; the
    K-quants keep their masks (Q4_K_M lost 0.5 % without them on the H100)."""
    from deepinfer.runtime.kernels.gguf_gemv import unmasked_tiles
    from gguf_gpu_check import random_blocks

    def planes(kind: str, rows: int, k: int) -> GGUFPlanes:
        return regroup(torch.from_numpy(random_blocks(kind, rows, k, seed=2)), kind)

    assert unmasked_tiles(planes("Q4_0", 32, 256), 16, 32)  # 32 rows by 16, 128 code bytes by 32
    assert unmasked_tiles(planes("Q8_0", 32, 256), 16, 128)  # 256 code bytes by 128
    assert not unmasked_tiles(planes("Q4_0", 40, 256), 16, 32)  # 40 rows: a ragged row tile
    assert not unmasked_tiles(planes("Q4_0", 32, 256), 16, 256)  # 128 code bytes in 256-byte steps
    assert not any(unmasked_tiles(planes(kind, 32, 256), 16, 32) for kind in ("Q4_K", "Q5_K", "Q6_K"))


def test_dense_rows_by_model_size(monkeypatch):
    """``DEEPINFER_GGUF_DENSE_ROWS``: auto takes the decoded weight from 64 rows up to hidden size 1024,
    from 256 up to 4096, never above (the H100 measurements of guide 08); a number applies to every
    model; anything else is a ValueError naming the switch."""
    from deepinfer.runtime.kernels.gguf_gemv import dense_rows

    monkeypatch.delenv("DEEPINFER_GGUF_DENSE_ROWS", raising=False)
    assert [dense_rows(h) for h in (576, 1024, 1025, 2048, 4096, 4097, 8192)] == [64, 64, 256, 256, 256, 0, 0]
    assert dense_rows(None) == 0  # a model auto was not measured on (a mixture of experts' attention)
    monkeypatch.setenv("DEEPINFER_GGUF_DENSE_ROWS", " Auto ")
    assert dense_rows(8192) == 0 and dense_rows(576) == 64
    monkeypatch.setenv("DEEPINFER_GGUF_DENSE_ROWS", "32")
    assert dense_rows(576) == 32 and dense_rows(8192) == 32 and dense_rows(None) == 32
    monkeypatch.setenv("DEEPINFER_GGUF_DENSE_ROWS", "0")
    assert dense_rows(576) == 0
    for bad in ("sometimes", "-1"):
        monkeypatch.setenv("DEEPINFER_GGUF_DENSE_ROWS", bad)
        with pytest.raises(ValueError, match="DEEPINFER_GGUF_DENSE_ROWS"):
            dense_rows(576)


def test_a_chained_layer_takes_its_models_hidden_size():
    """A chained projection goes by its model's hidden size: layer 0's qkv width where every layer's
    MLP is a GGUF projection (so a down projection, K = intermediate size, follows its model's
    rule), else None (auto: never); the GGUF LM head (outside the chain) by the same; a layer of no
    model by its own input width."""
    from deepinfer.runtime.models.gguf_linear import GGUFLinearCUDA, chain_model
    from gguf_gpu_check import random_blocks
    from torch import nn

    def layer(rows: int, k: int) -> GGUFLinearCUDA:
        return GGUFLinearCUDA([regroup(torch.from_numpy(random_blocks("Q8_0", rows, k, seed=rows)), "Q8_0")])

    def model(moe: bool) -> nn.Module:
        m = nn.Module()
        m.quantized_head = layer(16, 512)  # (narrower than the model, to tell the two widths apart)
        blocks = nn.ModuleList()
        for _ in range(2):
            block = nn.Module()
            block.qkv_proj, block.o_proj = layer(8, 1024), layer(4, 256)
            if not moe:
                block.gate_up_proj, block.down_proj = layer(8, 1024), layer(4, 4096)
            blocks.append(block)
        m.layers = blocks
        return m

    assert layer(4, 768).model_hidden_size == 768
    dense = model(moe=False)
    assert dense.quantized_head.model_hidden_size == 512  # its own width until the model is chained
    chain = chain_model(dense)
    assert len(chain.layers) == 8 and all(p.model_hidden_size == 1024 for p in chain.layers)
    down = dense.layers[1].down_proj
    assert down.dense_chain is chain and down.model_hidden_size == 1024
    assert dense.quantized_head.dense_chain is None and dense.quantized_head.model_hidden_size == 1024
    moe = model(moe=True)
    assert all(p.model_hidden_size is None for p in chain_model(moe).layers)
    assert moe.layers[0].qkv_proj.model_hidden_size is None
    assert moe.quantized_head.model_hidden_size is None
