"""Products with GGUF-quantized weights read as stored (Triton): a one-row GEMV and a multi-row GEMM.

Both read the planes of ``gguf_layout`` (codes, scales and mins in separate row-major tensors) and
decode each weight in registers with gguf.quants' float32 operations; nothing dense is ever
written. A 4-bit plane's byte ``j`` holds columns ``j`` and ``j + K/2``, so each chunk of bytes
feeds two runs of activation columns.

* ``gguf_gemv`` (one row, decode of one sequence): float32 codes times float32 activations,
  float32 accumulation, one rounding at the end; the same neighbour fusions as ``kernels.gemv``
  (RMSNorm prologue, residual epilogue, SiLU·mul input; rounded where torch's ops round) and
  PDL. By default (``_gguf_gemv_words_kernel``) it reads the code plane as int32 words, 16 bytes
  a thread, turns a code into a float with two integer ops and one subtraction (the 2**23
  mantissa trick, ``_word_codes``), sums each tile row's code·activation products (a tile row lies
  in one scale group) and scales the sum once; 16-bit activations are read as one 64-bit word
  per code word, and each chunk's activations serve ROWS output rows. The first version
  (``_gguf_gemv_kernel``, ``DEEPINFER_GGUF_WORDS=0``) reads bytes, converts each (a byte-to-float
  conversion runs at a quarter of the float rate) and scales each weight: ~9.5 instructions a
  weight in its loop against ~6 (PTX of the Q4_0 loops), 1.2-1.5x slower on the H200.
  With 8-bit activations (dp4a, the default) the row is quantized once per GEMV by
  ``_quantize_activations_kernel``, or (experimental, ``DEEPINFER_GGUF_O_QUANT_IN_ATTENTION=1``)
  by the kernel that wrote it: the decode attention for o (``quantized=``).
* ``gguf_gemm`` (several rows: prefill, batches): each program decodes a [BLOCK_N, BLOCK_K] weight
  tile to the activations' dtype in registers and multiplies it on the tensor cores (``tl.dot``),
  float32 accumulation. On the GPU with bfloat16 activations the codes become bfloat16 by PTX bit
  tricks and meet each group's scale rounded to bfloat16 (``gemm_decode``: a third of the instructions
  a weight); elsewhere, and for Q8_0, weights rounded to bfloat16 there are the weights of the same
  file dequantized to bfloat16 at load (the path an explicit ``dtype`` takes).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer.runtime import switches
from deepinfer.runtime.kernels.fused_ops import store_quantized_groups
from deepinfer.runtime.kernels.gemv import (
    _activation_chunk,
    _activation_math,
    _gemv_epilogue,
    _row_rstd,
    check_one_row,
)
from deepinfer.runtime.kernels.gguf_layout import KINDS, GGUFPlanes
from deepinfer.runtime.kernels.pdl import pdl_begin, pdl_launch, prefetch_fits

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# (BLOCK_N, BLOCK_K, num_warps, num_stages); BLOCK_K counts bytes of the code plane
GEMV_CONFIG = (4, 512, 4, 3)
# the word GEMV's (ROWS, BLOCK_K, num_warps, num_stages): ROWS output rows a program (1, 2, 4 or 8),
# BLOCK_K bytes of a row's code plane a chunk. 8 rows share each chunk's activations (RMSNorm /
# SiLU·mul) where that measured faster on the H200 with the decode graph's fusions (Q4_0: 8B
# gate_up 50.7 -> 44.5 us, down 32.6 -> 29.2; Q8_0 49.3 -> 44.7, 30.2 -> 29.7); types with mins
# keep 4 (Q4_K gate_up 60.0 at 4 rows, 72.5 at 8), Q6_K and Q5_K were not measured at 8.
WORDS_GEMV_CONFIG = (4, 2048, 4, 2)
WORDS_GEMV_CONFIG_BY_KIND = {"Q4_0": (8, 2048, 4, 2), "Q8_0": (8, 2048, 4, 2)}
# with DEEPINFER_GGUF_DP4A=1 (activations quantized once per GEMV by _quantize_activations_kernel,
# QUANTIZE_BLOCK columns a program): within 10 % of the best swept tile of the 8B gate_up and down
# for Q4_0 and Q4_K on the H200 (Q4_0 gate_up 20.5 us, 8 rows 4 warps 29.3; down 9.1 us)
DP4A_GEMV_CONFIG = (4, 1024, 2, 2)
# Q4_0 projections of at most NARROW_MAX_N outputs from K >= 4096 (Llama-3-8B's o and down): 2 rows a
# program, 2048 bytes a chunk (twice the programs). Replays of the 8B Q4_0 batch-1 decode step on an
# H100 (bench/decode_profile.py --weights q4_0 --variants, 2026-12-05): 2,327 -> 2,261 us (-2.9 %;
# o alone -1.1 %, down alone -1.7 %); Q8_0 measured the same either way and Q4_K_M 2.5 % slower, so
# they keep DP4A_GEMV_CONFIG.
# Q4_0 at one warp a program (2026-12-06, H100, same replays): every 8B projection's one-warp tile
# together 2,226 -> 2,155 us a step (-3.2 %; gate_up (4, 512) alone -1.3 %, down (2, 1024) -1.0 %,
# qkv and o -0.5 % each); Q4_K_M gained under 1 % and lost 4 % on down, so the others keep 2 warps.
DP4A_CONFIG_BY_KIND = {"Q4_0": (4, 512, 1, 2)}
DP4A_NARROW_CONFIG_BY_KIND = {"Q4_0": (2, 1024, 1, 2)}
NARROW_MAX_N = 4096
# DEEPINFER_GGUF_GEMV_LEAN (experimental): the registers a thread ptxas is given for the lean word
# GEMV. Left to itself it used 34-48 and placed each load next to its use (a pass then waits on
# several memory latencies; on the H200 that form lost 22-27 %); at these budgets every load of a
# pass comes before its first dp4a in the sm_90 cubin (sm90_compile_check.py others), at 61-256
# loop instructions a pass where the default has 132-348. Not yet timed on a GPU.
LEAN_MAXNREG = {"Q4_K": 72, "Q4_1": 72}  # the others: 64
# DEEPINFER_GGUF_GEMV_MAXNREG (experimental): the same budget for the default form. It gathers the
# loads of the two default loops that scatter them (Q4_1; Q4_0 at the narrow tile of o and down) and
# leaves the others' loops within a few instructions (Q8_0: 116 and 110 against 132 and 137). Not yet
# timed on a GPU.
QUANTIZE_BLOCK = 512
GEMM_CONFIG = (64, 64, 64, 4, 3)  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
# up to 32 rows (decode batches): the best swept tile of the 8B gate_up and down at 32 rows on the
# H200 for Q4_0, Q4_K and Q8_0 (Q4_0 gate_up 86.7 -> 78.9 us, down 101.6 -> 84.7; Q8_0 83.7 -> 61.9,
# 124.4 -> 83.8; Q4_K 148.3 -> 129.8, 198.2 -> 186.1)
GEMM_CONFIG_FEW_ROWS = (32, 64, 128, 4, 3)
# the swapped GEMM (weights as the MMA's left operand: wgmma reads them from registers; BLOCK_N is
# the MMA's M, 64 a warp group), up to DEEPINFER_GGUF_GEMM_SWAP_ROWS rows; up to 32 rows only for
# the types where it won. H200, 8B shapes (`bench/gguf_gemv_bench.py --swap-sweep Q4_0,Q4_K`,
# 2026-12-03), plain -> swapped: 128 rows Q4_0 gate_up 185 -> 155 us, down 173 -> 116, qkv 54 -> 41;
# Q4_K 321 -> 243, 337 -> 192, 98 -> 61; 32 rows Q4_K 131 -> 118, 187 -> 178, 52 -> 46, but Q4_0
# 79 -> 78, 86 -> 101, 24 -> 27. Up to 1024 rows since SmolLM2's 256-row decode steps gained too
# (Q4_1 256 x (128, 256) end to end: 81,048 -> 96,588 tok/s at 512 rows, 97,856 at 1024).
# 64-byte K steps in two stages (2026-12-06, an H100): 21-37 KB of shared memory and 96-128
# registers a program (sm_90 compile), so four or five programs share a multiprocessor where
# 64 x 64 x 128 in three stages (66-115 KB, 146-173 registers) fitted two or three. End to end, 8B at
# 128 concurrent, same call: Q4_0 11,002 against 10,178 tok/s, Q4_K_M 7,045 against 6,719 (and
# 7,091 against 6,976 with only its Q6_K part changed, a later call), but Q8_0 8,275 against 9,206,
# so Q8_0 keeps the old tile (GEMM_CONFIG_SWAP_BY_KIND; its decode is the cheapest, its product the
# most bound by the MMAs and their operand loads). Q5_K was not measured apart.
GEMM_CONFIG_SWAP = (64, 64, 64, 4, 2)
GEMM_CONFIG_SWAP_BY_KIND = {"Q8_0": (64, 64, 128, 4, 3)}
GEMM_CONFIG_SWAP_FEW_ROWS = (32, 64, 128, 4, 3)
# ... with two pipeline stages for these types, from the given row count (2026-12-06, an H100; ncu: at
# three stages a 32-row program holds 66 KB of shared memory and only 3 fit a multiprocessor, each
# warp issuing every ~6 cycles). End to end, same call each: Q4_0 gained at 8, 16 and 32 rows; Q4_K_M
# gained at 32 but lost 2 % at 8 and 16 (a 16-row tile holds 48 KB: 4 programs fit at three stages)
GEMM_CONFIG_SWAP_FEW_ROWS_BY_KIND = {"Q4_0": (1, (32, 64, 128, 4, 2)), "Q4_K": (17, (32, 64, 128, 4, 2))}
SWAP_FEW_ROWS_KINDS = ("Q4_K", "Q5_K")
# ... and in CUDA graphs, where K is split (2026-12-04, `--tile-sweep`): Q4_0 gained from the swapped
# tile up to 32 rows too (gate_up at 32 rows 80.0 -> 66.9 us at 2 splits, down 38.5 -> 35.4 at 4;
# Q8_0 did not). Unsplit, plain won for Q4_0 (above), so eager products keep it.
SWAP_SPLIT_FEW_ROWS_KINDS = ("Q4_0",)
# split K (choose_split_k): each split at least this many BLOCK_K steps; these types take more splits
SPLIT_K_MIN_STEPS = 4
SPLIT_K_HEAVY_KINDS = ("Q4_K", "Q5_K")
# up to 32 rows, by type: (splits below two tiles a multiprocessor, below four); the others take
# SPLIT_K_FEW_ROWS_DEFAULT (2026-12-06 sweep at 32 rows, an H100: `--split-sweep`)
SPLIT_K_FEW_ROWS = {"Q4_0": (6, 1), "Q4_K": (6, 3), "Q5_K": (6, 3)}
SPLIT_K_FEW_ROWS_DEFAULT = (6, 2)
SPLIT_K_SUM_BLOCK = 1024


@triton.jit
def _code_float(q, BIAS: tl.constexpr):
    """Float32 ``q - BIAS`` of byte codes ``q`` (uint8; int8 for Q8_0), exactly, by ``_word_codes``'
    2**23 mantissa trick: integer ops and one subtraction instead of a byte-to-float conversion."""
    if q.dtype == tl.int8:
        v = (q.to(tl.int32) & 0xFF) ^ 0x4B000080
        return v.to(tl.float32, bitcast=True) - (8388608.0 + 128.0 + BIAS)
    v = q.to(tl.int32) | 0x4B000000
    return v.to(tl.float32, bitcast=True) - (8388608.0 + BIAS)


@triton.jit
def _six_bit_high(h_ptr, rows, ok, c, kc):
    """Q6_K: for code-plane bytes at columns ``c`` [BK] of rows ``rows`` [R] (``ok`` [R, BK]; ``kc`` =
    K/2), the ``high`` byte holding their 2-bit pairs (gguf_layout: byte ``j``'s are in byte
    ``8 (j // 16) + j % 8``) and the pairs' shift there (``2 ((j // 8) % 2)``; + 4 for the high
    nibble's column), both uint8 [R, BK]."""
    two = tl.load(h_ptr + rows[:, None] * (kc // 2) + (8 * (c // 16) + c % 8)[None, :], mask=ok, other=0)
    return two, tl.broadcast_to((2 * ((c // 8) % 2)).to(tl.uint8)[None, :], two.shape)


@triton.jit
def _packed_codes(raw, h_ptr, rows, ok, c, kc, SIX: tl.constexpr):
    """The codes (uint8) of packed code-plane bytes ``raw`` [R, BK] at byte columns ``c``: the low
    nibbles' columns ``c`` and the high nibbles' ``c + K/2``. SIX (Q6_K at 6 bits, 0..63): each
    nibble joined with its 2-bit pair (``_six_bit_high``)."""
    if SIX:  # (if / else, not an early return: Triton compiles the code after a return too)
        two, shift = _six_bit_high(h_ptr, rows, ok, c, kc)
        two = two.to(tl.int32) >> shift.to(tl.int32)
        q = raw.to(tl.int32)
        lo = ((q & 0x0F) | ((two & 0x03) << 4)).to(tl.uint8)
        hi = ((q >> 4) | (two & 0x30)).to(tl.uint8)
    else:
        lo, hi = raw & 0x0F, raw >> 4
    return lo, hi


@triton.jit
def _fp16_bits(v):
    """Float32 of the float16 whose bits are the low 16 of int32 ``v``."""
    return (v & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _scale_min_words(sm, dd):
    """Float32 (``d * scale``, ``dmin * min``) of a packed K-quant group (gguf_layout): its scale and
    min in the low two bytes of ``sm``, its super-block's ``d`` and ``dmin`` in the halves of ``dd``."""
    return _fp16_bits(dd) * (sm & 0xFF).to(tl.float32), _fp16_bits(dd >> 16) * ((sm >> 8) & 0xFF).to(tl.float32)


@triton.jit
def _scales(row, g, ok, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, G: tl.constexpr, SB: tl.constexpr,
            HAS_MIN: tl.constexpr):
    """Float32 (scale, min term) of groups ``g`` at rows ``row`` (broadcast together; ``ok`` their
    mask): the scale ``d`` (Q4_0, Q4_1, Q8_0) or ``d * sc`` (K-quants); the min term ``m`` (Q4_1),
    ``dmin * mn`` (Q4_K, Q5_K: subtracted) or the scale again (types without one). Q4_K and Q5_K
    read their packed planes (gguf_layout.PACKED_SCALE_KINDS: SB > 0 with a min): one word for
    scale and min, one for ``d`` and ``dmin``."""
    if SB > 0 and HAS_MIN:
        half = ng // 2
        sm = tl.load(s_ptr + row * half + g % half, mask=ok, other=0) >> ((g // half) * 16)
        return _scale_min_words(sm, tl.load(d_ptr + row * nsb + g * G // SB, mask=ok, other=0))
    s = tl.load(s_ptr + row * ng + g, mask=ok, other=0).to(tl.float32)
    if SB > 0:
        s = tl.load(d_ptr + row * nsb + g * G // SB, mask=ok, other=0.0).to(tl.float32) * s
    mn = s
    if HAS_MIN:
        mn = tl.load(m_ptr + row * ng + g, mask=ok, other=0).to(tl.float32)
    return s, mn


@triton.jit
def _group_scales(rows, row_ok, c0, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, BK: tl.constexpr, G: tl.constexpr,
                  SB: tl.constexpr, HAS_MIN: tl.constexpr):
    """``_scales`` [R, BK/G] of the column groups from ``c0`` (a multiple of G) at ``rows``."""
    gi = c0 // G + tl.arange(0, BK // G)
    gok = row_ok[:, None] & (gi < ng)[None, :]
    return _scales(rows[:, None], gi[None, :], gok, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, G, SB, HAS_MIN)


@triton.jit
def _decode(q, rows, row_ok, c0, c, ok, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, R: tl.constexpr, BK: tl.constexpr,
            G: tl.constexpr, SB: tl.constexpr, HAS_MIN: tl.constexpr, BIAS: tl.constexpr, TILED: tl.constexpr):
    """Float32 weights of codes ``q`` [R, BK] at rows ``rows`` [R] and columns ``c = c0 + arange(BK)``
    (gguf's operations and order). TILED: the scales are loaded once per group ([R, BK/G]) and
    broadcast over its G columns (``c0`` a multiple of G); else gathered per column."""
    if TILED:
        s, mn = _group_scales(rows, row_ok, c0, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, BK, G, SB, HAS_MIN)
        w = s[:, :, None] * tl.reshape(_code_float(q, BIAS), (R, BK // G, G))
        if HAS_MIN:
            if SB > 0:
                w = w - mn[:, :, None]
            else:
                w = w + mn[:, :, None]
        return tl.reshape(w, (R, BK))
    s, mn = _scales(rows[:, None], (c // G)[None, :], ok, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, G, SB, HAS_MIN)
    w = s * _code_float(q, BIAS)
    if HAS_MIN:
        if SB > 0:
            w = w - mn
        else:
            w = w + mn
    return w


# Both nibbles of 4 code bytes as bfloat16 pairs, exactly ``code - BIAS`` (GPU only: Triton's
# interpreter runs no PTX). Each 16-bit lane gets a nibble under bf16's 128.0 (0x4300 | n is
# 128 + n: a 7-bit mantissa holds it), and one bf16x2 FMA takes 128 + BIAS off, exactly: 4 bytes
# (8 weights) in 13 instructions, where the float32 route spends ~6 a weight and a conversion.
_NIBBLE_PAIRS = """
{
.reg .b32 t0, t1, u0, u1, r4, one, c;
mov.b32 one, 0x3F803F80;
mov.b32 c, C_PAIR;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
shr.u32 r4, $4, 4;
prmt.b32 u0, r4, 0, 0x4140;
prmt.b32 u1, r4, 0, 0x4342;
lop3.b32 t0, t0, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 t1, t1, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 u0, u0, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 u1, u1, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 $0, t0, one, c;
fma.rn.bf16x2 $1, t1, one, c;
fma.rn.bf16x2 $2, u0, one, c;
fma.rn.bf16x2 $3, u1, one, c;
}
"""
_NIBBLES_MINUS_128 = tl.constexpr(_NIBBLE_PAIRS.replace("C_PAIR", "0xC300C300"))  # bf16 -128.0, twice
_NIBBLES_MINUS_136 = tl.constexpr(_NIBBLE_PAIRS.replace("C_PAIR", "0xC308C308"))  # bf16 -136.0, twice


# 4 one-byte codes of at most 7 bits (Q5_K 0..31, Q6_K 0..63) as bfloat16 pairs ``code - BIAS``, the same way
_BYTE_PAIRS = """
{
.reg .b32 t0, t1, one, c;
mov.b32 one, 0x3F803F80;
mov.b32 c, C_PAIR;
prmt.b32 t0, $2, 0, 0x4140;
prmt.b32 t1, $2, 0, 0x4342;
or.b32 t0, t0, 0x43004300;
or.b32 t1, t1, 0x43004300;
fma.rn.bf16x2 $0, t0, one, c;
fma.rn.bf16x2 $1, t1, one, c;
}
"""
_BYTES_MINUS_128 = tl.constexpr(_BYTE_PAIRS.replace("C_PAIR", "0xC300C300"))  # bf16 -128.0, twice
_BYTES_MINUS_160 = tl.constexpr(_BYTE_PAIRS.replace("C_PAIR", "0xC320C320"))  # bf16 -160.0, twice
# Q6_K: 4 code bytes ($4) joined with their 2-bit pairs ($5: each byte's ``high`` byte; $6: each pair's
# shift there, 0 or 2) into whole codes, then as _BYTE_PAIRS: both nibbles' codes as bfloat16 pairs
# ``code - 32`` ($0, $1: the low nibbles' columns; $2, $3: the high nibbles'). A byte whose shift is
# 2 takes its pairs from the word shifted right by 2 (a byte select by lop3): 23 instructions for 8
# weights, where joining in 32-bit lanes took ~7 a weight (H100, Llama-3-8B Q4_K_M at 32 concurrent
# with DEEPINFER_GGUF_Q6K_6BIT=1: 3,783 against 3,712 output tok/s).
_SIX_PAIRS = tl.constexpr("""
{
.reg .b32 m, v2, h, lo, hi, t0, t1, u0, u1, one, c;
mov.b32 one, 0x3F803F80;
mov.b32 c, 0xC320C320;
shr.u32 m, $6, 1;
and.b32 m, m, 0x01010101;
mul.lo.u32 m, m, 0xFF;
shr.u32 v2, $5, 2;
lop3.b32 h, v2, $5, m, 0xE4;
shl.b32 t0, h, 4;
and.b32 t0, t0, 0x30303030;
lop3.b32 lo, $4, 0x0F0F0F0F, t0, 0xEA;
shr.u32 t1, $4, 4;
and.b32 u1, h, 0x30303030;
lop3.b32 hi, t1, 0x0F0F0F0F, u1, 0xEA;
prmt.b32 t0, lo, 0, 0x4140;
prmt.b32 t1, lo, 0, 0x4342;
prmt.b32 u0, hi, 0, 0x4140;
prmt.b32 u1, hi, 0, 0x4342;
or.b32 t0, t0, 0x43004300;
or.b32 t1, t1, 0x43004300;
or.b32 u0, u0, 0x43004300;
or.b32 u1, u1, 0x43004300;
fma.rn.bf16x2 $0, t0, one, c;
fma.rn.bf16x2 $1, t1, one, c;
fma.rn.bf16x2 $2, u0, one, c;
fma.rn.bf16x2 $3, u1, one, c;
}
""")
# the kinds the "bf16" decode covers. Q8_0's signed bytes need 8 significant bits, more than the 128.0
# trick holds; through float32 (2**23 trick, one exact conversion, the scale in bf16) they measured the
# same as the float32 decode (H100, 8B shape, 32 concurrent: 5,683 and 5,671 against 5,661 tok/s) while
# rounding the scale, so Q8_0 keeps the float32 decode.
BF16_CODE_KINDS = ("Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


@triton.jit
def _byte_codes_bf16(raw, BIAS: tl.constexpr):
    """One-byte codes ``raw`` (uint8, < 128) as bfloat16 ``code - BIAS`` (BIAS 0 or 32), exactly."""
    if BIAS == 32:
        q = tl.inline_asm_elementwise(_BYTES_MINUS_160, "=r,=r,r", [raw], dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        q = tl.inline_asm_elementwise(_BYTES_MINUS_128, "=r,=r,r", [raw], dtype=tl.bfloat16, is_pure=True, pack=4)
    return q


@triton.jit
def _nibble_codes_bf16(raw, BIAS: tl.constexpr):
    """The low and high nibbles of the code bytes ``raw`` (uint8) as bfloat16 ``nibble - BIAS``
    (BIAS 0 or 8), exactly."""
    if BIAS == 8:
        lo, hi = tl.inline_asm_elementwise(_NIBBLES_MINUS_136, "=r,=r,=r,=r,r", [raw],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        lo, hi = tl.inline_asm_elementwise(_NIBBLES_MINUS_128, "=r,=r,=r,=r,r", [raw],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return lo, hi


@triton.jit
def _six_codes_bf16(raw, two, shift):
    """Q6_K's codes of code bytes ``raw`` with their pairs' bytes ``two`` and shifts ``shift``
    (``_six_bit_high``) as bfloat16 ``code - 32``, exactly: (low nibbles' columns, high nibbles')."""
    return tl.inline_asm_elementwise(_SIX_PAIRS, "=r,=r,=r,=r,r,r,r", [raw, two, shift],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@triton.jit
def _scale_bf16(q, rows, row_ok, c0, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, R: tl.constexpr, BK: tl.constexpr,
                G: tl.constexpr, SB: tl.constexpr, HAS_MIN: tl.constexpr):
    """Bfloat16 weights of exact bfloat16 codes ``q`` [R, BK] (``c0`` a multiple of G): each group's
    scale (and minimum) computed in float32 as ``_decode`` does, rounded to bfloat16 once, then
    ``q * scale (+ minimum)`` in one bfloat16 FMA (hardware bf16x2)."""
    s, mn = _group_scales(rows, row_ok, c0, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, BK, G, SB, HAS_MIN)
    q3 = tl.reshape(q, (R, BK // G, G))
    if HAS_MIN:
        if SB > 0:
            mn = -mn
        w = q3 * s.to(tl.bfloat16)[:, :, None] + mn.to(tl.bfloat16)[:, :, None]
    else:
        w = q3 * s.to(tl.bfloat16)[:, :, None]
    return tl.reshape(w, (R, BK))


@triton.jit
def _gemv_chunk(acc, raw, rows, row_ok, k0, c, kc, k, rstd, x_ptr, nw_ptr, out_ptr, h_ptr, s_ptr, m_ptr, d_ptr,
                dm_ptr, ng, nsb, R: tl.constexpr, BK: tl.constexpr, PACKED: tl.constexpr, G: tl.constexpr,
                SB: tl.constexpr, HAS_MIN: tl.constexpr, BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
                NORM: tl.constexpr, TILED: tl.constexpr, SIX: tl.constexpr):
    """``acc`` plus the products of code bytes ``raw`` (columns ``c``; with PACKED also ``c + kc``)."""
    c_ok = c < kc
    ok = row_ok[:, None] & c_ok[None, :]
    if PACKED:
        q_lo, q_hi = _packed_codes(raw, h_ptr, rows, ok, c, kc, SIX)
        lo = _decode(q_lo, rows, row_ok, k0, c, ok, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, R, BK, G, SB,
                     HAS_MIN, BIAS, TILED)
        acc += lo * _activation_chunk(x_ptr, nw_ptr, out_ptr, c, c_ok, k, rstd, SILU_MUL, NORM)[None, :]
        hi = _decode(q_hi, rows, row_ok, k0 + kc, c + kc, ok, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, R, BK, G,
                     SB, HAS_MIN, BIAS, TILED)
        acc += hi * _activation_chunk(x_ptr, nw_ptr, out_ptr, c + kc, c_ok, k, rstd, SILU_MUL, NORM)[None, :]
    else:
        w = _decode(raw, rows, row_ok, k0, c, ok, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, R, BK, G, SB, HAS_MIN,
                    BIAS, TILED)
        acc += w * _activation_chunk(x_ptr, nw_ptr, out_ptr, c, c_ok, k, rstd, SILU_MUL, NORM)[None, :]
    return acc


@triton.jit
def _gguf_gemv_kernel(x_ptr, q_ptr, h_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, b_ptr, nw_ptr, res_ptr, out_ptr, n, k, eps,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PACKED: tl.constexpr, G: tl.constexpr,
                      SB: tl.constexpr, HAS_MIN: tl.constexpr, BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
                      NORM: tl.constexpr, NORM_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
                      RESIDUAL: tl.constexpr, TILED: tl.constexpr, PDL: tl.constexpr, SIX: tl.constexpr):
    pid = tl.program_id(0)
    rows = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < n
    kc = k // 2 if PACKED else k  # bytes per row of the code plane
    ng = k // G
    nsb = k // SB if SB > 0 else 1
    cols = tl.arange(0, BLOCK_K)
    ok0 = row_ok[:, None] & (cols < kc)[None, :]
    first = tl.load(q_ptr + rows[:, None] * kc + cols[None, :], mask=ok0, other=0)  # before the wait (PDL)
    pdl_begin(PDL)
    rstd = _row_rstd(x_ptr, k, eps, NORM, NORM_BLOCK)
    acc = _gemv_chunk(tl.zeros([BLOCK_N, BLOCK_K], tl.float32), first, rows, row_ok, 0, cols, kc, k, rstd, x_ptr,
                      nw_ptr, out_ptr, h_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, BLOCK_N, BLOCK_K, PACKED, G, SB,
                      HAS_MIN, BIAS, SILU_MUL, NORM, TILED, SIX)
    for k0 in range(BLOCK_K, kc, BLOCK_K):
        c = k0 + cols
        ok = row_ok[:, None] & (c < kc)[None, :]
        raw = tl.load(q_ptr + rows[:, None] * kc + c[None, :], mask=ok, other=0)
        acc = _gemv_chunk(acc, raw, rows, row_ok, k0, c, kc, k, rstd, x_ptr, nw_ptr, out_ptr, h_ptr, s_ptr, m_ptr,
                          d_ptr, dm_ptr, ng, nsb, BLOCK_N, BLOCK_K, PACKED, G, SB, HAS_MIN, BIAS, SILU_MUL, NORM, TILED,
                          SIX)
    _gemv_epilogue(tl.sum(acc, axis=1), rows, row_ok, pid, n, b_ptr, res_ptr, out_ptr, out_ptr, out_ptr, HAS_BIAS,
                   RESIDUAL, False)


@triton.jit
def _word_codes(wd, B: tl.constexpr, PACKED: tl.constexpr, SIGNED: tl.constexpr, OFFSET: tl.constexpr):
    """Float32 ``code - bias`` of byte ``B`` (its low nibble with PACKED) of each int32 word ``wd``,
    exactly: the code ORed into the mantissa of 2**23 (``0x4B000000``) is the float ``2**23 + code``,
    and one subtraction leaves the code. Two integer ops and one float op per weight, where a
    byte-to-float conversion runs at a quarter of the float rate. Signed bytes (Q8_0) are offset by
    128 first (the XOR). ``OFFSET``: ``2**23`` + the type's code bias (+ 128 when SIGNED)."""
    if PACKED:
        v = ((wd >> (8 * B)) & 0xF) | 0x4B000000
    elif SIGNED:
        v = ((wd >> (8 * B)) & 0xFF) ^ 0x4B000080
    else:
        v = ((wd >> (8 * B)) & 0xFF) | 0x4B000000
    return v.to(tl.float32, bitcast=True) - OFFSET


@triton.jit
def _word_act(xw, uw, nww, B: tl.constexpr, rstd, dt: tl.constexpr, SILU_MUL: tl.constexpr, NORM: tl.constexpr):
    """Element ``B`` of 64-bit words of four 16-bit activations, float32, rounded as ``_activation_chunk``."""
    xv = ((xw >> (16 * B)) & 0xFFFF).to(tl.int16).to(dt, bitcast=True).to(tl.float32)
    u = xv
    nw = xv
    if SILU_MUL:
        u = ((uw >> (16 * B)) & 0xFFFF).to(tl.int16).to(dt, bitcast=True).to(tl.float32)
    elif NORM:
        nw = ((nww >> (16 * B)) & 0xFFFF).to(tl.int16).to(dt, bitcast=True).to(tl.float32)
    return _activation_math(xv, u, nw, rstd, dt, SILU_MUL, NORM)


@triton.jit
def _dp4a(a, b, EMULATE: tl.constexpr, c=None):
    """Per int32 lane: ``c`` (default 0) plus the sum of the products of the four signed bytes of
    ``a`` and ``b`` (PTX ``dp4a``; EMULATE: the same with shifts, for Triton's interpreter, which
    runs no PTX)."""
    if c is None:
        c = tl.zeros_like(a)
    if EMULATE:
        r = c + ((a << 24) >> 24) * ((b << 24) >> 24)
        r += ((a << 16) >> 24) * ((b << 16) >> 24)
        r += ((a << 8) >> 24) * ((b << 8) >> 24)
        return r + (a >> 24) * (b >> 24)
    return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _dp4a_rows(a, b, EMULATE: tl.constexpr):
    """Per row of ``a``, ``b`` [NG, 4] (a tile row, one thread's): the sum of the four lanes'
    ``_dp4a``, chained through dp4a's accumulator (no integer adds after it)."""
    a0, a1 = tl.split(tl.reshape(a, (a.shape[0], 2, 2)))
    b0, b1 = tl.split(tl.reshape(b, (b.shape[0], 2, 2)))
    a00, a01 = tl.split(a0)
    a10, a11 = tl.split(a1)
    b00, b01 = tl.split(b0)
    b10, b11 = tl.split(b1)
    return _dp4a(a11, b11, EMULATE, _dp4a(a10, b10, EMULATE, _dp4a(a01, b01, EMULATE, _dp4a(a00, b00, EMULATE))))


@triton.jit
def _quantize_activations_kernel(x_ptr, nw_ptr, dt_ptr, q_ptr, st_ptr, k, eps, BLOCK: tl.constexpr,
                                 SILU_MUL: tl.constexpr, NORM: tl.constexpr, NORM_BLOCK: tl.constexpr,
                                 PDL: tl.constexpr):
    """The dp4a GEMV's input, once per GEMV: the activation row (RMSNorm / SiLU·mul applied and
    rounded as ``_activation_chunk``) as signed bytes ``q`` [K], one scale per 16-column tile
    (``amax / 127``, rounded to nearest even), and per tile ``st`` [3, K/16]: the scale, the sum of
    its integers and the sum of its float activations (for the types' code bias and mins)."""
    T: tl.constexpr = BLOCK // 16
    pid = tl.program_id(0)
    pdl_begin(PDL)
    rstd = _row_rstd(x_ptr, k, eps, NORM, NORM_BLOCK)
    t = pid * T + tl.arange(0, T)
    c = t[:, None] * 16 + tl.arange(0, 16)[None, :]
    ok = c < k
    xv = _activation_chunk(x_ptr, nw_ptr, dt_ptr, c, ok, k, rstd, SILU_MUL, NORM)
    store_quantized_groups(xv, c, ok, q_ptr, st_ptr, k // 16)  # (K is a multiple of 32: whole groups)


def quantize_activations(x: torch.Tensor, k: int, silu_mul: bool = False,
                         norm: tuple[torch.Tensor, float] | None = None,
                         rounding: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The dp4a GEMV's 8-bit activations of the row ``x`` (one launch of
    ``_quantize_activations_kernel``): codes [K] int8 and ``st`` [3 * K/16] float32 (scales,
    integer sums, float sums). ``silu_mul``: of SiLU(gate) * up of ``x`` [1, 2K], rounded to
    ``rounding``'s dtype (default x's); ``norm`` (weight, eps): of RMSNorm(x) * weight. The
    caller checks shapes (``gguf_gemv``; the tests call it as the reference of the fused forms)."""
    xq = torch.empty(k, dtype=torch.int8, device=x.device)
    st = torch.empty(3 * (k // 16), dtype=torch.float32, device=x.device)
    _quantize_activations_kernel[(triton.cdiv(k, QUANTIZE_BLOCK),)](
        x, norm[0] if norm is not None else x, x if rounding is None else rounding, xq, st, k,
        norm[1] if norm is not None else 0.0, BLOCK=QUANTIZE_BLOCK, SILU_MUL=silu_mul, NORM=norm is not None,
        NORM_BLOCK=triton.next_power_of_2(k) if norm is not None else 1, num_warps=4, **pdl_launch(x.device))
    return xq, st


@triton.jit
def _quantized_activations(xq_ptr, st_ptr, wq, t, w_ok, t_ok, kt, HAS_MIN: tl.constexpr, CODE_BIAS: tl.constexpr):
    """The dp4a GEMV's activations of words ``wq`` [NG, GW] (tiles ``t`` [NG]), as
    ``_word_activations`` returns them: (signed-byte words, scales, integer sums, -, float sums)."""
    words = tl.load(xq_ptr + wq, mask=w_ok, other=0)
    scale = tl.load(st_ptr + t, mask=t_ok, other=0.0)
    isum = scale
    xsum = scale
    if CODE_BIAS != 0:
        isum = tl.load(st_ptr + kt + t, mask=t_ok, other=0.0)
    if HAS_MIN:
        xsum = tl.load(st_ptr + 2 * kt + t, mask=t_ok, other=0.0)
    return words, scale, isum, isum, xsum


@triton.jit
def _word_activations(x_ptr, xw_ptr, nw_ptr, nww_ptr, out_ptr, cw, w_ok, k, rstd, HAS_MIN: tl.constexpr,
                      SILU_MUL: tl.constexpr, NORM: tl.constexpr, X_WORDS: tl.constexpr):
    """The activations of byte ``b`` of each word whose first column is ``cw`` [NG, GW]: ``cw + b``
    for b = 0..3, float32, and (HAS_MIN) each tile row's activation sum [NG]. X_WORDS (16-bit
    activations): read as one 64-bit word per code word (``xw_ptr``, ``nww_ptr``: the int64 views of
    x and the norm weight); else gathered per column."""
    if X_WORDS:
        dt: tl.constexpr = out_ptr.dtype.element_ty
        idx = cw // 4
        xw = tl.load(xw_ptr + idx, mask=w_ok, other=0)
        uw = xw
        nww = xw
        if SILU_MUL:
            uw = tl.load(xw_ptr + k // 4 + idx, mask=w_ok, other=0)
        if NORM:
            nww = tl.load(nww_ptr + idx, mask=w_ok, other=0)
        x0 = _word_act(xw, uw, nww, 0, rstd, dt, SILU_MUL, NORM)
        x1 = _word_act(xw, uw, nww, 1, rstd, dt, SILU_MUL, NORM)
        x2 = _word_act(xw, uw, nww, 2, rstd, dt, SILU_MUL, NORM)
        x3 = _word_act(xw, uw, nww, 3, rstd, dt, SILU_MUL, NORM)
    else:
        x0 = _activation_chunk(x_ptr, nw_ptr, out_ptr, cw, w_ok, k, rstd, SILU_MUL, NORM)
        x1 = _activation_chunk(x_ptr, nw_ptr, out_ptr, cw + 1, w_ok, k, rstd, SILU_MUL, NORM)
        x2 = _activation_chunk(x_ptr, nw_ptr, out_ptr, cw + 2, w_ok, k, rstd, SILU_MUL, NORM)
        x3 = _activation_chunk(x_ptr, nw_ptr, out_ptr, cw + 3, w_ok, k, rstd, SILU_MUL, NORM)
    xg = tl.sum(x0, axis=1)
    if HAS_MIN:
        xg = tl.sum((x0 + x1) + (x2 + x3), axis=1)
    return x0, x1, x2, x3, xg


@triton.jit
def _group_dot(wd, x0, x1, x2, x3, PACKED: tl.constexpr, SIGNED: tl.constexpr, OFFSET: tl.constexpr,
               DP4A: tl.constexpr, CODE_BIAS: tl.constexpr, EMULATE: tl.constexpr, LEAN: tl.constexpr):
    """Each tile row's sum of code-activation products of words ``wd`` [NG, GW], not yet scaled.
    LEAN: a tile row's four ``dp4a`` chained through the accumulator, no ``- 0 * x2``."""
    if DP4A and LEAN:  # x0: the activations as signed-byte words, x1: their scales, x2: their integer sums
        di = _dp4a_rows(wd & 0x0F0F0F0F if PACKED else wd, x0, EMULATE).to(tl.float32)
        if CODE_BIAS != 0:  # (x - 0 * y is not folded: 0 * inf is NaN)
            di -= CODE_BIAS * x2
        dot = x1 * di
    elif DP4A:
        di = _dp4a(wd & 0x0F0F0F0F if PACKED else wd, x0, EMULATE)
        dot = x1 * (tl.sum(di, axis=1).to(tl.float32) - CODE_BIAS * x2)
    else:
        t = _word_codes(wd, 0, PACKED, SIGNED, OFFSET) * x0
        t += _word_codes(wd, 1, PACKED, SIGNED, OFFSET) * x1
        t += _word_codes(wd, 2, PACKED, SIGNED, OFFSET) * x2
        t += _word_codes(wd, 3, PACKED, SIGNED, OFFSET) * x3
        dot = tl.sum(t, axis=1)
    return dot


@triton.jit
def _kpack_update(acc, wd, lo, hi, glo, ghi, row, n, ng, nsb, s_ptr, d_ptr, G: tl.constexpr, SB: tl.constexpr,
                  OFFSET: tl.constexpr, DP4A: tl.constexpr, CODE_BIAS: tl.constexpr, EMULATE: tl.constexpr,
                  LEAN: tl.constexpr):
    """``_row_update``'s two ``_group_update`` calls for Q4_K: its packed scales (gguf_layout) give a
    tile row's low and high nibbles their scales and mins in one word (``s_ptr`` [N, ng/2]) and
    each half its ``d`` and ``dmin`` in one more (``d_ptr`` [N, nsb]): three loads where four
    planes took eight. The float32 operations of ``_group_update``."""
    gok = _mask((glo < ng // 2) & (row + glo * 0 < n), LEAN)
    sm = tl.load(s_ptr + row * (ng // 2) + glo, mask=gok, other=0)
    if LEAN:
        dd_lo = tl.load(d_ptr + row * nsb + _udiv(glo, SB // G), mask=gok, other=0)
        dd_hi = tl.load(d_ptr + row * nsb + _udiv(ghi, SB // G), mask=gok, other=0)
    else:
        dd_lo = tl.load(d_ptr + row * nsb + glo * G // SB, mask=gok, other=0)
        dd_hi = tl.load(d_ptr + row * nsb + ghi * G // SB, mask=gok, other=0)
    x0, x1, x2, x3, xg = lo
    s, mn = _scale_min_words(sm, dd_lo)
    acc += s * _group_dot(wd, x0, x1, x2, x3, True, False, OFFSET, DP4A, CODE_BIAS, EMULATE, LEAN)
    acc -= mn * xg
    x0, x1, x2, x3, xg = hi
    s, mn = _scale_min_words(sm >> 16, dd_hi)
    acc += s * _group_dot(wd >> 4, x0, x1, x2, x3, True, False, OFFSET, DP4A, CODE_BIAS, EMULATE, LEAN)
    acc -= mn * xg
    return acc


@triton.jit
def _group_update(acc, wd, x0, x1, x2, x3, xg, row, n, g, ng, nsb, s_ptr, m_ptr, d_ptr, dm_ptr,
                  G: tl.constexpr, SB: tl.constexpr, PACKED: tl.constexpr, SIGNED: tl.constexpr,
                  HAS_MIN: tl.constexpr, OFFSET: tl.constexpr, DP4A: tl.constexpr, CODE_BIAS: tl.constexpr,
                  EMULATE: tl.constexpr, LEAN: tl.constexpr):
    """``acc`` [NG] plus one row's products with words ``wd`` [NG, GW] whose tile rows lie in groups
    ``g`` [NG]: each tile row's code-activation products summed first, then scaled once (its
    group's min times the tile row's activation sum ``xg``)."""
    dot = _group_dot(wd, x0, x1, x2, x3, PACKED, SIGNED, OFFSET, DP4A, CODE_BIAS, EMULATE, LEAN)
    gok = _mask((g < ng) & (row + g * 0 < n), LEAN)  # (a tensor mask: Triton's interpreter takes no scalar & tensor)
    s, mn = _scales(row, g, gok, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, G, SB, HAS_MIN)
    acc += s * dot
    if HAS_MIN:
        if SB > 0:
            acc -= mn * xg
        else:
            acc += mn * xg
    return acc


@triton.jit
def _six_bit_words(wd, h64, H: tl.constexpr):
    """Q6_K's code words (4 codes of 0..63 each) of nibble words ``wd`` [NG, 4] and their tile rows'
    high-bit words ``h64`` [NG] (gguf_layout: word q's bytes take bits 32 (q % 2) + 2 (q // 2) + 4 H
    up, a byte apart): the low nibbles' columns (H 0) or the high nibbles' (H 1, at K/2)."""
    q = tl.arange(0, 4)[None, :]
    high = ((h64[:, None] >> (32 * (q % 2) + 2 * (q // 2) + 4 * H).to(tl.int64)) & 0x03030303).to(tl.int32)
    return ((wd >> (4 * H)) & 0x0F0F0F0F) | (high << 4)


@triton.jit
def _udiv(i, D: tl.constexpr):
    """``i // D`` for indices ``i`` >= 0 (int32) and a power of two D: a shift, where ``//`` of a
    signed integer also rounds negative ones toward zero (three more instructions)."""
    return (i.to(tl.uint32) // D).to(tl.int32)


@triton.jit
def _mask(ok, LEAN: tl.constexpr):
    """``ok``; or, LEAN (the word GEMV's tiles divide the weight), all true, which Triton folds away:
    the load is then unmasked (no predicate, no zeroed destination: fewer instructions a word)."""
    if LEAN:
        return ok | True
    return ok


@triton.jit
def _row_words(q_ptr, row, n, kw, w0, wi, w_ok, LEAN: tl.constexpr):
    """Row ``row``'s code words ``w0 + wi`` (0 past the last row)."""
    return tl.load(q_ptr + row * kw + w0 + wi, mask=_mask(w_ok & (row + wi * 0 < n), LEAN), other=0)


@triton.jit
def _row_update(acc, row, n, q_ptr, h_ptr, kw, w0, wi, w_ok, lo, hi, glo, ghi, ng, nsb, s_ptr, m_ptr, d_ptr,
                dm_ptr, G: tl.constexpr, SB: tl.constexpr, PACKED: tl.constexpr, SIGNED: tl.constexpr,
                HAS_MIN: tl.constexpr, OFFSET: tl.constexpr, DP4A: tl.constexpr,
                CODE_BIAS: tl.constexpr, EMULATE: tl.constexpr, wd_pre, HAVE: tl.constexpr, SIX: tl.constexpr,
                LEAN: tl.constexpr):
    """One row's chunk of words ``w0 + wi`` (HAVE: already loaded, ``wd_pre``): the low nibbles (or
    bytes) with activations ``lo``, a 4-bit type's high nibbles with ``hi`` (the same columns of
    the second half). Q4_K (4-bit codes of a super-block type) reads its packed scales once for
    both (``_kpack_update``). SIX: Q6_K's 6-bit planes (``q_ptr`` its nibbles, ``h_ptr`` its high
    bits as int64 words, one a tile row), each code word made whole before the product."""
    if HAVE:
        wd = wd_pre
    else:
        wd = _row_words(q_ptr, row, n, kw, w0, wi, w_ok, LEAN)
    if SIX:  # (Q6_K's groups are 16 columns: glo is the tile row's index, its high word's)
        h64 = tl.load(h_ptr + row * (kw // 4) + glo, mask=_mask((glo < kw // 4) & (row + glo * 0 < n), LEAN), other=0)
        x0, x1, x2, x3, xg = lo
        acc = _group_update(acc, _six_bit_words(wd, h64, 0), x0, x1, x2, x3, xg, row, n, glo, ng, nsb, s_ptr, m_ptr,
                            d_ptr, dm_ptr, G, SB, False, False, False, OFFSET, DP4A, CODE_BIAS, EMULATE, LEAN)
        x0, x1, x2, x3, xg = hi
        acc = _group_update(acc, _six_bit_words(wd, h64, 1), x0, x1, x2, x3, xg, row, n, ghi, ng, nsb, s_ptr, m_ptr,
                            d_ptr, dm_ptr, G, SB, False, False, False, OFFSET, DP4A, CODE_BIAS, EMULATE, LEAN)
    elif PACKED and SB > 0:  # (if / elif, not early returns: Triton compiles the code after a return too)
        acc = _kpack_update(acc, wd, lo, hi, glo, ghi, row, n, ng, nsb, s_ptr, d_ptr, G, SB, OFFSET, DP4A,
                            CODE_BIAS, EMULATE, LEAN)
    else:
        x0, x1, x2, x3, xg = lo
        acc = _group_update(acc, wd, x0, x1, x2, x3, xg, row, n, glo, ng, nsb, s_ptr, m_ptr, d_ptr, dm_ptr, G, SB,
                            PACKED, SIGNED, HAS_MIN, OFFSET, DP4A, CODE_BIAS, EMULATE, LEAN)
        if PACKED:
            x0, x1, x2, x3, xg = hi
            acc = _group_update(acc, wd >> 4, x0, x1, x2, x3, xg, row, n, ghi, ng, nsb, s_ptr, m_ptr, d_ptr, dm_ptr,
                                G, SB, PACKED, SIGNED, HAS_MIN, OFFSET, DP4A, CODE_BIAS, EMULATE, LEAN)
    return acc


@triton.jit
def _row_out(acc, row, n, b_ptr, res_ptr, out_ptr, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr):
    _gemv_epilogue(tl.sum(acc, axis=0), row, row < n, 0, n, b_ptr, res_ptr, out_ptr, out_ptr, out_ptr, HAS_BIAS,
                   RESIDUAL, False)


@triton.jit
def _rows_update(a0, a1, a2, a3, r, NR: tl.constexpr, n, q_ptr, h_ptr, kw, w0, wi, w_ok, lo, hi, glo, ghi, ng, nsb,
                 s_ptr, m_ptr, d_ptr, dm_ptr, G: tl.constexpr, SB: tl.constexpr, PACKED: tl.constexpr,
                 SIGNED: tl.constexpr, HAS_MIN: tl.constexpr, OFFSET: tl.constexpr, DP4A: tl.constexpr,
                 CODE_BIAS: tl.constexpr, EMULATE: tl.constexpr, p0, p1, p2, p3, HAVE: tl.constexpr,
                 SIX: tl.constexpr, LEAN: tl.constexpr):
    """``_row_update`` for rows ``r .. r + NR - 1`` (NR 1, 2 or 4), accumulators ``a0..a3``
    (HAVE: their words already loaded, ``p0..p3``)."""
    a0 = _row_update(a0, r, n, q_ptr, h_ptr, kw, w0, wi, w_ok, lo, hi, glo, ghi, ng, nsb, s_ptr, m_ptr, d_ptr, dm_ptr,
                     G, SB, PACKED, SIGNED, HAS_MIN, OFFSET, DP4A, CODE_BIAS, EMULATE, p0, HAVE, SIX, LEAN)
    if NR > 1:
        a1 = _row_update(a1, r + 1, n, q_ptr, h_ptr, kw, w0, wi, w_ok, lo, hi, glo, ghi, ng, nsb, s_ptr, m_ptr,
                         d_ptr, dm_ptr, G, SB, PACKED, SIGNED, HAS_MIN, OFFSET, DP4A, CODE_BIAS, EMULATE, p1, HAVE,
                         SIX, LEAN)
    if NR > 2:
        a2 = _row_update(a2, r + 2, n, q_ptr, h_ptr, kw, w0, wi, w_ok, lo, hi, glo, ghi, ng, nsb, s_ptr, m_ptr,
                         d_ptr, dm_ptr, G, SB, PACKED, SIGNED, HAS_MIN, OFFSET, DP4A, CODE_BIAS, EMULATE, p2, HAVE,
                         SIX, LEAN)
        a3 = _row_update(a3, r + 3, n, q_ptr, h_ptr, kw, w0, wi, w_ok, lo, hi, glo, ghi, ng, nsb, s_ptr, m_ptr,
                         d_ptr, dm_ptr, G, SB, PACKED, SIGNED, HAS_MIN, OFFSET, DP4A, CODE_BIAS, EMULATE, p3, HAVE,
                         SIX, LEAN)
    return a0, a1, a2, a3


@triton.jit
def _rows_words(q_ptr, r, NR: tl.constexpr, n, kw, wi, w_ok, LEAN: tl.constexpr):
    """The first chunk's words of rows ``r .. r + NR - 1`` (NR 1, 2 or 4; the others repeat row r's)."""
    p0 = _row_words(q_ptr, r, n, kw, 0, wi, w_ok, LEAN)
    p1, p2, p3 = p0, p0, p0
    if NR > 1:
        p1 = _row_words(q_ptr, r + 1, n, kw, 0, wi, w_ok, LEAN)
    if NR > 2:
        p2 = _row_words(q_ptr, r + 2, n, kw, 0, wi, w_ok, LEAN)
        p3 = _row_words(q_ptr, r + 3, n, kw, 0, wi, w_ok, LEAN)
    return p0, p1, p2, p3


@triton.jit
def _rows_out(a0, a1, a2, a3, r, NR: tl.constexpr, n, b_ptr, res_ptr, out_ptr, HAS_BIAS: tl.constexpr,
              RESIDUAL: tl.constexpr):
    _row_out(a0, r, n, b_ptr, res_ptr, out_ptr, HAS_BIAS, RESIDUAL)
    if NR > 1:
        _row_out(a1, r + 1, n, b_ptr, res_ptr, out_ptr, HAS_BIAS, RESIDUAL)
    if NR > 2:
        _row_out(a2, r + 2, n, b_ptr, res_ptr, out_ptr, HAS_BIAS, RESIDUAL)
        _row_out(a3, r + 3, n, b_ptr, res_ptr, out_ptr, HAS_BIAS, RESIDUAL)


@triton.jit
def _words_chunk(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, w0, p0, p1, p2, p3, p4, p5, p6, p7, r0, gi, wi,
                 x_ptr, xw_ptr, xq_ptr, st_ptr, q_ptr, h_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, nw_ptr, nww_ptr, out_ptr,
                 n, k, kw, kt, ng, nsb, rstd, ROWS: tl.constexpr, PACKED: tl.constexpr, SIGNED: tl.constexpr,
                 G: tl.constexpr, SB: tl.constexpr, HAS_MIN: tl.constexpr, OFFSET: tl.constexpr,
                 SILU_MUL: tl.constexpr, NORM: tl.constexpr, X_WORDS: tl.constexpr, DP4A: tl.constexpr,
                 CODE_BIAS: tl.constexpr, EMULATE: tl.constexpr, HAVE: tl.constexpr, SIX: tl.constexpr,
                 LEAN: tl.constexpr):
    """The word GEMV's chunk of words ``w0 + wi`` of its ROWS rows (HAVE: the words ``p0..p7``
    were loaded before the PDL wait): the chunk's activations once, then every row's update."""
    GW: tl.constexpr = 4
    w_ok = _mask((w0 + wi) < kw, LEAN)
    if DP4A:  # a tile row of 4 words is one 16-column activation tile
        t = w0 // GW + gi if LEAN else (w0 + GW * gi) // GW
        t_ok = _mask((w0 + GW * gi) < kw, LEAN)
        lo = _quantized_activations(xq_ptr, st_ptr, w0 + wi, t, w_ok, t_ok, kt, HAS_MIN, CODE_BIAS)
    else:
        lo = _word_activations(x_ptr, xw_ptr, nw_ptr, nww_ptr, out_ptr, 4 * (w0 + wi), w_ok, k, rstd, HAS_MIN,
                               SILU_MUL, NORM, X_WORDS)
    glo = _udiv(w0 + GW * gi, G // 4) if LEAN else (w0 + GW * gi) // (G // 4)  # each tile row's scale group
    hi = lo
    ghi = glo
    if PACKED:  # the high nibbles: the same columns of the row's second half
        if DP4A:
            hi = _quantized_activations(xq_ptr, st_ptr, k // 8 + w0 + wi, kt // 2 + t, w_ok, t_ok, kt, HAS_MIN,
                                        CODE_BIAS)
        else:
            hi = _word_activations(x_ptr, xw_ptr, nw_ptr, nww_ptr, out_ptr, k // 2 + 4 * (w0 + wi), w_ok, k,
                                   rstd, HAS_MIN, SILU_MUL, NORM, X_WORDS)
        ghi = (k // 2) // G + glo
    acc0, acc1, acc2, acc3 = _rows_update(acc0, acc1, acc2, acc3, r0, min(ROWS, 4), n, q_ptr, h_ptr, kw, w0, wi,
                                          w_ok, lo, hi, glo, ghi, ng, nsb, s_ptr, m_ptr, d_ptr, dm_ptr, G, SB, PACKED,
                                          SIGNED, HAS_MIN, OFFSET, DP4A, CODE_BIAS, EMULATE, p0, p1, p2, p3, HAVE,
                                          SIX, LEAN)
    if ROWS > 4:
        acc4, acc5, acc6, acc7 = _rows_update(acc4, acc5, acc6, acc7, r0 + 4, 4, n, q_ptr, h_ptr, kw, w0, wi, w_ok,
                                              lo, hi, glo, ghi, ng, nsb, s_ptr, m_ptr, d_ptr, dm_ptr, G, SB, PACKED,
                                              SIGNED, HAS_MIN, OFFSET, DP4A, CODE_BIAS, EMULATE, p4, p5, p6, p7,
                                              HAVE, SIX, LEAN)
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@triton.jit
def _gguf_gemv_words_kernel(x_ptr, xw_ptr, xq_ptr, st_ptr, q_ptr, h_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, b_ptr, nw_ptr,
                            nww_ptr, res_ptr, out_ptr, n, k, kw, eps,
                            ROWS: tl.constexpr, BLOCK_W: tl.constexpr, PACKED: tl.constexpr, SIGNED: tl.constexpr,
                            G: tl.constexpr, SB: tl.constexpr, HAS_MIN: tl.constexpr, OFFSET: tl.constexpr,
                            SILU_MUL: tl.constexpr, NORM: tl.constexpr, NORM_BLOCK: tl.constexpr,
                            HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr, X_WORDS: tl.constexpr,
                            DP4A: tl.constexpr, CODE_BIAS: tl.constexpr, EMULATE: tl.constexpr, PDL: tl.constexpr,
                            PRELOAD: tl.constexpr = False, SIX: tl.constexpr = False, LEAN: tl.constexpr = False):
    """The one-row GEMV reading the code plane as int32 words (``q_ptr``, ``kw`` words a row):
    ROWS (1, 2, 4 or 8) output rows a program, chunks of BLOCK_W words a row as [NG, 4] tiles. A tile
    row is one 16-byte load and lies in one scale group (16 or 32 columns; a 32-column group is two
    tile rows), so each thread sums its own products: on the H200 a tile row of a whole 32-byte
    group, summed across two threads, ran the GEMV 2x slower. A chunk's activations are computed
    once and used for every row. DP4A: the activations are ``_quantize_activations_kernel``'s
    signed bytes (``xq_ptr``, int32 words) and tile sums (``st_ptr``), already normalized.
    PRELOAD: the first chunk's words of every row are loaded before the PDL wait (kernels/pdl.py)."""
    GW: tl.constexpr = 4
    NG: tl.constexpr = BLOCK_W // GW
    r0 = tl.program_id(0).to(tl.int64) * ROWS
    ng = k // G
    nsb = k // SB if SB > 0 else 1
    kt = k // 16
    gi = tl.arange(0, NG)
    wi = gi[:, None] * GW + tl.arange(0, GW)[None, :]
    p0, p1, p2, p3 = wi, wi, wi, wi  # (unused without PRELOAD)
    p4, p5, p6, p7 = wi, wi, wi, wi
    if PRELOAD:
        p0, p1, p2, p3 = _rows_words(q_ptr, r0, min(ROWS, 4), n, kw, wi, wi < kw, LEAN)
        if ROWS > 4:
            p4, p5, p6, p7 = _rows_words(q_ptr, r0 + 4, 4, n, kw, wi, wi < kw, LEAN)
    pdl_begin(PDL)
    rstd = _row_rstd(x_ptr, k, eps, NORM, NORM_BLOCK)
    acc0 = tl.zeros([NG], tl.float32)
    acc1, acc2, acc3, acc4, acc5, acc6, acc7 = acc0, acc0, acc0, acc0, acc0, acc0, acc0
    first = 0
    if PRELOAD:
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _words_chunk(
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, 0, p0, p1, p2, p3, p4, p5, p6, p7, r0, gi, wi, x_ptr,
            xw_ptr, xq_ptr, st_ptr, q_ptr, h_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, nw_ptr, nww_ptr, out_ptr, n, k, kw,
            kt, ng, nsb, rstd, ROWS, PACKED, SIGNED, G, SB, HAS_MIN, OFFSET, SILU_MUL, NORM, X_WORDS, DP4A,
            CODE_BIAS, EMULATE, True, SIX, LEAN)
        first = BLOCK_W
    for w0 in range(first, kw, BLOCK_W):
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _words_chunk(
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, w0, p0, p1, p2, p3, p4, p5, p6, p7, r0, gi, wi, x_ptr,
            xw_ptr, xq_ptr, st_ptr, q_ptr, h_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, nw_ptr, nww_ptr, out_ptr, n, k, kw,
            kt, ng, nsb, rstd, ROWS, PACKED, SIGNED, G, SB, HAS_MIN, OFFSET, SILU_MUL, NORM, X_WORDS, DP4A,
            CODE_BIAS, EMULATE, False, SIX, LEAN)
    _rows_out(acc0, acc1, acc2, acc3, r0, min(ROWS, 4), n, b_ptr, res_ptr, out_ptr, HAS_BIAS, RESIDUAL)
    if ROWS > 4:
        _rows_out(acc4, acc5, acc6, acc7, r0 + 4, 4, n, b_ptr, res_ptr, out_ptr, HAS_BIAS, RESIDUAL)


@triton.jit
def _dot(x, w, acc, DOT_F32: tl.constexpr):
    """acc + x @ w.T; DOT_F32 (Triton's interpreter, whose bfloat16 dot returns garbage): the same
    rounded operands multiplied in float32 (exact products, as the tensor cores')."""
    if DOT_F32:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w), acc)


@triton.jit
def _mma(w, x_ptr, rm, m_ok, c, c_ok, stride_x, acc, SWAP: tl.constexpr, DOT_F32: tl.constexpr):
    """``acc`` plus the product of the decoded weight tile ``w`` [BLOCK_N, BLOCK_K] with the
    activations of rows ``rm`` at columns ``c``. SWAP: ``acc`` is [BLOCK_N, BLOCK_M] and the weights
    are the MMA's left operand, which Hopper's wgmma takes from registers (no shared-memory round
    trip for the tile just decoded); else ``acc`` is [BLOCK_M, BLOCK_N] (weights on the right)."""
    if SWAP:
        xt = tl.load(x_ptr + rm[None, :] * stride_x + c[:, None], mask=c_ok[:, None] & m_ok[None, :], other=0.0)
        if DOT_F32:
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
    else:
        xv = tl.load(x_ptr + rm[:, None] * stride_x + c[None, :], mask=m_ok[:, None] & c_ok[None, :], other=0.0)
        acc = _dot(xv, w, acc, DOT_F32)
    return acc


@triton.jit
def gemm_tile(mrows, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The output tile of program (``program_id(0)`` over N, ``program_id(1)`` over M): its rows of
    activations ``rm``, of weights ``rn`` (int64) and their masks."""
    rm = (tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    return rm, rn, rm < mrows, rn < n


@triton.jit
def _gguf_gemm_kernel(x_ptr, q_ptr, h_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, b_ptr, out_ptr, ws_ptr, mrows, n, k, stride_x,
                      stride_o, k_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PACKED: tl.constexpr, G: tl.constexpr, SB: tl.constexpr, HAS_MIN: tl.constexpr,
                      BIAS: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, TILED: tl.constexpr,
                      PDL: tl.constexpr, SWAP: tl.constexpr, SPLIT: tl.constexpr, BF16_CODES: tl.constexpr,
                      EVEN: tl.constexpr, SIX: tl.constexpr):
    """One output tile over the code-plane bytes ``[s * k_split, (s + 1) * k_split)`` of split ``s =
    program_id(2)``. SPLIT: the float32 partial sum goes to ``ws`` [splits, M, N] and
    ``_split_k_sum_kernel`` adds the splits in order (deterministic; no atomics)."""
    rm, rn, m_ok, n_ok = gemm_tile(mrows, n, BLOCK_M, BLOCK_N)
    if EVEN:  # N a multiple of BLOCK_N, the code plane's width of BLOCK_K: no weight masks (fewer registers)
        n_ok = tl.full([BLOCK_N], 1, tl.int1)
    kc = k // 2 if PACKED else k
    ng = k // G
    nsb = k // SB if SB > 0 else 1
    cols = tl.arange(0, BLOCK_K)
    dt = x_ptr.dtype.element_ty
    pdl_begin(PDL)
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = tl.program_id(2) * k_split
    for k0 in range(k_lo, tl.minimum(kc, k_lo + k_split), BLOCK_K):
        c = k0 + cols
        if EVEN:
            c_ok = tl.full([BLOCK_K], 1, tl.int1)
        else:
            c_ok = c < kc
        ok = n_ok[:, None] & c_ok[None, :]
        raw = tl.load(q_ptr + rn[:, None] * kc + c[None, :], mask=ok, other=0)
        if BF16_CODES and not PACKED:  # bf16 activations, on the GPU (gemm_decode())
            w = _scale_bf16(_byte_codes_bf16(raw, BIAS), rn, n_ok, k0, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, BLOCK_N,
                            BLOCK_K, G, SB, HAS_MIN)
            acc = _mma(w, x_ptr, rm, m_ok, c, c_ok, stride_x, acc, SWAP, DOT_F32)
        elif BF16_CODES:
            if SIX:  # Q6_K: each code joined with its 2-bit pair in the PTX
                two, shift = _six_bit_high(h_ptr, rn, ok, c, kc)
                lo, hi = _six_codes_bf16(raw, two, shift)
            else:
                lo, hi = _nibble_codes_bf16(raw, BIAS)
            lo = _scale_bf16(lo, rn, n_ok, k0, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, BLOCK_N, BLOCK_K, G, SB, HAS_MIN)
            acc = _mma(lo, x_ptr, rm, m_ok, c, c_ok, stride_x, acc, SWAP, DOT_F32)
            hi = _scale_bf16(hi, rn, n_ok, k0 + kc, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, BLOCK_N, BLOCK_K, G, SB,
                             HAS_MIN)
            acc = _mma(hi, x_ptr, rm, m_ok, c + kc, c_ok, stride_x, acc, SWAP, DOT_F32)
        elif PACKED:
            q_lo, q_hi = _packed_codes(raw, h_ptr, rn, ok, c, kc, SIX)
            lo = _decode(q_lo, rn, n_ok, k0, c, ok, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, BLOCK_N, BLOCK_K, G, SB,
                         HAS_MIN, BIAS, TILED).to(dt)
            acc = _mma(lo, x_ptr, rm, m_ok, c, c_ok, stride_x, acc, SWAP, DOT_F32)
            hi = _decode(q_hi, rn, n_ok, k0 + kc, c + kc, ok, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, BLOCK_N, BLOCK_K,
                         G, SB, HAS_MIN, BIAS, TILED).to(dt)
            acc = _mma(hi, x_ptr, rm, m_ok, c + kc, c_ok, stride_x, acc, SWAP, DOT_F32)
        else:
            w = _decode(raw, rn, n_ok, k0, c, ok, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, BLOCK_N, BLOCK_K, G, SB, HAS_MIN,
                        BIAS, TILED).to(dt)
            acc = _mma(w, x_ptr, rm, m_ok, c, c_ok, stride_x, acc, SWAP, DOT_F32)
    if SPLIT:
        ws = ws_ptr + tl.program_id(2).to(tl.int64) * mrows * n
        if SWAP:
            tl.store(ws + rm[None, :] * n + rn[:, None], acc, mask=m_ok[None, :] & n_ok[:, None])
        else:
            tl.store(ws + rm[:, None] * n + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])
    elif SWAP:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + rm[None, :] * stride_o + rn[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[None, :] & n_ok[:, None])
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * stride_o + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _split_k_sum_kernel(ws_ptr, b_ptr, out_ptr, mrows, n, stride_o, splits, HAS_BIAS: tl.constexpr,
                        BLOCK: tl.constexpr, PDL: tl.constexpr):
    """``out = ws[0] + ws[1] + ... (+ bias)``, splits added in order, one rounding to out's dtype."""
    pdl_begin(PDL)
    plane = tl.cast(mrows, tl.int64) * n  # one split's [M, N] (int64: splits x M x N may pass 2**31)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < plane
    acc = tl.load(ws_ptr + i, mask=ok, other=0.0)
    for s in range(1, splits):
        acc += tl.load(ws_ptr + s * plane + i, mask=ok, other=0.0)
    col = i % n
    if HAS_BIAS:
        acc += tl.load(b_ptr + col, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + (i // n) * stride_o + col, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dequantize_kernel(q_ptr, h_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, out_ptr, n, k, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PACKED: tl.constexpr, G: tl.constexpr, SB: tl.constexpr,
                       HAS_MIN: tl.constexpr, BIAS: tl.constexpr, TILED: tl.constexpr, PDL: tl.constexpr,
                       SIX: tl.constexpr):
    """The dense weights [N, K] (out's dtype) of a [BLOCK_N, BLOCK_K] tile of the code plane, decoded
    as the GEMM decodes them (``_decode``; a 4-bit byte: columns c and c + K/2). The weights are
    constant, so the tile is read and decoded before the PDL wait, overlapping the previous kernel;
    only the stores wait (``out`` may reuse memory that kernel still reads)."""
    rn = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    k0 = tl.program_id(1) * BLOCK_K
    c = k0 + tl.arange(0, BLOCK_K)
    kc = k // 2 if PACKED else k
    n_ok = rn < n
    ok = n_ok[:, None] & (c < kc)[None, :]
    ng = k // G
    nsb = k // SB if SB > 0 else 1
    dt = out_ptr.dtype.element_ty
    raw = tl.load(q_ptr + rn[:, None] * kc + c[None, :], mask=ok, other=0)
    if PACKED:
        q_lo, q_hi = _packed_codes(raw, h_ptr, rn, ok, c, kc, SIX)
        lo = _decode(q_lo, rn, n_ok, k0, c, ok, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, BLOCK_N, BLOCK_K, G, SB,
                     HAS_MIN, BIAS, TILED)
        hi = _decode(q_hi, rn, n_ok, k0 + kc, c + kc, ok, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, BLOCK_N, BLOCK_K,
                     G, SB, HAS_MIN, BIAS, TILED)
        pdl_begin(PDL)
        tl.store(out_ptr + rn[:, None] * k + c[None, :], lo.to(dt), mask=ok)
        tl.store(out_ptr + rn[:, None] * k + (c + kc)[None, :], hi.to(dt), mask=ok)
    else:
        w = _decode(raw, rn, n_ok, k0, c, ok, s_ptr, m_ptr, d_ptr, dm_ptr, ng, nsb, BLOCK_N, BLOCK_K, G, SB, HAS_MIN,
                    BIAS, TILED)
        pdl_begin(PDL)
        tl.store(out_ptr + rn[:, None] * k + c[None, :], w.to(dt), mask=ok)


def dense_weight(w: GGUFPlanes, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense weight [N, K] in ``dtype``, decoded on the device as ``gguf_gemm`` decodes its tiles:
    for ``dense_rows`` products (cuBLAS on the decoded copy, which is dropped after the product).
    ``out``: where to write it (a contiguous [N, K] of ``dtype``, e.g. one part's rows of a layer's
    whole weight)."""
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dense_weight: dtype must be float32, float16 or bfloat16, got {dtype}")
    if out is None:
        out = torch.empty((w.n, w.k), dtype=dtype, device=w.codes.device)
    elif (tuple(out.shape) != (w.n, w.k) or out.dtype != dtype or not out.is_contiguous()
          or out.device != w.codes.device):
        raise ValueError(f"dense_weight: out must be a contiguous [{w.n}, {w.k}] {dtype} on {w.codes.device}, got "
                         f"{list(out.shape)} {out.dtype} on {out.device}{'' if out.is_contiguous() else ', strided'}")
    kc = w.codes.shape[1]
    dev = w.codes.device
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
    block_n, block_k, warps = dense_tile(w.n, kc, sms)
    _dequantize_kernel[(triton.cdiv(w.n, block_n), triton.cdiv(kc, block_k))](
        *_planes_args(w), out, w.n, w.k, BLOCK_N=block_n, BLOCK_K=block_k, **_kind_meta(w), num_warps=warps,
        **pdl_launch(w.codes.device))
    return out


def dense_tile(n: int, kc: int, sms: int) -> tuple[int, int, int]:
    """``dense_weight``'s (rows, code bytes, warps) a program: 128 bytes of each row, and rows halved
    from 64 (down to 8) until the grid fills every multiprocessor twice: in 64-row tiles a small
    projection (SmolLM2's o, 576 x 576) is a grid of 27 programs for the H200's 132 multiprocessors."""
    if _INTERPRET:
        return 64, 512, 4
    block_k, block_n = 128, 64
    while block_n > 8 and triton.cdiv(n, block_n) * triton.cdiv(kc, block_k) < 2 * sms:
        block_n //= 2
    return block_n, block_k, 4 if block_n >= 32 else 2


# DEEPINFER_GGUF_DENSE_ROWS=auto (the default): (largest hidden size, rows from which a product takes
# the decoded weight). Measured on an H100 (2026-12-06, guide 08, "The decoded weight by default"),
# 256 x (128, 256) unless said: the decoded weight won for SmolLM2-135M (576) at 64, 128 and 256
# rows (+41 %, +41 %, +37 %), Qwen3-0.6B (1024) at 64 and 256 (+3 %, +13 %), Llama-3.2-1B (2048;
# Q4_0 +10 %, Q4_K_M +48 %), -3B (3072, Q4_0 +17 %) and Llama-3-8B (4096, Q4_0 +24 %) at 256; it
# lost at 128 rows on the 1B (-22 %) and the 8B (-21 %), where the GEMM splits K and fills the GPU
# and rewriting the weights each step costs more than it saves. Larger models were not measured.
DENSE_ROWS_BY_HIDDEN = ((1024, 64), (4096, 256))


def dense_rows(hidden: int | None) -> int:
    """Rows from which a GGUF product of a model of ``hidden`` size decodes the whole weight to the
    activations' dtype (``dense_weight``) and multiplies with cuBLAS, as vLLM does for the GGUF types
    it has no kernel for (0: never). ``DEEPINFER_GGUF_DENSE_ROWS``: ``auto`` (default) by
    ``DENSE_ROWS_BY_HIDDEN`` (``hidden`` None: a model it was not measured on, never); a number sets
    the rows for every model; 0 turns it off. Small models' products are bound by the tensor cores
    and by tiles too few to fill the GPU (SmolLM2's K = 576 is three 128-byte steps: the GEMM cannot
    split it), where cuBLAS on the decoded copy is faster."""
    rows = switches.integer_or_auto("DEEPINFER_GGUF_DENSE_ROWS")
    if rows is not None:
        return rows
    if hidden is None:
        return 0
    return next((n for most, n in DENSE_ROWS_BY_HIDDEN if hidden <= most), 0)


def _planes_args(w: GGUFPlanes) -> tuple[torch.Tensor, ...]:
    """(codes, high, scale, minimum, d, dmin), each missing plane replaced by one the kernel ignores."""
    s = w.scale
    return (w.codes, w.high if w.high is not None else w.codes, s, w.minimum if w.minimum is not None else s,
            w.d if w.d is not None else s, w.dmin if w.dmin is not None else s)


def _kind_meta(w: GGUFPlanes) -> dict[str, object]:
    _, g, sb, has_min, bias = KINDS[w.kind]
    return dict(PACKED=w.packed, G=g, SB=sb, HAS_MIN=has_min, BIAS=bias, TILED=tiled_scales(), SIX=w.high is not None)


def tiled_scales() -> bool:
    """Scales loaded once per group and broadcast over its columns (default), or gathered per column
    (``DEEPINFER_GGUF_TILED_SCALES=0``, the first version). Same weights; on the H200 the tiled
    loads ran the Llama-3-8B shapes 3-5x faster in the GEMV and 5-10x in the 32-row GEMM
    (bench/gguf_gemv_bench.py: Q4_K gate_up GEMV 320 -> 64 us, Q8_0 126 -> 44 us)."""
    return switches.enabled("DEEPINFER_GGUF_TILED_SCALES")


def word_codes() -> bool:
    """The one-row GEMV reads the code plane as int32 words and converts codes to float by the
    2**23 mantissa trick, summing each group's products before scaling them (default), or reads
    bytes, converts them and scales each weight (``DEEPINFER_GGUF_WORDS=0``, the first version)."""
    return switches.enabled("DEEPINFER_GGUF_WORDS")


def dp4a_gemv() -> bool:
    """The word GEMV takes the activation row rounded to signed bytes (one scale ``amax / 127`` per
    16 columns, once per GEMV) and multiplies four codes by four activations in one PTX ``dp4a``,
    as llama.cpp's CUDA ``mmvq`` does with its 8-bit activations (default; H200 8B batch 1 Q4_0
    452 tok/s against 260 with float32 activations), or keeps float32 activations
    (``DEEPINFER_GGUF_DP4A=0``: each output exact to float32 sums of the bf16 activations)."""
    return switches.enabled("DEEPINFER_GGUF_DP4A")


def one_row_path() -> str:
    """The one-row GEMV the switches select, in words (``deepinfer env``, ``GGUFLinearCUDA.kernel_path``)."""
    if not word_codes():
        return "byte gemv, float32 activations"
    return "word gemv, 8-bit activations (dp4a)" if dp4a_gemv() else "word gemv, float32 activations"


def gguf_gemv(x: torch.Tensor, w: GGUFPlanes, bias: torch.Tensor | None = None, *, silu_mul: bool = False,
              norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None,
              out: torch.Tensor | None = None, config: tuple[int, int, int, int] | None = None,
              preload: bool | None = None, quantized: tuple[torch.Tensor, torch.Tensor] | None = None
              ) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for one row ``x`` [1, K] (``[1, 2K]`` gate/up with ``silu_mul``) and
    the quantized W; [1, N] in ``x``'s dtype. ``norm``/``residual``/``silu_mul`` as ``kernels.gemv.gemv``.
    ``out``: a contiguous [1, N] to write (a slice of a wider output). ``preload`` (the word GEMV):
    each program loads its rows' first chunk of code words before the PDL wait (default: where
    they fit, with ``DEEPINFER_PDL_PREFETCH=1``; ``kernels/pdl.py``). ``quantized``: ``x`` already
    as the dp4a GEMV's 8-bit activations (codes int8 [K], stats float32 [3 * K/16]: per 16
    columns the scale, the integer sum and the float sum, as ``_quantize_activations_kernel``
    writes them; the decode attention's ``quantized`` output), so that kernel is not launched;
    used only by the dp4a GEMV, and not with ``norm`` or ``silu_mul``."""
    n, k = w.n, w.k
    check_one_row("gguf_gemv", x, n, k, f"the {w.kind} weight", silu_mul=silu_mul, bias=bias, norm=norm,
                  residual=residual)
    if x.device != w.codes.device:
        raise ValueError(f"gguf_gemv: x is on {x.device}, the weight on {w.codes.device}")
    if quantized is not None:
        if norm is not None or silu_mul:
            raise ValueError("gguf_gemv: quantized activations are the row as it is: not with norm or silu_mul")
        _check_activations("quantized", quantized, k, x.device)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device) if out is None else out
    words = word_codes()
    dp4a = words and dp4a_gemv()
    block_n, block_k, warps, stages = config or (dp4a_config(w) if dp4a else
                                                 WORDS_GEMV_CONFIG_BY_KIND.get(w.kind, WORDS_GEMV_CONFIG) if words
                                                 else GEMV_CONFIG)
    if min(block_n, warps, stages) < 1 or block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"gguf_gemv: config must be (BLOCK_N, BLOCK_K a power of two >= 16, num_warps, "
                         f"num_stages) of positive integers, got {(block_n, block_k, warps, stages)!r}")
    if words:
        _, g, sb, has_min, code_bias = KINDS[w.kind]
        packed = w.packed
        signed = w.codes.dtype == torch.int8
        rows = 8 if block_n >= 8 else (4 if block_n >= 4 else (2 if block_n >= 2 else 1))
        codes = w.codes.view(torch.int32)
        high = codes if w.high is None else w.high.view(torch.int64)  # (Q6_K) one int64 a tile row
        nw = norm[0] if norm is not None else out
        eps = norm[1] if norm is not None else 0.0
        norm_block = triton.next_power_of_2(k) if norm is not None else 1
        if dp4a and quantized is not None:  # quantized by the kernel that wrote x
            xq, st = quantized
            xq_words, x_words, xw = xq.view(torch.int32), False, x
            fused_norm = False
        elif dp4a:  # the activations quantized once, with the RMSNorm / SiLU·mul applied there
            xq, st = quantize_activations(x, k, silu_mul, norm, rounding=out)
            xq_words, x_words, xw = xq.view(torch.int32), False, x
            silu_mul, norm_block, fused_norm = False, 1, False
        else:
            # 16-bit activations are read as 64-bit words of four (one per code word); others per
            # column (the row as one vector: a row of a wider buffer has any row stride; it must
            # start on a 64-bit word, and so must the norm weight)
            x_words = (x.element_size() == 2 and k % 8 == 0 and x.storage_offset() % 4 == 0
                       and (norm is None or norm[0].storage_offset() % 4 == 0))
            xw = x[0].view(torch.int64) if x_words else x
            xq_words, st, fused_norm = codes, out, norm is not None
        block_w = max(block_k // 4, 4)  # code words a row a chunk
        lean = lean_gemv(n, codes.shape[1], rows, block_w)
        _gguf_gemv_words_kernel[(triton.cdiv(n, rows),)](
            x, xw, xq_words, st, codes, high, *_planes_args(w)[2:], bias if bias is not None else out, nw,
            nw.view(torch.int64) if x_words and norm is not None else nw, residual if residual is not None else out,
            out, n, k, codes.shape[1], eps, ROWS=rows, BLOCK_W=block_w,
            PACKED=packed, SIGNED=signed, G=g, SB=sb, HAS_MIN=has_min,
            OFFSET=8388608.0 + code_bias + (128.0 if signed else 0.0), SILU_MUL=silu_mul, NORM=fused_norm,
            NORM_BLOCK=norm_block, HAS_BIAS=bias is not None,
            RESIDUAL=residual is not None, X_WORDS=x_words, DP4A=dp4a, CODE_BIAS=float(code_bias),
            EMULATE=_INTERPRET, num_warps=warps, num_stages=stages,
            PRELOAD=prefetch_fits(rows * block_w * 4, warps) if preload is None else preload,
            SIX=w.high is not None, LEAN=lean,
            **({"maxnreg": LEAN_MAXNREG.get(w.kind, 64)} if lean or switches.enabled("DEEPINFER_GGUF_GEMV_MAXNREG")
               else {}),
            **pdl_launch(x.device))
        return out
    if _INTERPRET:  # Triton's interpreter runs programs one by one: fewer, wider ones (same products)
        block_n = max(block_n, 64)
    _gguf_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, *_planes_args(w), bias if bias is not None else out, norm[0] if norm is not None else out,
        residual if residual is not None else out, out, n, k, norm[1] if norm is not None else 0.0,
        BLOCK_N=block_n, BLOCK_K=block_k, **_kind_meta(w), SILU_MUL=silu_mul, NORM=norm is not None,
        NORM_BLOCK=triton.next_power_of_2(k) if norm is not None else 1, HAS_BIAS=bias is not None,
        RESIDUAL=residual is not None, num_warps=warps, num_stages=stages, **pdl_launch(x.device))
    return out


def lean_gemv(n: int, kw: int, rows: int, block_w: int) -> bool:
    """``DEEPINFER_GGUF_GEMV_LEAN`` (experimental), where the word GEMV's tiles divide the weight
    (``n`` rows of ``kw`` code words by ``rows`` and ``block_w``: every Llama-shape projection): the
    fewer-instruction form (no load masks, chained ``dp4a``, shifts for divisions), launched with
    ``LEAN_MAXNREG`` registers a thread so that ptxas keeps a pass's loads ahead of its products."""
    return n % rows == 0 and kw % block_w == 0 and switches.enabled("DEEPINFER_GGUF_GEMV_LEAN")


def dp4a_config(w: GGUFPlanes) -> tuple[int, int, int, int]:
    """The dp4a GEMV's (ROWS, BLOCK_K, num_warps, num_stages) for the weight ``w``."""
    if w.n <= NARROW_MAX_N and w.k >= 4096:
        return DP4A_NARROW_CONFIG_BY_KIND.get(w.kind, DP4A_GEMV_CONFIG)
    return DP4A_CONFIG_BY_KIND.get(w.kind, DP4A_GEMV_CONFIG)


def _check_activations(name: str, act: tuple[torch.Tensor, torch.Tensor], k: int, device: torch.device) -> None:
    """ValueError unless ``act`` is (int8 codes [k], float32 stats [3 * k/16]), contiguous on ``device``."""
    xq, st = act
    if (xq.dtype != torch.int8 or xq.numel() != k or not xq.is_contiguous() or st.dtype != torch.float32
            or st.numel() != 3 * (k // 16) or not st.is_contiguous() or xq.device != device or st.device != device):
        raise ValueError(f"gguf_gemv: {name} must be (int8 codes [{k}], float32 stats [{3 * (k // 16)}]) "
                         f"contiguous on {device}, got {xq.dtype} {tuple(xq.shape)} on {xq.device} "
                         f"and {st.dtype} {tuple(st.shape)} on {st.device}")


def gemm_decode() -> str:
    """How the GEMM turns codes into bfloat16 weights (``DEEPINFER_GGUF_GEMM_DECODE``):
    "bf16" (default on the GPU, for ``BF16_CODE_KINDS``): codes to exact bfloat16 by PTX bit tricks
    (both nibbles of 4 bytes in 13 instructions), times each group's scale rounded to bfloat16,
    in one bf16 FMA; "f32" (and always Q8_0: ``BF16_CODE_KINDS``): each weight in float32 as gguf
    computes it (``_decode``), then rounded to bfloat16 (the weights of the file dequantized to
    bfloat16 exactly; Triton's interpreter always takes it, since it runs no PTX). The "bf16" weight
    rounds the scale too: a Q4_0 or Q6_K weight at most 2**-7 off gguf's instead of 2**-8
    (bfloat16's unit roundoff); with a minimum (Q4_1, Q4_K, Q5_K) the minimum's rounding adds up
    to 2**-8 of it."""
    return switches.choice("DEEPINFER_GGUF_GEMM_DECODE", ("bf16", "f32"))


def bf16_codes(w: GGUFPlanes, dtype: torch.dtype) -> bool:
    """Whether ``gguf_gemm`` of ``w`` with ``dtype`` activations takes the "bf16" decode."""
    # (not "cuda" only: tests/runtime/sm90_compile_check.py compiles it from meta tensors)
    return (gemm_decode() == "bf16" and w.kind in BF16_CODE_KINDS and dtype == torch.bfloat16 and not _INTERPRET
            and w.codes.device.type != "cpu" and tiled_scales())


def unmasked_tiles(w: GGUFPlanes, block_n: int, block_k: int) -> bool:
    """Whether the GEMM drops its weight masks: for the types without super-blocks (Q4_0, Q4_1,
    Q8_0) where the tiles divide the code plane (every Llama-shape projection). The masks of
    [BLOCK_N, BLOCK_K] cost instructions, not registers: the 32-row sm_90 kernel as a graph
    launches it (its integer arguments specialised as multiples of 16) spills nothing either way,
    and has 1,152 instructions without the masks against 1,224 with them (Q4_0). End to end (H100,
    8B shape, 32 concurrent, same call) Q4_0 gained 1.4 % (6,109 against 6,023 tok/s) but Q4_K_M
    lost 0.5 % (4,316 against 4,339), so the K-quants keep their masks; Q4_1 and Q8_0 were not
    measured apart."""
    return KINDS[w.kind][2] == 0 and w.n % block_n == 0 and w.codes.shape[1] % block_k == 0


def gemm_swap_rows() -> int:
    """Rows up to which ``gguf_gemm`` takes the swapped tile (``DEEPINFER_GGUF_GEMM_SWAP_ROWS``)."""
    return switches.integer("DEEPINFER_GGUF_GEMM_SWAP_ROWS")


def gemm_split_k() -> int:
    """``DEEPINFER_GGUF_GEMM_SPLIT_K``: 0 (default) chooses the K splits from the shape
    (``choose_split_k``) in CUDA graphs and does not split eager products, 1 never splits, a
    larger value splits K that many ways everywhere."""
    return switches.integer("DEEPINFER_GGUF_GEMM_SPLIT_K")


def _capturing(device: torch.device) -> bool:
    """True while a CUDA graph is being captured on the current stream. Eager products keep one
    kernel: at batch 1 on the H200 (8B, 128-token prompts run eagerly), splitting the prompt's
    products cost 2.5-3 % of output tok/s (an ABBA run, guide 08), while captured decode steps of
    32 and 128 rows gained 14-88 %."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def choose_split_k(kind: str, tiles: int, rows: int, k_steps: int, sms: int) -> int:
    """K splits for a GEMM of ``tiles`` output tiles, ``rows`` activation rows and ``k_steps``
    BLOCK_K steps on ``sms`` multiprocessors. Up to 32 rows (decode batches), by type
    (``SPLIT_K_FEW_ROWS``): fewer tiles than two a multiprocessor (a projection of 4096 or 6144
    outputs has 64 or 96 along N) 6 splits; fewer than four (gate_up at 28672 outputs) 3 for the
    types whose decode costs most, 1 for Q4_0 (its two-stage tile fits four programs a
    multiprocessor: 448 tiles in one wave), else 2. More rows: 4 splits (6 for
    ``SPLIT_K_HEAVY_KINDS``) below two tiles a multiprocessor, none beyond. At least
    SPLIT_K_MIN_STEPS steps a split. The sweeps behind these numbers are in guide 08 ("Split K")."""
    if rows <= 32:
        narrow, wide = SPLIT_K_FEW_ROWS.get(kind, SPLIT_K_FEW_ROWS_DEFAULT)
        want = narrow if tiles < 2 * sms else wide if tiles < 4 * sms else 1
    else:
        want = (6 if kind in SPLIT_K_HEAVY_KINDS else 4) if tiles < 2 * sms else 1
    return max(1, min(want, k_steps // SPLIT_K_MIN_STEPS))


def gemm_tuning_kind(w: GGUFPlanes) -> str:
    """The type whose measured GEMM choices (``gemm_swapped``, ``gemm_tile_for``, ``choose_split_k``)
    ``w`` takes: its own, but Q4_K's for Q6_K at 6 bits (``DEEPINFER_GGUF_Q6K_6BIT``), whose tiles
    are then a packed type's: two decoded halves and two MMAs a K step, as Q4_K's.
    ``DEEPINFER_GGUF_Q6K_6BIT_TUNING=byte`` gives it one-byte Q6_K's choices instead
    (``packed-k64``: Q4_K's with 64-wide K steps, ``gemm_weight_tile``)."""
    if w.high is not None and six_bit_tuning() != "byte":
        return "Q4_K"
    return w.kind


def six_bit_tuning() -> str:
    """``DEEPINFER_GGUF_Q6K_6BIT_TUNING``: packed (default), packed-k64 or byte."""
    return switches.choice("DEEPINFER_GGUF_Q6K_6BIT_TUNING", ("packed", "packed-k64", "byte"))


def gemm_weight_tile(w: GGUFPlanes, rows: int, swap: bool) -> tuple[int, int, int, int, int]:
    """``gemm_tile_for`` the type whose choices ``w`` takes (``gemm_tuning_kind``). Under
    ``DEEPINFER_GGUF_Q6K_6BIT_TUNING=packed-k64`` a 6-bit Q6_K tile steps K by 64 instead of 128:
    the 128-wide tile's bf16 decode needs 190 registers a thread at 32 rows (two programs a
    multiprocessor), the 64-wide one 96-128 (sm90_compile_check.py)."""
    tile = gemm_tile_for(gemm_tuning_kind(w), rows, swap)
    if w.high is not None and tile[2] > 64 and six_bit_tuning() == "packed-k64":
        return (tile[0], tile[1], 64, tile[3], tile[4])
    return tile


def gemm_swapped(kind: str, rows: int, capturing: bool) -> bool:
    """Whether ``gguf_gemm`` takes the swapped tile by default for ``rows`` rows of a ``kind``
    weight: up to ``gemm_swap_rows()`` rows, and up to 32 only for ``SWAP_FEW_ROWS_KINDS`` and,
    while a CUDA graph is captured (``capturing``), ``SWAP_SPLIT_FEW_ROWS_KINDS``."""
    return rows <= gemm_swap_rows() and (rows > 32 or kind in SWAP_FEW_ROWS_KINDS
                                         or (capturing and kind in SWAP_SPLIT_FEW_ROWS_KINDS))


def gemm_tile_for(kind: str, rows: int, swap: bool) -> tuple[int, int, int, int, int]:
    """``gguf_gemm``'s default (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for ``rows`` rows of a
    ``kind`` weight, plain or ``swap``ped (BLOCK_M is then cut to the rows)."""
    if not swap:
        return GEMM_CONFIG_FEW_ROWS if rows <= 32 else GEMM_CONFIG
    if rows > 32:
        return GEMM_CONFIG_SWAP_BY_KIND.get(kind, GEMM_CONFIG_SWAP)
    from_rows, few = GEMM_CONFIG_SWAP_FEW_ROWS_BY_KIND.get(kind, (1, GEMM_CONFIG_SWAP_FEW_ROWS))
    return few if rows >= from_rows else GEMM_CONFIG_SWAP_FEW_ROWS


def gguf_gemm(x: torch.Tensor, w: GGUFPlanes, bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
              config: tuple[int, int, int, int, int] | None = None, swap: bool | None = None,
              split_k: int | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for ``x`` [M, K] (rows contiguous) and the quantized W; [M, N] in
    ``x``'s dtype (weights decoded to that dtype in registers). ``out``: an [M, N] view with
    contiguous rows to write. ``swap``: the weights as the MMA's left operand (default: up to
    ``gemm_swap_rows()`` rows, and up to 32 only for ``SWAP_FEW_ROWS_KINDS`` and, in CUDA graphs,
    ``SWAP_SPLIT_FEW_ROWS_KINDS``); ``config``:
    (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); ``split_k``: K split that many ways, float32
    partial sums added in order by a second kernel (default: ``gemm_split_k()``)."""
    n, k = w.n, w.k
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"gguf_gemm: x must be [M, {k}] with contiguous rows, got shape {tuple(x.shape)}")
    if x.device != w.codes.device:
        raise ValueError(f"gguf_gemm: x is on {x.device}, the weight on {w.codes.device}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"gguf_gemm: bias must be a contiguous [{n}] vector, got shape {tuple(bias.shape)}")
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    if m == 0:
        return out
    capturing = _capturing(x.device)
    tuning = gemm_tuning_kind(w)
    if swap is None:
        swap = gemm_swapped(tuning, m, capturing)
    block_m, block_n, block_k, warps, stages = config or gemm_weight_tile(w, m, swap)
    block_m = max(16, min(block_m, triton.next_power_of_2(m)))
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    k_steps = triton.cdiv(w.codes.shape[1], block_k)
    split = gemm_split_k() if split_k is None else split_k
    if split < 0:
        raise ValueError(f"gguf_gemm: split_k must be >= 0, got {split}")
    if split == 0:  # chosen: only inside a CUDA graph, where the sum kernel's launch costs no CPU time
        split = choose_split_k(tuning, tiles, m, k_steps, torch.cuda.get_device_properties(
            x.device).multi_processor_count) if capturing else 1
    k_split = triton.cdiv(k_steps, min(split, k_steps)) * block_k
    split = triton.cdiv(w.codes.shape[1], k_split)  # no empty split
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
    b = bias if bias is not None else out
    pdl = pdl_launch(x.device)
    _gguf_gemm_kernel[grid](x, *_planes_args(w), b, out, ws, m, n, k, x.stride(0), out.stride(0), k_split,
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **_kind_meta(w),
                            HAS_BIAS=bias is not None, DOT_F32=_INTERPRET or x.dtype == torch.float32,
                            SWAP=swap, SPLIT=split > 1, BF16_CODES=bf16_codes(w, x.dtype),
                            EVEN=unmasked_tiles(w, block_n, block_k), num_warps=warps,
                            num_stages=stages, **pdl)
    if split > 1:
        _split_k_sum_kernel[(triton.cdiv(m * n, SPLIT_K_SUM_BLOCK),)](
            ws, b, out, m, n, out.stride(0), split, HAS_BIAS=bias is not None, BLOCK=SPLIT_K_SUM_BLOCK,
            num_warps=4, **pdl)
    return out
