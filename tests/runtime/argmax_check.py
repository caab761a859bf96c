"""Run by test_fused_kernels.py in a subprocess with TRITON_INTERPRET=1 (set before triton loads),
and directly on a CUDA device: ``kernels.argmax.argmax_rows`` against ``torch.argmax`` (the op it
replaces in decode graphs), on the rules a greedy pick depends on.

    python argmax_check.py [cpu|cuda]
"""

from __future__ import annotations

import sys

import torch
from deepinfer.runtime.kernels.argmax import BLOCK, argmax_rows


def _check(name: str, logits: torch.Tensor) -> None:
    got = argmax_rows(logits)
    want = torch.argmax(logits.cpu().float(), dim=-1)  # the reference: torch on the CPU, float32 (exact widening)
    assert got.dtype == torch.int64 and got.shape == want.shape, (name, got.dtype, got.shape)
    assert torch.equal(got.cpu(), want), f"{name}: got {got.cpu().tolist()[:8]}, torch.argmax {want.tolist()[:8]}"
    print(f"{name}: ok")


def main(device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for rows, vocab in ((1, 7), (3, BLOCK), (2, BLOCK + 1), (4, 3 * BLOCK - 5)):
            x = torch.randn(rows, vocab, generator=gen).to(dtype)
            _check(f"random {dtype} {rows}x{vocab}", x.to(device))

    vocab = 2 * BLOCK + 100
    x = torch.randn(6, vocab, generator=gen)
    x[0, 17] = x[0, BLOCK + 3] = x[0, vocab - 1] = 50.0  # a tie across chunks: the first index
    x[1, BLOCK - 1] = x[1, BLOCK] = 50.0  # a tie at a chunk boundary
    x[2] = float("-inf")  # all -inf: index 0
    x[3, 9] = float("nan")  # NaN wins over everything, +inf included
    x[3, 5] = float("inf")
    x[3, BLOCK + 2] = float("nan")
    x[4] = -torch.rand(vocab, generator=gen) - 1.0  # only negatives
    x[4, BLOCK + 8] = -0.5
    x[5] = 0.0  # -0.0 ties with +0.0: the first of them
    x[5, :10] = -0.0
    x[5, 20:] = -1.0
    _check("edge rows", x.to(device))
    _check("bf16 ties", x.to(torch.bfloat16).to(device))
    _check("one row", x[3:4].to(device))

    wide = torch.randn(3, vocab + 50, generator=gen)
    view = wide[:, :vocab]  # rows of a wider buffer (row stride > vocab)
    _check("strided rows", view.to(device))

    out = torch.full((2,), -1, dtype=torch.int64, device=device)
    assert argmax_rows(x[:2].to(device), out=out) is out and out.cpu().tolist() == [17, BLOCK - 1]
    assert argmax_rows(torch.empty(0, 5, device=device)).shape == (0,)

    bad = [(torch.randn(4, device=device), "float [rows, vocab]"),
           (torch.randn(4, 3, device=device).t(), "contiguous rows"),
           (torch.ones(2, 3, dtype=torch.int32, device=device), "float [rows, vocab]"),
           (torch.randn(2, 0, device=device), "1 to 2**31 - 1 columns")]
    for arg, words in bad:
        try:
            argmax_rows(arg)
        except ValueError as e:
            assert "argmax_rows" in str(e) and words in str(e), str(e)
        else:
            raise AssertionError(f"argmax_rows accepted {arg.dtype} {tuple(arg.shape)}")
    try:
        argmax_rows(x[:2].to(device), out=torch.empty(3, dtype=torch.int64, device=device))
    except ValueError as e:
        assert "out must be an int64 [2]" in str(e), str(e)
    else:
        raise AssertionError("argmax_rows accepted an out of the wrong shape")
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cpu")
