"""Matrix-vector product for decode steps of one sequence (Triton), with the layer's neighbouring
elementwise work fused in.

A decode step of a single sequence multiplies one activation row by every weight matrix, so it is
bound by how fast the weights stream from device memory. Each program streams ``BLOCK_N``
contiguous weight rows in ``BLOCK_K`` chunks (16-byte loads) and accumulates in float32 (one
rounding at the end, as cuBLAS does). Its first weight tile is loaded before the program waits
for the previous kernel (programmatic dependent launch, ``kernels/pdl.py``), so weight streaming
starts during that kernel's tail (with ``DEEPINFER_PDL_PREFETCH=1``, experimental, its whole
tile where it fits: ``kernels/pdl.py``). On the H200 this read the Llama-3-8B projections at 3.4-4.4
TB/s, as fast as or faster than cuBLAS (bench/gemv_bench.py).

Fused in, each saving a launch and a round trip of the activations through memory:

- ``norm=(weight, eps)``: RMSNorm of the input row (``add_rmsnorm`` without a residual). Every
  program computes the row's sum of squares itself (K values from L2), so no program waits
  for another;
- ``residual``: the layer's residual add in the epilogue (the product rounds, then the add);
- ``silu_mul=True``: SiLU(gate) * up of gate/up activations [1, 2*K] as the input row;
- split-K (``config[4]``): K cut over several programs per row block whose float32 partials the
  last one to finish adds in a fixed order (an integer arrival counter; no float atomics, so
  results are deterministic). It lost to one program per row block on every Llama-3-8B shape
  on the H200 and is used by no default tile.

Rounding follows the torch ops (``fused_ops.add_rmsnorm``, ``silu_mul``, the add).

``gemv_argmax`` is the LM head of a greedy step: each program also keeps the largest of its
(rounded) logits, and ``argmax_partials`` reduces those to the argmax (first index on ties, as
``torch.argmax``), in place of torch's argmax pass over the logits (36 us per Llama-3-8B step).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from deepinfer.runtime.kernels.pdl import pdl_begin, pdl_launch, prefetch_fits

# partials of gemv_argmax reduced per program in its first pass (argmax_partials)
ARGMAX_SPAN = 2048
# (BLOCK_N, BLOCK_K, num_warps, num_stages): the best tile of most Llama-3-8B projections on the
# H200 (bench/gemv_bench.py); any values give the same results up to the float32 summation order.
DEFAULT_CONFIG = (2, 1024, 4, 3)


@triton.jit
def _activation_math(xv, u, nw, rstd, dt: tl.constexpr, SILU_MUL: tl.constexpr, NORM: tl.constexpr):
    """The GEMV's input from float32 activations ``xv`` (SILU_MUL: the gate; ``u`` the up half;
    NORM: ``nw`` the norm weight), rounded to ``dt`` where torch's ops round."""
    if SILU_MUL:
        act = (xv / (1.0 + tl.exp(-xv))).to(dt).to(tl.float32)
        xv = (act * u).to(dt).to(tl.float32)
    elif NORM:  # RMSNorm(x) * weight, rounded where fused_ops.add_rmsnorm rounds
        xv = (nw * (xv * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    return xv


@triton.jit
def _activation_chunk(x_ptr, nw_ptr, out_ptr, c, c_ok, k, rstd, SILU_MUL: tl.constexpr, NORM: tl.constexpr):
    """Columns ``c`` of the activation row, float32 (rounded to the output dtype where torch's ops round)."""
    xv = tl.load(x_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    u = xv
    nw = xv
    if SILU_MUL:
        u = tl.load(x_ptr + k + c, mask=c_ok, other=0.0).to(tl.float32)
    elif NORM:
        nw = tl.load(nw_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    return _activation_math(xv, u, nw, rstd, out_ptr.dtype.element_ty, SILU_MUL, NORM)


@triton.jit
def _row_rstd(x_ptr, k, eps, NORM: tl.constexpr, NORM_BLOCK: tl.constexpr):
    """1 / RMS of the activation row ``x`` [K] (NORM; else 0): RMSNorm's factor, as add_rmsnorm."""
    rstd = 0.0
    if NORM:
        nc = tl.arange(0, NORM_BLOCK)
        xn = tl.load(x_ptr + nc, mask=nc < k, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xn * xn, axis=0) / k + eps)
    return rstd


@triton.jit
def _gemv_epilogue(y, rows, row_ok, pid, n, b_ptr, res_ptr, out_ptr, max_ptr, arg_ptr, HAS_BIAS: tl.constexpr,
                   RESIDUAL: tl.constexpr, ARGMAX: tl.constexpr):
    dt = out_ptr.dtype.element_ty
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if RESIDUAL:  # torch: the projection rounds, then the residual add rounds
        y = y.to(dt).to(tl.float32) + tl.load(res_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(dt), mask=row_ok)
    if ARGMAX:  # this program's largest logit (as rounded to dt) and its first index
        yr = tl.where(row_ok, y.to(dt).to(tl.float32), float("-inf"))
        best = tl.max(yr, axis=0)
        first = tl.min(tl.where(yr == best, rows, n), axis=0)
        tl.store(max_ptr + pid, best)
        tl.store(arg_ptr + pid, first)


@triton.jit
def _tile_rows(pid, n, BLOCK_N: tl.constexpr, SILU_OUT: tl.constexpr):
    """The weight rows of program ``pid``'s tile and which exist. SILU_OUT: the weight is a gate/up
    projection, ``n`` gate rows then ``n`` up rows, and the tile pairs gate row i (even places)
    with up row i (odd places), for ``_silu_mul_epilogue``."""
    r = tl.arange(0, BLOCK_N)
    if SILU_OUT:
        pair = pid * (BLOCK_N // 2) + r // 2
        rows = (pair + (r % 2) * n).to(tl.int64)
        row_ok = pair < n
    else:
        rows = (pid * BLOCK_N + r).to(tl.int64)
        row_ok = rows < n
    return rows, row_ok


@triton.jit
def _silu_mul_epilogue(y, rows, row_ok, pid, n, b_ptr, out_ptr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Stores SiLU(gate) * up of the tile's (gate, up) row pairs (``_tile_rows``), each rounded where
    torch's gate/up projection and ``silu_mul`` round: the down projection's input, ready."""
    dt = out_ptr.dtype.element_ty
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    gate, up = tl.split(tl.reshape(y.to(dt).to(tl.float32), (BLOCK_N // 2, 2)))
    # the down GEMV's own SiLU·mul input math: the same bits by construction
    act = _activation_math(gate, up, gate, 0.0, dt, True, False)
    outs = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(out_ptr + outs, act.to(dt), mask=outs < n)


@triton.jit
def _gemv_preloaded(x_ptr, w_ptr, b_ptr, nw_ptr, res_ptr, out_ptr, max_ptr, arg_ptr, rows, row_ok, pid, n, k, stride_w,
                    eps, SILU_MUL: tl.constexpr, HAS_BIAS: tl.constexpr, ARGMAX: tl.constexpr, NORM: tl.constexpr,
                    NORM_BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr, PRELOAD_K: tl.constexpr,
                    SILU_OUT: tl.constexpr, BLOCK_N: tl.constexpr):
    """_gemv_kernel with the program's whole weight tile (K padded to PRELOAD_K) loaded before the
    wait and one product after it."""
    c = tl.arange(0, PRELOAD_K)
    c_ok = c < k
    w_all = tl.load(w_ptr + rows[:, None] * stride_w + c[None, :], mask=row_ok[:, None] & c_ok[None, :], other=0.0)
    pdl_begin(PDL)
    rstd = _row_rstd(x_ptr, k, eps, NORM, NORM_BLOCK)
    xv = _activation_chunk(x_ptr, nw_ptr, out_ptr, c, c_ok, k, rstd, SILU_MUL, NORM)
    y = tl.sum(w_all.to(tl.float32) * xv[None, :], axis=1)
    if SILU_OUT:
        _silu_mul_epilogue(y, rows, row_ok, pid, n, b_ptr, out_ptr, BLOCK_N, HAS_BIAS)
    else:
        _gemv_epilogue(y, rows, row_ok, pid, n, b_ptr, res_ptr, out_ptr, max_ptr, arg_ptr, HAS_BIAS, RESIDUAL, ARGMAX)


@triton.jit
def _gemv_rows(x_ptr, w_ptr, nw_ptr, out_ptr, rows, row_ok, k, k_lo, k_hi, stride_w, eps, BLOCK_K: tl.constexpr,
              SILU_MUL: tl.constexpr, NORM: tl.constexpr, NORM_BLOCK: tl.constexpr, PDL: tl.constexpr):
    """float32 sums over columns [k_lo, k_hi) of the weight ``rows`` times the activation row (a
    program's share of the GEMV; it waits for the previous kernel here, ``pdl_begin``)."""
    cols = tl.arange(0, BLOCK_K)
    c0 = k_lo + cols
    # The first weight tile is read before waiting for the previous kernel (no kernel of a step
    # writes weights): with PDL its loads overlap that kernel's tail.
    w_first = tl.load(w_ptr + rows[:, None] * stride_w + c0[None, :], mask=row_ok[:, None] & (c0 < k_hi)[None, :],
                      other=0.0)
    pdl_begin(PDL)
    # every program computes the row's RMS itself (K values from L2): no separate norm launch
    rstd = _row_rstd(x_ptr, k, eps, NORM, NORM_BLOCK)
    acc = w_first.to(tl.float32) * _activation_chunk(x_ptr, nw_ptr, out_ptr, c0, c0 < k_hi, k, rstd, SILU_MUL,
                                                     NORM)[None, :]
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        c = k0 + cols
        c_ok = c < k_hi
        xv = _activation_chunk(x_ptr, nw_ptr, out_ptr, c, c_ok, k, rstd, SILU_MUL, NORM)
        w = tl.load(w_ptr + rows[:, None] * stride_w + c[None, :], mask=row_ok[:, None] & c_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * xv[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, nw_ptr, res_ptr, out_ptr, max_ptr, arg_ptr, part_ptr, count_ptr, n, k, k_per,
                 stride_w, eps,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr, HAS_BIAS: tl.constexpr,
                 ARGMAX: tl.constexpr, NORM: tl.constexpr, NORM_BLOCK: tl.constexpr, RESIDUAL: tl.constexpr,
                 SPLIT_K: tl.constexpr, PDL: tl.constexpr, PRELOAD_K: tl.constexpr = 0, SILU_OUT: tl.constexpr = False):
    pid = tl.program_id(0)
    rows, row_ok = _tile_rows(pid, n, BLOCK_N, SILU_OUT)
    if PRELOAD_K:
        # In a function of its own: Triton compiles the code after this branch's return too, and a
        # [PRELOAD_K] name here would clash with the loop's [BLOCK_K] one of the same name below.
        _gemv_preloaded(x_ptr, w_ptr, b_ptr, nw_ptr, res_ptr, out_ptr, max_ptr, arg_ptr, rows, row_ok, pid, n, k,
                        stride_w, eps, SILU_MUL, HAS_BIAS, ARGMAX, NORM, NORM_BLOCK, RESIDUAL, PDL, PRELOAD_K, SILU_OUT,
                        BLOCK_N)
        return
    k_lo = tl.program_id(1) * k_per  # this program's share of K (split-K), a multiple of BLOCK_K
    y = _gemv_rows(x_ptr, w_ptr, nw_ptr, out_ptr, rows, row_ok, k, k_lo, tl.minimum(k_lo + k_per, k), stride_w, eps,
                  BLOCK_K, SILU_MUL, NORM, NORM_BLOCK, PDL)
    if SILU_OUT:  # (one program per row block: gemv refuses split-K here)
        _silu_mul_epilogue(y, rows, row_ok, pid, n, b_ptr, out_ptr, BLOCK_N, HAS_BIAS)
    elif SPLIT_K == 1:
        _gemv_epilogue(y, rows, row_ok, pid, n, b_ptr, res_ptr, out_ptr, max_ptr, arg_ptr, HAS_BIAS, RESIDUAL, ARGMAX)
    else:
        # The last of the SPLIT_K programs of these rows to finish adds the partial sums in split
        # order (deterministic, no float atomics) and writes the rows; it sets the counter back to 0.
        tl.store(part_ptr + tl.program_id(1) * n + rows, y, mask=row_ok)
        tl.debug_barrier()  # every thread's partial stores before the release below
        if tl.atomic_add(count_ptr + pid, 1, sem="acq_rel") == SPLIT_K - 1:
            tl.store(count_ptr + pid, 0)
            total = tl.zeros([BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part_ptr + s * n + rows, mask=row_ok, other=0.0, cache_modifier=".cg")
            _gemv_epilogue(total, rows, row_ok, pid, n, b_ptr, res_ptr, out_ptr, max_ptr, arg_ptr, HAS_BIAS, RESIDUAL,
                           ARGMAX)


@triton.jit
def _argmax_partials_kernel(max_ptr, arg_ptr, out_ptr, out_max_ptr, num, span, BLOCK: tl.constexpr,
                            KEEP_MAX: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program ``p``: the argmax of partials ``p * span .. (p + 1) * span - 1`` (of ``num``) into
    ``out_ptr[p]`` (the smallest arg among the largest values; args grow with the partial's index),
    with KEEP_MAX its value into ``out_max_ptr[p]`` (for a second pass over the programs' results)."""
    pdl_begin(PDL)
    lo = tl.program_id(0) * span
    hi = tl.minimum(lo + span, num)
    i = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_arg = tl.full([BLOCK], 2**62, tl.int64)
    for start in range(lo, hi, BLOCK):  # lane-wise running best; later chunks hold larger indices
        ok = start + i < hi
        v = tl.load(max_ptr + start + i, mask=ok, other=float("-inf"))
        a = tl.load(arg_ptr + start + i, mask=ok, other=2**62)
        better = v > best
        best = tl.where(better, v, best)
        best_arg = tl.where(better, a, best_arg)
    top = tl.max(best, axis=0)
    tl.store(out_ptr + tl.program_id(0), tl.min(tl.where(best == top, best_arg, 2**62), axis=0))
    if KEEP_MAX:
        tl.store(out_max_ptr + tl.program_id(0), top)


def argmax_partials(maxes: torch.Tensor, args: torch.Tensor, out: torch.Tensor, *, span: int = ARGMAX_SPAN,
                    pdl: dict[str, Any] | None = None) -> torch.Tensor:
    """``out`` [1] = ``args[i]`` of the largest of ``maxes`` (float32 [P]; the smallest arg on ties):
    the programs' partials of ``gemv_argmax``. More than ``span`` partials take two passes, the
    first over slices of ``span`` in parallel (one program over a 128k vocabulary's 64k partials
    took 22.6 us of serial loads on an H100)."""
    if (maxes.dtype != torch.float32 or args.dtype != torch.int64 or out.dtype != torch.int64
            or maxes.dim() != 1 or args.shape != maxes.shape or out.numel() < 1 or maxes.numel() < 1
            or not (maxes.is_contiguous() and args.is_contiguous() and out.is_contiguous())
            or not maxes.device == args.device == out.device):
        raise ValueError(f"argmax_partials: maxes float32 [P] (P >= 1), args int64 [P] and out int64 [>= 1], contiguous "
                         f"on one device; got {maxes.dtype} {tuple(maxes.shape)} on {maxes.device}, {args.dtype} "
                         f"{tuple(args.shape)} on {args.device}, {out.dtype} {tuple(out.shape)} on {out.device}")
    if span < 1:
        raise ValueError(f"argmax_partials: span must be a positive number of partials, got {span}")
    pdl = pdl or {}
    num = maxes.numel()
    if num > span:
        parts = triton.cdiv(num, span)
        part_max = torch.empty(parts, dtype=torch.float32, device=maxes.device)
        part_arg = torch.empty(parts, dtype=torch.int64, device=maxes.device)
        _argmax_partials_kernel[(parts,)](maxes, args, part_arg, part_max, num, span,
                                          BLOCK=min(1024, triton.next_power_of_2(span)), KEEP_MAX=True, num_warps=4,
                                          **pdl)
        maxes, args, num = part_max, part_arg, parts
    _argmax_partials_kernel[(1,)](maxes, args, out, maxes, num, num, BLOCK=min(8192, triton.next_power_of_2(num)),
                                  num_warps=max(1, min(16, triton.next_power_of_2(num) // 512)), **pdl)
    return out


def check_one_row(name: str, x: torch.Tensor, n: int, k: int, weight: str, *, silu_mul: bool,
                  bias: torch.Tensor | None, norm: tuple[torch.Tensor, float] | None,
                  residual: torch.Tensor | None) -> None:
    """ValueError naming ``name`` when a one-row GEMV's operands do not fit an [n, k] ``weight``
    (the checks of ``gemv`` and of the quantized GEMVs built on its fusions)."""
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(1) != 1:
        raise ValueError(f"{name}: x must be one contiguous row [1, K], got shape {tuple(x.shape)}")
    if silu_mul and norm is not None:
        raise ValueError(f"{name}: silu_mul and norm cannot be combined")
    if x.shape[1] != (2 * k if silu_mul else k):
        raise ValueError(f"{name}: x has {x.shape[1]} columns, {weight} [{n}, {k}] needs {2 * k if silu_mul else k}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"{name}: bias must be a contiguous [{n}] vector, got shape {tuple(bias.shape)}")
    if norm is not None and (norm[0].shape != (k,) or not norm[0].is_contiguous()):
        raise ValueError(f"{name}: the norm weight must be a contiguous [{k}] vector, got shape {tuple(norm[0].shape)}")
    if residual is not None and (residual.shape != (1, n) or residual.stride(1) != 1):
        raise ValueError(f"{name}: residual must be one contiguous row [1, {n}], got shape {tuple(residual.shape)}")


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, silu_mul: bool = False,
         norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None,
         config: tuple[int, ...] = DEFAULT_CONFIG, out: torch.Tensor | None = None,
         preload: bool | None = None, silu_out: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for one row ``x`` [1, K] and ``weight`` [N, K] with contiguous
    rows; returns [1, N] in ``x``'s dtype.

    ``silu_mul``: ``x`` is [1, 2*K] (gate then up) and the product uses SiLU(gate) * up.
    ``norm`` (weight [K], eps): the product uses RMSNorm(x) * weight (``add_rmsnorm`` without a
    residual), computed inside the kernel. ``residual`` [1, N]: returns ``F.linear(...) + residual``
    (each rounded as torch rounds), the residual add of the layer. ``config``: (BLOCK_N, BLOCK_K,
    num_warps, num_stages[, split_k]); with split_k > 1 each row block's K is cut into split_k
    programs whose float32 partial sums the last of them adds up, in a fixed order. ``preload``:
    each program loads its whole weight tile before waiting for the previous kernel (split_k 1
    only; default: where the tile fits, ``kernels/pdl.py``). ``silu_out``: ``weight`` is a gate/up
    projection [2I, K] (gate rows, then up rows); returns ``silu_mul`` of the product, [1, I]: each
    program multiplies matching gate and up rows (BLOCK_N counts both; even), so the down
    projection reads its input ready instead of each of its programs computing the SiLU again."""
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"gemv: weight must be [N, K] with contiguous rows, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    check_one_row("gemv", x, n, k, "weight", silu_mul=silu_mul, bias=bias, norm=norm, residual=residual)
    block_n, block_k, warps, stages, split_k = (*config, 1)[:5]
    if len(config) not in (4, 5) or min(block_n, block_k, warps, stages, split_k) < 1:
        raise ValueError(f"gemv: config must be (BLOCK_N, BLOCK_K, num_warps, num_stages[, split_k]) of positive "
                         f"integers, got {config!r}")
    if silu_out:
        check_silu_out("gemv", n, block_n, split_k, residual, silu_mul)
        n //= 2
    out = torch.empty((1, n), dtype=x.dtype, device=x.device) if out is None else out
    preload_k = _preload_k(block_n, k, warps, preload, weight.element_size()) if split_k == 1 else 0
    programs = triton.cdiv(n, block_n // 2 if silu_out else block_n)
    k_per = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    if split_k > 1:
        part = torch.empty(split_k * n, dtype=torch.float32, device=x.device)
        counters = _split_counters(x.device, programs)
    else:
        part = counters = out
    _gemv_kernel[(programs, split_k)](
        x, weight, bias if bias is not None else weight, norm[0] if norm is not None else weight,
        residual if residual is not None else out, out, out, out, part, counters, n, k, k_per, weight.stride(0),
        norm[1] if norm is not None else 0.0,
        BLOCK_N=block_n, BLOCK_K=block_k, SILU_MUL=silu_mul, HAS_BIAS=bias is not None, ARGMAX=False,
        NORM=norm is not None, NORM_BLOCK=triton.next_power_of_2(k) if norm is not None else 1,
        RESIDUAL=residual is not None, SPLIT_K=split_k, num_warps=warps, num_stages=stages, PRELOAD_K=preload_k,
        SILU_OUT=silu_out, **pdl_launch(x.device))
    return out


def check_silu_out(name: str, n: int, block_n: int, split_k: int, residual: torch.Tensor | None,
                   silu_mul: bool) -> None:
    """ValueError naming ``name`` where a GEMV cannot pair gate and up rows (``silu_out``)."""
    if n % 2 or block_n % 2 or split_k != 1 or residual is not None or silu_mul:
        raise ValueError(f"{name}: silu_out needs an even number of weight rows ([2I, K] gate then up, got {n}) and "
                         f"an even BLOCK_N without split-K (got {block_n}, split {split_k}), and takes no residual "
                         f"or silu_mul input")


def _preload_k(block_n: int, k: int, warps: int, preload: bool | None, itemsize: int) -> int:
    """K padded to a power of two where a program loads its whole [block_n, K] tile of ``itemsize``
    bytes a weight before the wait, else 0."""
    padded = triton.next_power_of_2(k)
    return padded if (prefetch_fits(block_n * padded * itemsize, warps) if preload is None else preload) else 0


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _split_counters(device: torch.device, programs: int) -> torch.Tensor:
    """The zeroed arrival counters of split-K (one per row block), shared by every split-K GEMV on
    ``device``: each call leaves them at 0 and calls on one stream run one after another. Made
    on the first call, which must not be inside a graph capture (the decode graphs warm up first)."""
    have = _COUNTERS.get(device)
    if have is None or have.numel() < programs:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("gemv: run a split-K GEMV of this size once before capturing it in a CUDA graph")
        have = _COUNTERS[device] = torch.zeros(max(programs, 1 << 16), dtype=torch.int32, device=device)
    return have


def gemv_argmax(x: torch.Tensor, weight: torch.Tensor, config: tuple[int, int, int, int] = DEFAULT_CONFIG,
                preload: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(``F.linear(x, weight)`` [1, N], its argmax as int64 [1]) for one row ``x`` [1, K]: the
    logits and the greedy token of an LM head, without a separate argmax pass over the logits."""
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(1) != 1:
        raise ValueError(f"gemv_argmax: x must be one contiguous row [1, K], got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.stride(1) != 1 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"gemv_argmax: weight must be [N, {x.shape[1]}] with contiguous rows, got "
                         f"{tuple(weight.shape)}")
    n, k = weight.shape
    block_n, block_k, warps, stages = config
    programs = triton.cdiv(n, block_n)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    maxes = torch.empty(programs, dtype=torch.float32, device=x.device)
    args = torch.empty(programs, dtype=torch.int64, device=x.device)
    greedy = torch.empty(1, dtype=torch.int64, device=x.device)
    pdl = pdl_launch(x.device)
    preload_k = _preload_k(block_n, k, warps, preload, weight.element_size())
    _gemv_kernel[(programs, 1)](x, weight, weight, weight, out, out, maxes, args, out, out, n, k, k, weight.stride(0),
                                0.0, BLOCK_N=block_n, BLOCK_K=block_k, SILU_MUL=False, HAS_BIAS=False, ARGMAX=True,
                                NORM=False, NORM_BLOCK=1, RESIDUAL=False, SPLIT_K=1, num_warps=warps,
                                num_stages=stages, PRELOAD_K=preload_k, **pdl)
    argmax_partials(maxes, args, greedy, pdl=pdl)
    return out, greedy
