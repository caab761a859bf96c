"""Test helper: the fused MoE kernels (``kernels.fused_moe``) against a float64 per-expert reference.

``python fused_moe_check.py DEVICE DTYPE``: on CPU run it with ``TRITON_INTERPRET=1`` (Triton's
interpreter); prints one line per case and exits non-zero on a mismatch."""

from __future__ import annotations

import sys

import torch

CASES = ["random", "all_to_one_expert", "experts_without_tokens", "one_token", "ties", "many_tokens"]


def reference(x, weights, ids, w13, w2):
    """float64, one token and one expert at a time."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13[e].double() @ x[t].double()
            h = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            out[t] += float(weights[t, j]) * (w2[e].double() @ h)
    return out


def make_case(case, device, dtype, e=8, hidden=96, inter=80, k=2):
    g = torch.Generator().manual_seed(CASES.index(case))
    t = {"one_token": 1, "many_tokens": 70}.get(case, 13)
    x = torch.randn(t, hidden, generator=g)
    w13 = torch.randn(e, 2 * inter, hidden, generator=g) * hidden ** -0.5
    w2 = torch.randn(e, hidden, inter, generator=g) * inter ** -0.5
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    if case == "all_to_one_expert":
        ids[:, 0] = 5
        ids[:, 1] = 2
    if case == "experts_without_tokens":  # only experts 1 and 6 are chosen
        ids = torch.tensor([[1, 6], [6, 1]]).repeat(t, 1)[:t]
    if case == "ties":  # the same expert twice for a token (weights from tied scores)
        ids[:, 1] = ids[:, 0]
    weights = torch.rand(t, k, generator=g)
    to = dict(device=device)
    return x.to(dtype=dtype, **to), weights.to(**to), ids.to(**to), w13.to(dtype=dtype, **to), w2.to(dtype=dtype, **to)


def main(device: str, dtype_name: str) -> int:
    from deepinfer.runtime.kernels.fused_moe import fused_experts

    dtype = getattr(torch, dtype_name)
    tol = {"float32": 1e-4, "bfloat16": 2e-2}[dtype_name]
    bad = 0
    for case in CASES:
        x, w, ids, w13, w2 = make_case(case, device, dtype)
        got = fused_experts(x, w, ids, w13, w2).double().cpu()
        ref = reference(x.cpu(), w.cpu(), ids.cpu(), w13.cpu(), w2.cpu())
        err = float((got - ref).abs().max() / ref.abs().max())
        ok = err <= tol
        bad += not ok
        print(f"fused_moe {device} {dtype_name} {case}: max error / max |ref| = {err:.2e} "
              f"({'ok' if ok else 'FAIL'}, tolerance {tol:g})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
