"""Test helper: the GGUF GPU kernels (``kernels.gguf_gemv``) against a float64 matmul of
``gguf.quants``' dequantization of the same blocks.

``python gguf_gpu_check.py DEVICE [quick | lean] [TYPES]``: on CPU run it with ``TRITON_INTERPRET=1`` (Triton's
interpreter). Prints one line per case and exits non-zero on a mismatch.

Bounds (stated; ``mag = |x| @ |W|.T`` in float64, ``u`` the output dtype's unit roundoff):
* GEMV, float32 activations: weights decoded in float32 as gguf does (an fma may skip one
  rounding: 2**-24 relative), float32 sums of K products: ``|y - ref| <= 2**-16 * mag``
  (K <= 512 terms here: (K+2) * 2**-24 < 2**-14 even for the worst order; measured far below)
  plus the output rounding ``u * |ref|``.
* GEMV with bfloat16 activations and fusions (RMSNorm, SiLU·mul, residual): compared to the
  same fused op computed by torch in float64 from the rounded input the kernel sees; bound
  ``2**-7 * mag + 2**-7 * |ref|``.
* 8-bit activations in the GEMV (the default; ``DEEPINFER_GGUF_DP4A=0``: float32): each GEMV bound
  plus ``q8_error``.
* GEMM: weights and activations rounded to bfloat16 (2**-9 each), float32 sums:
  ``|y - ref| <= 2**-7 * mag + 2**-8 * |ref|``. The "bf16" decode (GPU; every type but Q8_0) rounds the
  group scale (and minimum) to bfloat16 first (a Q4_0 weight 2**-7 off at most), within that bound; it
  is also checked against its own weights (``bf16_decode_weight``): ``2**-16 * mag + 2**-8 * |ref|``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator

import deepinfer.runtime.kernels.gguf_gemv as gguf_gemv_module
import numpy as np
import torch
from deepinfer.runtime.kernels.gguf_gemv import (
    bf16_codes,
    dense_weight,
    dp4a_config,
    gguf_gemm,
    gguf_gemv,
    lean_gemv,
    one_row_path,
    quantize_activations,
)
from deepinfer.runtime.kernels.gguf_layout import BLOCK_BYTES, GPU_TYPES, KINDS, GGUFPlanes, regroup
from deepinfer.runtime.kernels.gguf_mmq import gguf_mmq, quantize_rows
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

_SCALE_BYTES = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """The environment holds ``values`` inside (DEEPINFER_* switches the kernels read), as before after."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def random_blocks(kind: str, rows: int, k: int, seed: int) -> np.ndarray:
    """Raw GGUF bytes [rows, bytes per row]: random codes, fp16 scales in [0.001, 0.05] (K-quants' 6-bit
    sub-block scales random: weights up to ~±200, as a stress of the float32 decode)."""
    rng = np.random.default_rng(seed)
    block = 256 if kind.endswith("_K") else 32
    raw = rng.integers(0, 256, size=(rows, k // block, BLOCK_BYTES[kind]), dtype=np.uint8)
    for off in _SCALE_BYTES[kind]:
        scales = rng.uniform(0.001, 0.05, size=(rows, k // block)).astype(np.float16)
        raw[..., off:off + 2] = scales.view(np.uint8).reshape(rows, k // block, 2)
    return raw.reshape(rows, -1)


def reference_weight(raw: np.ndarray, kind: str, rows: int) -> torch.Tensor:
    w = gguf_dequantize(raw, GGMLQuantizationType[kind]).reshape(rows, -1)
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float64))


DP4A = one_row_path().endswith("(dp4a)")  # the switches' defaults: 8-bit activations


def act8_error(act: torch.Tensor, w: torch.Tensor, group: int) -> torch.Tensor:
    """Rounding each ``group`` columns of each activation row to signed bytes (scale ``amax / 127``)
    moves each column by at most half a step, so each output by at most ``(amax / 254) @ |W|.T``
    (with 2**-6 of slack for the float32 scale)."""
    rows = act.reshape(-1, act.shape[-1]).double()
    a = rows.reshape(rows.shape[0], -1, group).abs().amax(dim=2, keepdim=True).expand(-1, -1, group)
    return (a.reshape(rows.shape) / 254 * (1 + 2**-6)) @ w.abs().T


def q8_error(act: torch.Tensor, w: torch.Tensor) -> torch.Tensor | float:
    """With 8-bit activations (the default) the GEMV rounds each 16-column tile of the activation row to
    signed bytes (scale ``amax / 127``): each column moves by at most half a step, so the output by
    at most ``(amax / 254) @ |W|.T`` (with 2**-6 of slack for the float32 scale); else 0."""
    return act8_error(act, w, 16) if DP4A else 0.0


def _check(name: str, got: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, rel_mag: float, rel_ref: float,
           extra: torch.Tensor | float = 0.0) -> bool:
    err = (got.double().cpu() - ref).abs()
    bound = rel_mag * mag + rel_ref * ref.abs() + extra + 1e-30
    worst = float((err / bound).max())
    ok = bool((err <= bound).all())
    print(f"{'ok  ' if ok else 'FAIL'} {name}: max error / bound = {worst:.3g}")
    return ok


def bf16_decode_weight(planes: GGUFPlanes) -> torch.Tensor:
    """The weights ``gguf_gemm``'s "bf16" decode makes of the planes, computed by torch from
    the planes (independent of the kernel's PTX): the exact code ``q - BIAS`` times the group scale
    rounded to bfloat16, plus the minimum rounded to bfloat16, rounded once (float32 holds the sum
    exactly here: a code of at most 7 bits times an 8-bit mantissa plus another)."""
    _, g, sb, has_min, bias = KINDS[planes.kind]
    scale, minimum, d, dmin = (t.cpu() if t is not None else None for t in planes.four_planes())
    q = planes.code_values().cpu().float() - bias
    s = scale.float()
    if sb:
        s = d.float().repeat_interleave(sb // g, dim=1) * s
    w = q * s.to(torch.bfloat16).float().repeat_interleave(g, dim=1)
    if has_min:
        mn = minimum.float()
        if sb:
            mn = -(dmin.float().repeat_interleave(sb // g, dim=1) * mn)
        w = w + mn.to(torch.bfloat16).float().repeat_interleave(g, dim=1)
    return w.to(torch.bfloat16)


def check_kind(kind: str, device: str, quick: bool) -> bool:
    ok = True
    n, k = (40, 512) if kind.endswith("_K") else (37, 256)
    raw = random_blocks(kind, n, k, seed=GPU_TYPES.index(kind))
    w_ref = reference_weight(raw, kind, n)
    planes = regroup(torch.from_numpy(raw), kind).map(lambda t: t.to(device))
    g = torch.Generator().manual_seed(7)
    # one row, float32 activations, plain
    x = torch.randn(1, k, generator=g)
    ref = x.double() @ w_ref.T
    mag = x.double().abs() @ w_ref.abs().T
    ok &= _check(f"{kind} gemv f32 [1,{k}]x[{n},{k}]", gguf_gemv(x.to(device), planes), ref, mag, 2**-16, 2**-24,
                 q8_error(x, w_ref))
    if planes.high is not None:  # DEEPINFER_GGUF_Q6K_6BIT=1: every kernel below reads the 6-bit planes
        six = planes.packed and tuple(planes.codes.shape) == (n, k // 2)
        print(f"{'ok  ' if six else 'FAIL'} {kind} planes at 6 bits: codes {tuple(planes.codes.shape)}, high "
              f"{tuple(planes.high.shape)}")
        ok &= six
    # longer rows in narrow tiles: several code chunks a row, the last one cut short (or one partial chunk)
    k2 = {"Q4_0": 320, "Q4_1": 320, "Q8_0": 288}.get(kind, 768)
    raw2 = random_blocks(kind, 9, k2, seed=10 + GPU_TYPES.index(kind))
    w2 = reference_weight(raw2, kind, 9)
    planes2 = regroup(torch.from_numpy(raw2), kind).map(lambda t: t.to(device))
    x2 = torch.randn(1, k2, generator=g)
    for config in ((1, 64, 4, 3), (2, 512, 4, 3), (8, 128, 2, 2)):
        ok &= _check(f"{kind} gemv f32 [1,{k2}]x[9,{k2}] tiles {config}", gguf_gemv(x2.to(device), planes2, config=config),
                     x2.double() @ w2.T, x2.double().abs() @ w2.abs().T, 2**-16, 2**-24, q8_error(x2, w2))
    # the default tile of a narrow projection from a wide K (Llama-3-8B's o and down): Q4_0 takes
    # two rows a program (dp4a_config), the others the common tile
    raw3 = random_blocks(kind, 9, 4096, seed=50 + GPU_TYPES.index(kind))
    w3 = reference_weight(raw3, kind, 9)
    planes3 = regroup(torch.from_numpy(raw3), kind).map(lambda t: t.to(device))
    x3 = torch.randn(1, 4096, generator=g)
    tile = dp4a_config(planes3)
    want_tile = (2, 1024, 1, 2) if kind == "Q4_0" else (4, 1024, 2, 2)
    ok &= _check(f"{kind} gemv f32 [1,4096]x[9,4096], default tiles", gguf_gemv(x3.to(device), planes3),
                 x3.double() @ w3.T, x3.double().abs() @ w3.abs().T, 2**-16, 2**-24, q8_error(x3, w3))
    print(f"{'ok  ' if tile == want_tile else 'FAIL'} {kind} narrow projection's dp4a tile {tile}")
    ok &= tile == want_tile
    # the word GEMV with its rows' first chunk of code words loaded before the PDL wait
    # (kernels/pdl.py; the byte GEMV has no such form): the same bits as loading them after it
    for config in ((1, 64, 4, 3), (8, 128, 2, 2)):
        same = torch.equal(*(gguf_gemv(x2.to(device), planes2, config=config, preload=p) for p in (False, True)))
        print(f"{'ok  ' if same else 'FAIL'} {kind} gemv, first chunk preloaded or not, tiles {config}: the same bits")
        ok &= same
    # fused: bias + residual, RMSNorm prologue, SiLU·mul input (bfloat16 activations)
    bf = torch.bfloat16
    xb = torch.randn(1, k, generator=g).to(bf)
    res = torch.randn(1, n, generator=g).to(bf)
    bias = torch.randn(n, generator=g).to(bf)
    ref = (xb.double() @ w_ref.T + bias.double()).to(bf).double() + res.double()
    mag = xb.double().abs() @ w_ref.abs().T + res.double().abs()
    got = gguf_gemv(xb.to(device), planes, bias.to(device), residual=res.to(device))
    ok &= _check(f"{kind} gemv bf16 bias+residual", got, ref, mag, 2**-7, 2**-7, q8_error(xb, w_ref))
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(bf)
    eps = 1e-5
    xd = xb.double()
    normed = (xd * torch.rsqrt((xd * xd).mean() + eps)).to(bf).double() * nw.double()
    ref = normed @ w_ref.T
    mag = normed.abs() @ w_ref.abs().T
    ok &= _check(f"{kind} gemv bf16 rmsnorm", gguf_gemv(xb.to(device), planes, norm=(nw.to(device), eps)), ref, mag,
                 2**-7, 2**-7, q8_error(normed, w_ref))
    # rows of a wider buffer (rows of k + 3): one at an odd offset (read per column), one at an
    # offset on a 64-bit word but an odd row stride (read as words): both equal the aligned copy
    wide = torch.zeros(2, k + 3)
    c = -(k + 3) % 4
    wide[0, 1:k + 1] = wide[1, c:c + k] = xb.float()[0]
    wide = wide.to(bf).to(device)
    nwide = torch.cat((torch.zeros(1), nw.float(), torch.zeros(3))).to(bf).to(device)
    aligned = gguf_gemv(xb.to(device), planes, norm=(nw.to(device), eps))
    same = torch.equal(gguf_gemv(wide[0:1, 1:k + 1], planes, norm=(nwide[1:k + 1], eps)), aligned)
    same &= torch.equal(gguf_gemv(wide[1:2, c:c + k], planes, norm=(nw.to(device), eps)), aligned)
    print(f"{'ok  ' if same else 'FAIL'} {kind} gemv bf16 rmsnorm, rows of a wider buffer equal their aligned copy")
    ok &= same
    gu = torch.randn(1, 2 * k, generator=g).to(bf)
    gd, ud = gu[:, :k].double(), gu[:, k:].double()
    act = torch.nn.functional.silu(gd) * ud
    ref = act @ w_ref.T
    mag = act.abs() @ w_ref.abs().T
    ok &= _check(f"{kind} gemv bf16 silu_mul", gguf_gemv(gu.to(device), planes, silu_mul=True), ref, mag,
                 2**-7, 2**-7, q8_error(act, w_ref))
    same = torch.equal(*(gguf_gemv(gu.to(device), planes, silu_mul=True, preload=p) for p in (False, True)))
    same &= torch.equal(*(gguf_gemv(xb.to(device), planes, norm=(nw.to(device), eps), residual=res.to(device),
                                    preload=p) for p in (False, True)))
    print(f"{'ok  ' if same else 'FAIL'} {kind} gemv bf16 silu_mul / rmsnorm + residual, first chunk preloaded or "
          f"not: the same bits")
    ok &= same
    if DP4A:
        ok &= check_quantized_input(kind, device, 256, g)
    # several rows: GEMM (bfloat16), 2..64 rows
    for m in ((3, 17) if quick else (2, 5, 16, 33, 64)):
        xm = torch.randn(m, k, generator=g).to(bf)
        ref = xm.double() @ w_ref.T
        mag = xm.double().abs() @ w_ref.abs().T
        for swap in (False, True) if quick or m in (5, 33) else (False,):  # weights as the MMA's left operand too
            ok &= _check(f"{kind} gemm{' swapped' if swap else ''} bf16 [{m},{k}]",
                         gguf_gemm(xm.to(device), planes, swap=swap), ref, mag, 2**-7, 2**-8)
    if bf16_codes(planes, bf):
        # the "bf16" decode (GPU only): its weights are bf16_decode_weight's, so the product is
        # that float64 product up to float32 sums and the output's rounding; a nibble, scale or
        # minimum taken from the wrong place is off by the weights' own size
        w16 = bf16_decode_weight(planes).double()
        for m, swap, split in ((5, False, 1), (5, True, 1), (33, True, 2)):
            xm = torch.randn(m, k, generator=g).to(bf)
            ok &= _check(f"{kind} gemm{' swapped' if swap else ''} [{m},{k}] bf16 decode: its own weights",
                         gguf_gemm(xm.to(device), planes, swap=swap, split_k=split), xm.double() @ w16.T,
                         xm.double().abs() @ w16.abs().T, 2**-16, 2**-8)
    # the whole weight decoded on the device (DEEPINFER_GGUF_DENSE_ROWS' products): gguf's float32
    # weights exactly, in bf16 their rounding (Triton's interpreter rounds toward zero: within one
    # bf16 step there); a layer of two parts of different types (each decoded, multiplied and
    # written to its slice of the output, bias included) multiplying 5 rows through them
    dense = dense_weight(planes, torch.float32).double().cpu()
    same = torch.equal(dense, w_ref.float().double())
    d16 = dense_weight(planes, bf).float().cpu()
    if device == "cuda":
        same &= torch.equal(d16, w_ref.float().to(bf).float())
    else:
        same &= bool(((d16 - w_ref.float()).abs() <= 2**-7 * w_ref.float().abs()).all())
    print(f"{'ok  ' if same else 'FAIL'} {kind} dequantized whole: gguf's float32 weights (max diff "
          f"{(dense - w_ref).abs().max():.2e}), bf16 their rounding")
    ok &= same
    from deepinfer.runtime.models.gguf_linear import GGUFLinearCUDA

    other = "Q4_0" if kind == "Q8_0" else "Q8_0"
    raw_o = random_blocks(other, 5, k, seed=60 + GPU_TYPES.index(kind))
    two = GGUFLinearCUDA([planes, regroup(torch.from_numpy(raw_o), other)], (torch.randn(n + 5, generator=g)).to(bf))
    two = two.to(device)
    assert len(two.parts) == 2, two.weight_type
    w_two = torch.cat([w_ref, reference_weight(raw_o, other, 5)])
    xm = torch.randn(5, k, generator=g).to(bf)
    decoded: list[str] = []  # the parts the layer decoded whole (it must take that path for both)
    saved = os.environ.get("DEEPINFER_GGUF_DENSE_ROWS")
    os.environ["DEEPINFER_GGUF_DENSE_ROWS"] = "2"
    gguf_gemv_module.dense_weight = lambda w, dtype, out=None: decoded.append(w.kind) or dense_weight(w, dtype, out)
    try:
        got = two(xm.to(device))
    finally:
        os.environ.pop("DEEPINFER_GGUF_DENSE_ROWS")
        if saved is not None:
            os.environ["DEEPINFER_GGUF_DENSE_ROWS"] = saved
        gguf_gemv_module.dense_weight = dense_weight
    b2 = two.bias.double().cpu()
    if decoded != [kind, other]:
        print(f"FAIL {kind}+{other} layer: the parts decoded whole were {decoded}")
        ok = False
    ok &= _check(f"{kind}+{other} layer, 5 rows through the dequantized weights", got, xm.double() @ w_two.T + b2,
                 xm.double().abs() @ w_two.abs().T + b2.abs(), 2**-7, 2**-8)
    # swapped over several row blocks, the last one ragged (the default from 33 up to 1024 rows)
    xm = torch.randn(150, k, generator=g).to(bf)
    ok &= _check(f"{kind} gemm swapped bf16 [150,{k}] (3 row blocks)", gguf_gemm(xm.to(device), planes, swap=True),
                 xm.double() @ w_ref.T, xm.double().abs() @ w_ref.abs().T, 2**-7, 2**-8)
    # K split 3 ways (float32 partial sums added in order by a second kernel), plain and swapped,
    # with more K steps than splits and a last split shorter than the others
    for m, swap in ((6, False), (6, True), (1, False)):
        xm = torch.randn(m, k2, generator=g).to(bf)
        got = gguf_gemm(xm.to(device), planes2, swap=swap, split_k=3, config=(16, 16, 32, 4, 2))
        ok &= _check(f"{kind} gemm{' swapped' if swap else ''} bf16 [{m},{k2}] K split 3 ways", got,
                     xm.double() @ w2.T, xm.double().abs() @ w2.abs().T, 2**-7, 2**-8)
    # shapes the tiles divide (N by BLOCK_N, the code plane by BLOCK_K: for Q4_0, Q4_1 and Q8_0 the
    # kernel drops its weight masks, as for every Llama-shape projection), plain and swapped, K split or not
    raw3 = random_blocks(kind, 32, k, seed=20 + GPU_TYPES.index(kind))
    w3 = reference_weight(raw3, kind, 32)
    planes3 = regroup(torch.from_numpy(raw3), kind).map(lambda t: t.to(device))
    for swap, split in ((False, 1), (True, 1), (True, 2)):
        xm = torch.randn(5, k, generator=g).to(bf)
        ok &= _check(f"{kind} gemm{' swapped' if swap else ''} [5,{k}]x[32,{k}] even tiles, split {split}",
                     gguf_gemm(xm.to(device), planes3, swap=swap, split_k=split, config=(16, 16, 32, 4, 2)),
                     xm.double() @ w3.T, xm.double().abs() @ w3.abs().T, 2**-7, 2**-8)
    # a GEMM with bias into a column slice of a wider output (how a mixed-type qkv writes)
    xm = torch.randn(4, k, generator=g).to(bf)
    bias = torch.randn(n, generator=g).to(bf)
    ref = xm.double() @ w_ref.T + bias.double()
    mag = xm.double().abs() @ w_ref.abs().T + bias.double().abs()
    for swap, split in ((False, 1), (True, 1), (False, 2), (True, 2)):
        wide = torch.zeros(4, n + 8, dtype=bf, device=device)
        gguf_gemm(xm.to(device), planes, bias.to(device), out=wide[:, 8:], swap=swap, split_k=split,
                  config=(16, 16, 32, 4, 2) if split > 1 else None)
        ok &= _check(f"{kind} gemm{' swapped' if swap else ''}{' split 2' if split > 1 else ''} into a slice",
                     wide[:, 8:], ref, mag, 2**-7, 2**-8)
        ok &= bool((wide[:, :8] == 0).all())
    # several rows on the int8 tensor cores (gguf_mmq): activations rounded per 32 columns, exact
    # integer sums, float32 group sums, bfloat16 output
    for m in ((3, 17) if quick else (2, 5, 16, 33, 64)):
        xm = torch.randn(m, k, generator=g).to(bf)
        ref = xm.double() @ w_ref.T
        mag = xm.double().abs() @ w_ref.abs().T
        got = gguf_mmq(quantize_rows(xm.to(device)), planes)
        ok &= _check(f"{kind} mmq [{m},{k}]", got, ref, mag, 2**-12, 2**-8, act8_error(xm, w_ref, 32))
    xm = torch.randn(4, k2, generator=g).to(bf)  # several K chunks, with bias, into a slice
    wide = torch.zeros(4, 9 + 8, dtype=bf, device=device)
    bias = torch.randn(9, generator=g).to(bf)
    gguf_mmq(quantize_rows(xm.to(device)), planes2, bias.to(device), out=wide[:, 8:])
    ref = xm.double() @ w2.T + bias.double()
    mag = xm.double().abs() @ w2.abs().T + bias.double().abs()
    ok &= _check(f"{kind} mmq [4,{k2}] with bias into a slice", wide[:, 8:], ref, mag, 2**-12, 2**-8,
                 act8_error(xm, w2, 32))
    ok &= bool((wide[:, :8] == 0).all())
    return ok


def refuses(call: Callable[[], object], words: str) -> bool:
    """Whether ``call()`` raises a ValueError whose message holds ``words``."""
    try:
        call()
    except ValueError as err:
        return words in str(err)
    return False


def check_quantized_input(kind: str, device: str, k: int, g: torch.Generator) -> bool:
    """The dp4a GEMV given its 8-bit activations made by the kernel before it (``quantized``: as the
    decode attention stores them for the o projection, which adds the residual) equals the GEMV
    that quantizes the row itself: the same codes and scales, so the same bits; for the default
    tile and 2 rows a program (Q4_0's narrow tile, ``dp4a_config``). Bad buffers, and
    ``quantized`` with ``norm`` or ``silu_mul`` (the row as it is only), are ValueErrors."""
    ok = True
    bf = torch.bfloat16
    raw = random_blocks(kind, 64, k, seed=40 + GPU_TYPES.index(kind))
    o_proj = regroup(torch.from_numpy(raw), kind).map(lambda t: t.to(device))
    x = torch.randn(1, k, generator=g).to(bf).to(device)
    res = torch.randn(1, 64, generator=g).to(bf).to(device)
    xq, st = quantize_activations(x, k)
    for config in (None, (2, 2048, 2, 2), (4, 512, 1, 2)):
        got = gguf_gemv(x, o_proj, residual=res, quantized=(xq, st), config=config)
        same = torch.equal(got, gguf_gemv(x, o_proj, residual=res, config=config))
        print(f"{'ok  ' if same else 'FAIL'} {kind} residual gemv (tiles {config or 'default'}) from stored 8-bit "
              f"activations: the bits of the gemv quantizing them itself")
        ok &= same
    nw = torch.ones(k, dtype=bf, device=device)
    bad = [(x, dict(quantized=(xq[:-1], st)), "quantized must be"),
           (x, dict(quantized=(xq, st), norm=(nw, 1e-5)), "not with norm or silu_mul"),
           (torch.cat((x, x), dim=1), dict(quantized=(xq, st), silu_mul=True), "not with norm or silu_mul")]
    for row, kwargs, words in bad:
        raised = refuses(lambda: gguf_gemv(row, o_proj, **kwargs), words)  # type: ignore[arg-type]  # noqa: B023
        print(f"{'ok  ' if raised else 'FAIL'} {kind} gemv refuses {sorted(kwargs)} ({words!r})")
        ok &= raised
    return ok


def check_lean(kind: str, device: str) -> bool:
    """``DEEPINFER_GGUF_GEMV_LEAN=1`` (experimental): where the word GEMV's tiles divide the weight it
    runs its fewer-instruction form (no load masks, chained dp4a). Integer sums are exact and the
    float operations are the same, so it gives the default form's bits; both within the float64
    bound. The default choices' tiles and the 8-row one, dp4a and float32 activations; the narrow
    projections' tile (o and down) also with their residual epilogue."""
    ok = True
    n, k = 16, 4096
    raw = random_blocks(kind, n, k, seed=70 + GPU_TYPES.index(kind))
    w_ref = reference_weight(raw, kind, n)
    planes = regroup(torch.from_numpy(raw), kind).map(lambda t: t.to(device))
    kw = planes.codes.view(torch.int32).shape[1]
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, k, generator=g).to(torch.bfloat16)
    res = torch.randn(1, n, generator=g).to(torch.bfloat16)
    for dp4a in ("1", "0"):
        for config in ((4, 1024, 2, 2), (4, 512, 1, 2), (2, 1024, 1, 2), (8, 2048, 4, 2)):
            for residual in (None, res) if config[0] == 2 else (None,):
                ref = x.double() @ w_ref.T + (0 if residual is None else residual.double())
                mag = x.double().abs() @ w_ref.abs().T + (0 if residual is None else residual.double().abs())
                extra = act8_error(x, w_ref, 16) if dp4a == "1" else 0.0
                r = None if residual is None else residual.to(device)
                outs = []
                for on in ("1", "0"):
                    with environment(DEEPINFER_GGUF_GEMV_LEAN=on, DEEPINFER_GGUF_DP4A=dp4a):
                        outs.append(gguf_gemv(x.to(device), planes, residual=r, config=config))
                        if on == "1":
                            taken = lean_gemv(n, kw, config[0], config[1] // 4)
                what = f"{kind} lean gemv, {'dp4a' if dp4a == '1' else 'f32'}, tiles {config}" + (
                    ", residual" if residual is not None else "")
                ok &= _check(what, outs[0], ref, mag, 2**-7, 2**-7, extra)
                same = taken and torch.equal(outs[0], outs[1])
                print(f"{'ok  ' if same else 'FAIL'} {what}: lean form taken ({taken}), the default form's bits")
                ok &= same
    return ok


def main() -> int:
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    quick = "quick" in sys.argv[2:]
    kinds = [a for a in sys.argv[2:] if a in GPU_TYPES] or list(GPU_TYPES)
    if "lean" in sys.argv[2:]:  # only DEEPINFER_GGUF_GEMV_LEAN's checks
        ok = all([check_lean(kind, device) for kind in kinds])
    else:
        ok = all([check_kind(kind, device, quick) for kind in kinds])
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
