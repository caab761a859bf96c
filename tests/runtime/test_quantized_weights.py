"""GGUF block decoding and the quantized CPU layers, against gguf's numpy reference.

* ``gguf_blocks.dequantize_torch`` and the engine's native decoder (``dequantize_native``) are
  bitwise ``gguf.quants.dequantize`` (random blocks of every decoded type, with sane fp16 scales).
* The int4 form of each type dequantizes to the same weights (exactly for float32 scales).
* ``Int4Linear`` matches ``x @ W.T`` with the dequantized float32 W within the stated tolerance:
  its activations and outputs are bfloat16, so each output is off by at most about
  ``2**-8 * sum_k |x_k W_nk| + |y| * 2**-8`` (input rounding plus output rounding); we assert
  ``|y - ref| <= 2**-7 * (|x| @ |W|.T) + 1e-6``.
* Our packing is what ``aten._convert_weight_to_int4pack_for_cpu`` produces, under every
  instruction set aten dispatches to (its layout differs: 64-row blocks with AVX-512, 32 with
  AVX2, another without either): the tests run again with ``ATEN_CPU_CAPABILITY`` forced.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from deepinfer.runtime.kernels import gguf_blocks
from deepinfer.runtime.models.quantized import Int4Linear, Q8Embedding, pack_int4, packed_row_block
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

_SCALE_BYTES = {  # byte offsets of fp16 scales inside a block (set to sane values in random blocks)
    "Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_0": [0], "Q5_K": [0, 2], "Q6_K": [208],
}
_NATIVE_BLOCK_BYTES = {**gguf_blocks._BLOCK_BYTES, "Q5_K": 176}


def random_blocks(kind: str, rows: int, k: int, seed: int) -> np.ndarray:
    """Raw GGUF bytes [rows, bytes per row] of random codes with fp16 scales in [0.001, 0.05]."""
    rng = np.random.default_rng(seed)
    per = _NATIVE_BLOCK_BYTES[kind]
    block = 256 if kind.endswith("_K") else 32
    raw = rng.integers(0, 256, size=(rows, k // block, per), dtype=np.uint8)
    for off in _SCALE_BYTES[kind]:
        scales = rng.uniform(0.001, 0.05, size=(rows, k // block)).astype(np.float16)
        raw[..., off:off + 2] = scales.view(np.uint8).reshape(rows, k // block, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q4_K"])
def test_torch_decoding_is_bitwise_gguf(kind):
    k = 512
    raw = random_blocks(kind, 24, k, seed=1)
    ours = gguf_blocks.dequantize_torch(torch.from_numpy(raw), kind)
    ref = gguf_dequantize(raw, GGMLQuantizationType[kind]).reshape(24, k)
    assert ours is not None
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32)))


@pytest.mark.parametrize("kind", list(gguf_blocks.NATIVE_DEQUANTIZE_TYPES))
def test_native_decoding_is_bitwise_gguf(kind):
    """The engine's native decoder, which ``dequantize`` takes where the wheel has it: bitwise
    ``gguf.quants`` for every type it decodes (random codes, sane fp16 scales)."""
    pytest.importorskip("deepinfer_engine._cpu_kernels", reason="the engine wheel has no CPU kernels")
    k = 512
    raw = random_blocks(kind, 24, k, seed=3)
    ours = gguf_blocks.dequantize_native(torch.from_numpy(raw), kind)
    ref = gguf_dequantize(raw, GGMLQuantizationType[kind]).reshape(24, k)
    assert ours is not None and ours.dtype == torch.float32
    np.testing.assert_array_equal(ours.numpy(), np.ascontiguousarray(ref, dtype=np.float32))


def test_dequantize_takes_the_native_decoder_and_else_torch(monkeypatch):
    """``dequantize`` of a quantized tensor goes through the native decoder where the wheel has
    it, and through the torch decoders (the same bits) where it has not."""
    from types import SimpleNamespace

    raw = random_blocks("Q5_0", 8, 256, seed=4)
    tensor = SimpleNamespace(tensor_type=GGMLQuantizationType.Q5_0, shape=[256, 8], data=raw.reshape(-1))
    ref = np.ascontiguousarray(gguf_dequantize(raw, GGMLQuantizationType.Q5_0), dtype=np.float32).reshape(8, 256)
    calls = []
    native = gguf_blocks.dequantize_native
    monkeypatch.setattr(gguf_blocks, "dequantize_native", lambda r, k: calls.append(k) or native(r, k))
    np.testing.assert_array_equal(gguf_blocks.dequantize(tensor).numpy(), ref)
    assert calls == ["Q5_0"]
    monkeypatch.setattr(gguf_blocks, "dequantize_native", lambda r, k: None)  # a wheel without CPU kernels
    np.testing.assert_array_equal(gguf_blocks.dequantize(tensor).numpy(), ref)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q4_K"])
def test_int4_form_is_the_same_weight(kind):
    raw = torch.from_numpy(random_blocks(kind, 16, 256, seed=2))
    parts = gguf_blocks.int4_groups(raw, kind)
    assert len(parts) == (2 if kind == "Q8_0" else 1)
    for p in parts:
        assert p.q.dtype == torch.uint8 and int(p.q.max()) <= 15
    dense = gguf_blocks.dequantize_torch(raw, kind)
    torch.testing.assert_close(sum(p.dequantize() for p in parts), dense, rtol=1e-6, atol=1e-6)


def test_types_without_int4_form_are_refused():
    with pytest.raises(ValueError, match="Q6_K"):
        gguf_blocks.int4_groups(torch.zeros(1, 210, dtype=torch.uint8), "Q6_K")


@pytest.mark.parametrize("n,k", [(64, 128), (960, 576), (96, 64), (32, 32)])
def test_packing_matches_aten(n, k):
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(n + k))
    assert torch.equal(pack_int4(q), torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1))


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_bf16_weight_is_the_int4_form_rounded_to_bfloat16(kind):
    """The long-prefill branch's decoded weight: ``(q - 8)·s + z`` per group of 32, each step
    rounded to bfloat16 as the kernel's inputs are, in the Hugging Face row order."""
    raw = torch.from_numpy(random_blocks(kind, 192, 96, seed=5))
    parts = gguf_blocks.int4_groups(raw, kind)
    layer = Int4Linear(parts)
    expected = torch.cat([(p.q.to(torch.bfloat16) - 8) * p.scale.to(torch.bfloat16).repeat_interleave(32, 1)
                          + p.zero.to(torch.bfloat16).repeat_interleave(32, 1) for p in parts])
    if packed_row_block() is not None:
        assert torch.equal(layer.bf16_weight(), expected)
    else:  # a layout decoded by the kernel itself (float32 math, one rounding): within two bf16 steps
        size = torch.cat([(p.q.float() - 8).abs() * p.scale.float().abs().repeat_interleave(32, 1)
                          + p.zero.float().abs().repeat_interleave(32, 1) for p in parts])  # the terms' size
        excess = (layer.bf16_weight().float() - expected.float()).abs() - 2.0 ** -6 * size
        assert float(excess.max()) <= 1e-6


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), ":").split(":", 1)[1].split())
    except OSError:
        return set()


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_every_instruction_set_layout_of_aten(capability):
    """aten packs int4 weights in a layout that depends on the instruction set its kernel runs
    (an AVX2-only machine got garbage from a packing that assumed AVX-512's): this file's tests
    again, in a process whose aten is forced to ``capability``."""
    if os.environ.get("ATEN_CPU_CAPABILITY"):
        pytest.skip("this process already runs under a forced ATEN_CPU_CAPABILITY")
    needs = {"avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}}.get(capability, set())
    if not needs <= _cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(needs - _cpu_flags())} for aten's {capability} kernels")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "not every_instruction_set"], env=dict(os.environ, ATEN_CPU_CAPABILITY=capability),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]


def test_int4_linear_matches_the_dequantized_reference_over_random_shapes():
    gen = np.random.default_rng(3)
    for trial in range(14):
        kind = ["Q4_0", "Q4_1", "Q8_0", "Q4_K"][trial % 4]
        block = 256 if kind == "Q4_K" else 32
        k = block * int(gen.integers(1, 5)) * (2 if block == 32 else 1)
        n = int(gen.choice([32, 64, 96, 192, 320]))
        rows = int(gen.choice([1, 2, 3, 7, 16, 33, 130]))  # >= 128: the decode-then-GEMM branch
        raw = torch.from_numpy(random_blocks(kind, n, k, seed=trial))
        w = gguf_blocks.dequantize_torch(raw, kind)
        bias = torch.randn(n) if trial % 3 == 0 else None
        layer = Int4Linear(gguf_blocks.int4_groups(raw, kind), bias)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(trial))
        y = layer(x)
        ref = x @ w.t() + (0 if bias is None else bias)
        bound = 2.0 ** -7 * (x.abs() @ w.abs().t() + (0 if bias is None else bias.abs())) + 1e-6
        assert y.dtype == torch.float32 and y.shape == (rows, n)
        excess = (y - ref).abs() - bound
        assert float(excess.max()) <= 0, (kind, n, k, rows, float(excess.max()))


def test_int4_linear_rejects_a_bad_width():
    parts = [gguf_blocks.Int4Groups(torch.zeros(4, 48, dtype=torch.uint8), torch.ones(4, 1), torch.zeros(4, 1))]
    with pytest.raises(ValueError, match="in_features=48"):
        Int4Linear(parts)


def test_q8_embedding_rows_equal_the_dense_table():
    raw = torch.from_numpy(random_blocks("Q8_0", 50, 64, seed=4))
    dense = gguf_blocks.dequantize_torch(raw, "Q8_0")
    b = raw.reshape(50, -1, 34)
    emb = Q8Embedding(b[..., 2:].contiguous().view(torch.int8).reshape(50, -1),
                      b[..., :2].contiguous().view(torch.float16).float().reshape(50, -1))
    ids = torch.tensor([3, 0, 49, 3, 17])
    assert torch.equal(emb(ids), dense[ids])
