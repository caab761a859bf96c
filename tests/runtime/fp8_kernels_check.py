"""Test helper: the FP8 weight kernels (``kernels.fp8_gemv``) against a float64 product of the
dequantized weights.

``python fp8_kernels_check.py DEVICE DTYPE``: on CPU run it with ``TRITON_INTERPRET=1`` and
float32 (the interpreter rounds float32 -> bfloat16 toward zero and its bfloat16 ``tl.dot`` is
wrong, so bfloat16 is checked on the GPU only); prints one line per case ("ok") and exits non-zero
on a mismatch."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F


def _bound(dtype: torch.dtype) -> float:
    # float32: summation order only; bf16/fp16: one rounding of each output (2^-8 / 2^-11 relative)
    return {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double().cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def main(device: str, dtype_name: str) -> int:
    from deepinfer.runtime.kernels.fp8_gemv import fp8_gemm, fp8_gemv
    from deepinfer.runtime.models.fp8_linear import dequantize_fp8, quantize_fp8

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    failures = 0

    def report(name: str, err: float) -> None:
        nonlocal failures
        ok = err <= _bound(dtype)
        failures += not ok
        print(f"{name}: rel. error {err:.2e} ({'ok' if ok else 'MISMATCH'}, bound {_bound(dtype):.0e})")

    # shapes: K not a multiple of the tile, N not a multiple of the row block, one zero row
    for n, k, tile in ((10, 96, (4, 32, 1, 1)), (33, 200, (2, 64, 1, 1)), (7, 64, (8, 64, 1, 1))):
        w = torch.randn(n, k, generator=g)
        w[n // 2] = 0.0
        q, s = (t.to(device) for t in quantize_fp8(w))
        wd = dequantize_fp8(q.cpu(), s.cpu(), torch.float64)
        x = torch.randn(1, 2 * k, generator=g).to(device, dtype)
        bias = torch.randn(n, generator=g).to(device, dtype)
        res = torch.randn(1, n, generator=g).to(device, dtype)
        nw = (torch.rand(k, generator=g) + 0.5).to(device, dtype)
        x1 = x[:, :k].contiguous()
        xd = x1.double().cpu()
        report(f"gemv {n}x{k} plain+bias", _rel(fp8_gemv(x1, q, s, bias, config=tile),
                                                xd @ wd.T + bias.double().cpu()))
        xf = x1.float().cpu()
        normed = nw.float().cpu() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype).float()
        report(f"gemv {n}x{k} norm", _rel(fp8_gemv(x1, q, s, norm=(nw, 1e-5), config=tile), normed.double() @ wd.T))
        report(f"gemv {n}x{k} residual", _rel(fp8_gemv(x1, q, s, residual=res, config=tile),
                                              xd @ wd.T + res.double().cpu()))
        a = (F.silu(x[:, :k].float()).to(dtype).float() * x[:, k:].float()).to(dtype).double().cpu()
        report(f"gemv {n}x{k} silu_mul", _rel(fp8_gemv(x, q, s, silu_mul=True, config=tile), a @ wd.T))
        for rows in (1, 3, 17, 64):
            xm = torch.randn(rows, k, generator=g).to(device, dtype)
            report(f"gemm {rows}x{n}x{k}+bias", _rel(fp8_gemm(xm, q, s, bias, config=(16, 16, 32, 1, 1)),
                                                     xm.double().cpu() @ wd.T + bias.double().cpu()))
    print(f"{'FAILED' if failures else 'all ok'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
