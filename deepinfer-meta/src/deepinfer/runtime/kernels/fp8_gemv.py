"""Products with FP8 (E4M3) weights and per-output-channel float32 scales (Triton), activations
bfloat16/float16: ``y = (x @ q.T) * scale (+ bias)``.

- ``fp8_gemv``: one row (a decode step of one sequence). The bf16 GEMV of ``kernels/gemv.py``
  with 1-byte weights: half the bytes streamed per step. Same fusions and helpers (RMSNorm
  prologue, residual epilogue, SiLU·mul input, PDL); the row's scale multiplies the float32
  sum before the epilogue. Two more: ``silu_out`` (a gate/up projection whose epilogue stores
  SiLU(gate)·up, each program pairing gate and up rows) and several row tiles a program where K
  fits one chunk (the activation row made once for all of them).
- ``fp8_gemm``: several rows (prefill, batched decode). Each program loads fp8 weight tiles,
  widens them to the activation dtype in registers and runs ``tl.dot`` (float32 accumulate);
  the scales multiply the accumulator once. The weights are never dequantized in memory.
- the FP8-activation products of many rows (``torch._scaled_mm``) are in ``kernels/fp8_act.py``.

``fp8_gemv``'s ``math`` picks how a weight tile meets the activations (bench/fp8_sweep.py times
them; widening every weight to float32 costs two conversions per byte, which bounds the "f32"
kernel below the memory bandwidth):
- "f32": widen to float32, float32 FMA (1.28-1.79x the bf16 GEMV on the H200);
- "f16": widen to float16 (one packed conversion per two weights), float16 products of the
  activations times 2^-8 (no overflow below |x| = 2^11; the scale takes the 2^8 back), summed in
  float16 over 16 columns, then float32 (the default: 1.64-1.91x the bf16 GEMV, the error of
  the f32 math; overflows only if a product's 16-column group sums past 65504, |x| >~ 2^11 each);
- "f16bits": as "f16", the float16 weights made from the E4M3 bits by integer shifts (code *
  2^-8 exactly, subnormals included) instead of the conversion instruction;
- "mma": the activation chunk quantized to E4M3 with its own scale and ``tl.dot`` of the fp8
  tiles on the tensor cores (no weight conversion at all; adds activation quantization error,
  ~2^-4 / sqrt(3) rms per element, as the FP8-activation GEMM does). Needs BLOCK_N >= 16.

No host syncs and no allocation other than the outputs: every path runs inside CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.runtime import switches
from deepinfer.runtime.kernels.fp8_act import e4m3_grid
from deepinfer.runtime.kernels.gemv import (
    _activation_chunk,
    _gemv_epilogue,
    _row_rstd,
    _silu_mul_epilogue,
    _tile_rows,
    check_one_row,
    check_silu_out,
)
from deepinfer.runtime.kernels.pdl import pdl_begin, pdl_launch

# (BLOCK_N, BLOCK_K, num_warps, num_stages): 16-byte loads of fp8 are 16 values, so the tile
# covers twice the columns of the bf16 one for the same bytes per load.
DEFAULT_CONFIG = (2, 2048, 4, 3)
WIDE_K_CONFIG = (2, 2048, 4, 3)  # K >= 8192 (Llama-3-8B's down projection); bench/fp8_check.py --part sweep


MATHS = ("f32", "f16", "mma", "f16bits")
# the tile of each non-default math (bench/fp8_sweep.py --part gemv)
MATH_CONFIGS = {"f16": (4, 2048, 8, 2), "f16bits": (4, 2048, 8, 2), "mma": (16, 512, 4, 3)}


def one_row_math() -> str:
    """The default ``math`` of ``fp8_gemv`` (``DEEPINFER_FP8_ONE_ROW_MATH``)."""
    return switches.choice("DEEPINFER_FP8_ONE_ROW_MATH", MATHS)


PROJECTIONS = ("qkv", "o", "gate_up", "down")
# per projection and math, where the sweep found a better tile
# (H200, Llama-3-8B shapes: bench/fp8_sweep.py --part gemv; the f16 down's 8 rows and the row tiles
# below from the decode step's own replays, bench/decode_profile.py --quantization fp8, H100)
PROJECTION_CONFIGS: dict[tuple[str, str], tuple[int, int, int, int]] = {
    ("qkv", "f16"): (8, 1024, 8, 2), ("o", "f16"): (4, 2048, 8, 2), ("gate_up", "f16"): (4, 2048, 8, 2),
    ("down", "f16"): (8, 2048, 8, 2),
    ("qkv", "f32"): (2, 2048, 4, 3), ("o", "f32"): (8, 1024, 8, 2), ("gate_up", "f32"): (8, 1024, 8, 2),
    ("down", "f32"): (2, 2048, 4, 3),
}
# The projections whose input row carries the RMSNorm (qkv, gate_up): where K fits one chunk
# (ROW_TILES_MAX_K), 4 row tiles of 4 rows a program, the normed row made once for all of them
# instead of once per 4 rows (Llama-3-8B fp8 step 0.969 and 0.988 of the default, 0.911 with the
# SiLU in gate/up and down's 8 rows; end to end 271 -> 298 tok/s, H100).
ROW_TILES: dict[tuple[str, str], tuple[int, int, int, int]] = {("qkv", "f16"): (4, 8, 2, 4),
                                                               ("gate_up", "f16"): (4, 8, 2, 4)}
ROW_TILES_MAX_K = 4096
ROW_TILES_MIN_N = 4096  # 256 programs of 16 rows at least: a small model's projection keeps one tile a program


def one_row_config(k: int, math: str = "f32", projection: str | None = None, n: int = 0) -> tuple[int, ...]:
    """The one-row tile for ``k`` inputs, ``math``, and (when known) the ``projection`` and its ``n``
    weight rows (``DEEPINFER_FP8_ONE_ROW_TILES`` overrides a projection's, for benchmarks). BLOCK_N
    counts weight rows, also where ``silu_out`` pairs them."""
    if projection is not None:
        given = switches.tiles("DEEPINFER_FP8_ONE_ROW_TILES", PROJECTIONS, (4, 5)).get(projection)
        if given:
            return given
    if projection is not None and (projection, math) in ROW_TILES and k <= ROW_TILES_MAX_K and n >= ROW_TILES_MIN_N:
        block_n, warps, stages, tiles = ROW_TILES[(projection, math)]
        return (block_n, max(16, triton.next_power_of_2(k)), warps, stages, tiles)
    if projection is not None and (projection, math) in PROJECTION_CONFIGS:
        return PROJECTION_CONFIGS[(projection, math)]
    if math in MATH_CONFIGS:
        return MATH_CONFIGS[math]
    return WIDE_K_CONFIG if k >= 8192 else DEFAULT_CONFIG


@triton.jit
def _weight_chunk_dot(w, xv, acc, MATH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + the products of the weight tile w [BLOCK_N, BLOCK_K] (fp8) with the float32 chunk xv."""
    if MATH == 0:
        acc += w.to(tl.float32) * xv[None, :]
    elif MATH == 1:
        p = w.to(tl.float16) * (xv * 0.00390625).to(tl.float16)[None, :]
        acc += tl.sum(tl.reshape(p, (BLOCK_N, BLOCK_K // 16, 16)), axis=2, dtype=tl.float16).to(tl.float32)
    elif MATH == 3:
        # the E4M3 bits moved into a float16's (sign; exponent and mantissa 7 places up): code * 2^-8
        b = w.to(tl.uint8, bitcast=True).to(tl.int16)
        w16 = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)
        p = w16 * xv.to(tl.float16)[None, :]
        acc += tl.sum(tl.reshape(p, (BLOCK_N, BLOCK_K // 16, 16)), axis=2, dtype=tl.float16).to(tl.float32)
    else:
        a = tl.max(tl.abs(xv), axis=0)
        xs = tl.where(a > 0, tl.math.div_rn(a, 448.0), 1.0)  # IEEE division (`/` is approximate)
        xq = e4m3_grid(tl.minimum(tl.maximum(tl.math.div_rn(xv, xs), -448.0), 448.0)).to(tl.float8e4nv)
        d = tl.dot(w, tl.broadcast_to(xq[:, None], (BLOCK_K, 16)))  # 16 equal columns: the MMA's narrowest N
        acc += d * xs
    return acc


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, nw_ptr, res_ptr, out_ptr, n, k, stride_w, eps,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr, HAS_BIAS: tl.constexpr,
                     NORM: tl.constexpr, NORM_BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr,
                     MATH: tl.constexpr, SILU_OUT: tl.constexpr, TILES: tl.constexpr = 1):
    pid = tl.program_id(0)
    if TILES > 1:
        # In a function of its own: Triton compiles the code after this branch's return too.
        _fp8_gemv_tiles(x_ptr, w_ptr, s_ptr, b_ptr, nw_ptr, res_ptr, out_ptr, pid, n, k, stride_w, eps, BLOCK_N,
                        BLOCK_K, SILU_MUL, HAS_BIAS, NORM, NORM_BLOCK, RESIDUAL, PDL, MATH, SILU_OUT, TILES)
        return
    rows, row_ok = _tile_rows(pid, n, BLOCK_N, SILU_OUT)
    cols = tl.arange(0, BLOCK_K)
    # first weight tile before waiting for the previous kernel (PDL), as kernels/gemv.py does
    w_first = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :], mask=row_ok[:, None] & (cols < k)[None, :],
                      other=0.0)
    pdl_begin(PDL)
    rstd = _row_rstd(x_ptr, k, eps, NORM, NORM_BLOCK)
    xv = _activation_chunk(x_ptr, nw_ptr, out_ptr, cols, cols < k, k, rstd, SILU_MUL, NORM)
    acc = _weight_chunk_dot(w_first, xv, _fp8_acc(MATH, BLOCK_N, BLOCK_K), MATH, BLOCK_N, BLOCK_K)
    for k0 in range(BLOCK_K, k, BLOCK_K):
        c = k0 + cols
        c_ok = c < k
        xv = _activation_chunk(x_ptr, nw_ptr, out_ptr, c, c_ok, k, rstd, SILU_MUL, NORM)
        w = tl.load(w_ptr + rows[:, None] * stride_w + c[None, :], mask=row_ok[:, None] & c_ok[None, :], other=0.0)
        acc = _weight_chunk_dot(w, xv, acc, MATH, BLOCK_N, BLOCK_K)
    _fp8_epilogue(acc, rows, row_ok, pid, n, s_ptr, b_ptr, res_ptr, out_ptr, BLOCK_N, HAS_BIAS, RESIDUAL, MATH,
                  SILU_OUT)


@triton.jit
def _fp8_gemv_tiles(x_ptr, w_ptr, s_ptr, b_ptr, nw_ptr, res_ptr, out_ptr, pid, n, k, stride_w, eps,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr, HAS_BIAS: tl.constexpr,
                    NORM: tl.constexpr, NORM_BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr,
                    MATH: tl.constexpr, SILU_OUT: tl.constexpr, TILES: tl.constexpr):
    """TILES row tiles of one program, K in one chunk (BLOCK_K >= K): the activation row (its norm,
    its SiLU) is made once and kept in registers while the tiles' weights stream, each tile's
    loads issued before the previous tile's product."""
    cols = tl.arange(0, BLOCK_K)
    c_ok = cols < k
    rows, row_ok = _tile_rows(pid * TILES, n, BLOCK_N, SILU_OUT)
    w = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :], mask=row_ok[:, None] & c_ok[None, :], other=0.0)
    pdl_begin(PDL)
    rstd = _row_rstd(x_ptr, k, eps, NORM, NORM_BLOCK)
    xv = _activation_chunk(x_ptr, nw_ptr, out_ptr, cols, c_ok, k, rstd, SILU_MUL, NORM)
    for t in tl.static_range(TILES):
        if t + 1 < TILES:
            rows_next, ok_next = _tile_rows(pid * TILES + t + 1, n, BLOCK_N, SILU_OUT)
            w_next = tl.load(w_ptr + rows_next[:, None] * stride_w + cols[None, :],
                             mask=ok_next[:, None] & c_ok[None, :], other=0.0)
        acc = _weight_chunk_dot(w, xv, _fp8_acc(MATH, BLOCK_N, BLOCK_K), MATH, BLOCK_N, BLOCK_K)
        _fp8_epilogue(acc, rows, row_ok, pid * TILES + t, n, s_ptr, b_ptr, res_ptr, out_ptr, BLOCK_N, HAS_BIAS,
                      RESIDUAL, MATH, SILU_OUT)
        if t + 1 < TILES:
            w, rows, row_ok = w_next, rows_next, ok_next


@triton.jit
def _fp8_acc(MATH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The float32 accumulator of ``_weight_chunk_dot`` for MATH, zeroed."""
    if MATH == 0:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    elif MATH == 1 or MATH == 3:
        acc = tl.zeros((BLOCK_N, BLOCK_K // 16), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    return acc


@triton.jit
def _fp8_epilogue(acc, rows, row_ok, tile, n, s_ptr, b_ptr, res_ptr, out_ptr, BLOCK_N: tl.constexpr,
                  HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr, MATH: tl.constexpr, SILU_OUT: tl.constexpr):
    """The rows' sums from the accumulator, times their scales, then the GEMV's epilogue (or SiLU·mul)."""
    if MATH == 2:
        y = tl.sum(acc, axis=1) * 0.0625  # the 16 equal columns
    else:
        y = tl.sum(acc, axis=1)
    if MATH == 1 or MATH == 3:
        y = y * 256.0
    y = y * tl.load(s_ptr + rows, mask=row_ok, other=0.0)
    if SILU_OUT:
        _silu_mul_epilogue(y, rows, row_ok, tile, n, b_ptr, out_ptr, BLOCK_N, HAS_BIAS)
    else:
        _gemv_epilogue(y, rows, row_ok, tile, n, b_ptr, res_ptr, out_ptr, out_ptr, out_ptr, HAS_BIAS, RESIDUAL, False)


@triton.jit
def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, m, n, k, stride_x, stride_w, stride_o,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     PRECISION: tl.constexpr):
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(0)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < m
    n_ok = rn < n
    dt = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        c = k0 + rk
        c_ok = c < k
        a = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_x + c[None, :], mask=m_ok[:, None] & c_ok[None, :],
                    other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_w + c[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0.0)
        # e4m3 values are exact in bf16/fp16; float32 (tests) multiplies in full precision
        acc = tl.dot(a, tl.trans(w.to(dt)), acc, input_precision=PRECISION)
    y = acc * tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_o + rn[None, :], y.to(dt), mask=m_ok[:, None] & n_ok[None, :])


def _check_weight(name: str, weight: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    if weight.dim() != 2 or weight.stride(1) != 1 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: weight must be float8_e4m3fn [N, K] with contiguous rows, got {weight.dtype} "
                         f"shape {tuple(weight.shape)}")
    n, k = weight.shape
    if scale.shape != (n,) or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(f"{name}: scale must be a contiguous float32 [{n}] vector, got {scale.dtype} "
                         f"shape {tuple(scale.shape)}")
    return n, k


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, *,
             silu_mul: bool = False, norm: tuple[torch.Tensor, float] | None = None,
             residual: torch.Tensor | None = None, config: tuple[int, ...] | None = None,
             out: torch.Tensor | None = None, math: str | None = None,
             projection: str | None = None, silu_out: bool = False) -> torch.Tensor:
    """``(x @ weight.float().T) * scale (+ bias)`` for one row ``x`` [1, K] (or [1, 2K] with
    ``silu_mul``); ``norm``/``residual``/``silu_mul`` as in ``kernels.gemv.gemv``. Returns [1, N]
    in ``x``'s dtype. ``math``: one of ``MATHS`` (module docstring; default ``one_row_math()``).

    ``silu_out``: ``weight`` is a gate/up projection [2I, K] (gate rows, then up rows); returns
    ``silu_mul`` of the product, [1, I] (each program multiplies matching gate and up rows, so the
    down projection reads its input ready instead of every program computing the SiLU again).
    ``config``'s BLOCK_N then counts both rows of a pair (even).

    ``config`` (BLOCK_N, BLOCK_K, num_warps, num_stages[, tiles]): with tiles > 1 (K in one chunk)
    each program makes the activation row once and streams ``tiles`` row tiles with it."""
    n, k = _check_weight("fp8_gemv", weight, scale)
    math = math or one_row_math()
    if math not in MATHS:
        raise ValueError(f"fp8_gemv: math must be one of {list(MATHS)}, got {math!r}")
    check_one_row("fp8_gemv", x, n, k, "weight", silu_mul=silu_mul, bias=bias, norm=norm, residual=residual)
    cfg = config or one_row_config(k, math, projection, n)
    if len(cfg) not in (4, 5) or min(cfg) < 1:
        raise ValueError(f"fp8_gemv: config must be (BLOCK_N, BLOCK_K, num_warps, num_stages[, row tiles a "
                         f"program]) of positive integers, got {cfg!r}")
    block_n, block_k, warps, stages, tiles = (*cfg, 1)[:5]
    if tiles > 1 and block_k < k:
        raise ValueError(f"fp8_gemv: {tiles} row tiles a program need K in one chunk (BLOCK_K >= {k}), "
                         f"got BLOCK_K {block_k}")
    if silu_out:
        check_silu_out("fp8_gemv", n, block_n, 1, residual, silu_mul)
        n //= 2
    if math in ("f16", "f16bits") and block_k % 16:
        raise ValueError(f"fp8_gemv: math={math!r} needs BLOCK_K a multiple of 16, got {block_k}")
    if math == "mma" and (block_n < 16 or block_k < 32):
        raise ValueError(f"fp8_gemv: math='mma' needs BLOCK_N >= 16 and BLOCK_K >= 32, got {block_n}, {block_k}")
    out = torch.empty((1, n), dtype=x.dtype, device=x.device) if out is None else out
    _fp8_gemv_kernel[(triton.cdiv(triton.cdiv(n, block_n // 2 if silu_out else block_n), tiles),)](
        x, weight, scale, bias if bias is not None else scale, norm[0] if norm is not None else scale,
        residual if residual is not None else out, out, n, k, weight.stride(0), norm[1] if norm is not None else 0.0,
        BLOCK_N=block_n, BLOCK_K=block_k, SILU_MUL=silu_mul, HAS_BIAS=bias is not None, NORM=norm is not None,
        NORM_BLOCK=triton.next_power_of_2(k) if norm is not None else 1, RESIDUAL=residual is not None,
        MATH=MATHS.index(math), SILU_OUT=silu_out, TILES=tiles, num_warps=warps, num_stages=stages,
        **pdl_launch(x.device))
    return out


def gemm_config(m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of ``fp8_gemm`` for ``m`` rows: few rows
    are bound by the weight stream (narrow M, wide N and K tiles), many by the tensor cores."""
    if m <= 16:
        return 16, 64, 256, 4, 4
    if m <= 32:
        return 32, 64, 256, 4, 4
    if m <= 64:
        return 64, 64, 128, 4, 4
    return 128, 128, 64, 8, 3


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
             config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``(x @ weight.T) * scale (+ bias)`` for ``x`` [M, K] bfloat16/float16 (rows contiguous);
    returns [M, N] in ``x``'s dtype."""
    n, k = _check_weight("fp8_gemm", weight, scale)
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"fp8_gemm: x must be [M, {k}] with contiguous rows, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fp8_gemm: x must be bfloat16, float16 or float32, got {x.dtype}")
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bm, bn, bk, warps, stages = config or gemm_config(m)
    _fp8_gemm_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm))](
        x, weight, scale, bias if bias is not None else scale, out, m, n, k, x.stride(0), weight.stride(0),
        out.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps,
        num_stages=stages)
    return out
