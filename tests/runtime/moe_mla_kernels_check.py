"""Test helper: the MoE routing / sort-by-expert kernels and the MLA decode kernel
(``kernels.fused_moe``, ``attention.triton_mla``) against torch and float64 references.

``python moe_mla_kernels_check.py DEVICE DTYPE``: on CPU run it with ``TRITON_INTERPRET=1``
(Triton's interpreter); prints one line per case and exits non-zero on a mismatch."""

from __future__ import annotations

import sys

import torch

ALIGN_CASES = [(1, 1, 4, 16), (3, 2, 32, 16), (256, 8, 128, 16), (257, 2, 160, 32), (64, 4, 8, 64),
               (33, 6, 257, 32), (40, 2, 8, 16)]


def check_align(device: str) -> list[tuple[str, bool]]:
    from deepinfer.runtime.kernels.fused_moe import align_by_expert, align_by_expert_triton

    out = []
    for tokens, k, e, block in ALIGN_CASES:
        g = torch.Generator().manual_seed(tokens)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
        if tokens == 40:  # every token to experts 5 and 2; the other six experts get none
            ids[:, 0], ids[:, 1] = 5, 2
        want = align_by_expert(ids, e, block)
        got = align_by_expert_triton(ids.to(device), e, block)
        ok = torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
        out.append((f"align T={tokens} k={k} E={e} block={block}", ok))
    return out


def check_route(device: str) -> list[tuple[str, bool]]:
    from deepinfer.runtime.kernels.fused_moe import route_greedy
    from deepinfer.runtime.models.config import MoeSpec
    from deepinfer.runtime.models.moe import route

    g = torch.Generator().manual_seed(0)
    cases = {
        "random": torch.randn(37, 60, generator=g),
        "ties": torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0, -1.0, 2.0, 0.5]] * 3 + [[0.0] * 8]),
        "one_expert_dominates": torch.full((9, 16), -30.0).index_fill_(1, torch.tensor([11]), 30.0),
    }
    out = []
    for name, logits in cases.items():
        e = logits.shape[1]
        for scoring in ("softmax", "sigmoid"):
            for norm, scale in ((True, 1.0), (False, 1.0), (True, 2.5)):
                k = 6 if e >= 8 else 2
                spec = MoeSpec(num_experts=e, top_k=k, expert_intermediate_size=4, moe_layers=(0,),
                               norm_topk_prob=norm, scoring=scoring, routed_scaling_factor=scale)
                want_w, _ = route(logits, spec)  # torch's weights (descending)
                scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
                # ties to the lower expert index: a stable descending sort (torch.topk leaves
                # the order of ties to its implementation: CPU and CUDA differ for larger k)
                want_i = torch.sort(scores, dim=-1, descending=True, stable=True)[1][:, :k]
                got_w, got_i = route_greedy(logits.to(device), k, scoring == "sigmoid", norm, scale)
                ok = torch.equal(got_i.cpu(), want_i) and torch.allclose(got_w.cpu(), want_w, atol=1e-6, rtol=1e-5)
                out.append((f"route {name} {scoring} norm={norm} scale={scale}", ok))
    return out


def mla_reference(q, cache, bt, lens, c_dim, scale):
    """float64, one sequence and head at a time."""
    flat = cache.view(-1, cache.shape[-1]).double()
    bs = cache.shape[2]
    out = torch.zeros(q.shape[0], q.shape[1], c_dim, dtype=torch.float64)
    for b in range(q.shape[0]):
        n = int(lens[b])
        slots = torch.tensor([int(bt[b, i // bs]) * bs + i % bs for i in range(n)])
        ctx = flat[slots]
        for h in range(q.shape[1]):
            p = torch.softmax((ctx @ q[b, h].double()) * scale, dim=0)
            out[b, h] = p @ ctx[:, :c_dim]
    return out


def check_mla(device: str, dtype: torch.dtype) -> list[tuple[str, bool, float]]:
    from deepinfer.runtime.attention.triton_mla import mla_decode

    out = []
    for heads, c_dim, r_dim, bs, lens, splits in [(3, 32, 8, 4, [1, 7, 13], 1), (3, 32, 8, 4, [1, 7, 30], 3),
                                                   (16, 64, 16, 16, [40], 4), (20, 48, 8, 16, [5, 70], 2)]:
        g = torch.Generator().manual_seed(heads + len(lens))
        nblk = 12
        cache = torch.randn(1, nblk + 1, bs, 1, c_dim + r_dim, generator=g)
        per = max((n + bs - 1) // bs for n in lens)
        bt = torch.stack([torch.randperm(nblk, generator=g)[:per] for _ in lens]).to(torch.int32)
        q = torch.randn(len(lens), heads, c_dim + r_dim, generator=g)
        scale = (c_dim + r_dim) ** -0.5
        ref = mla_reference(q, cache, bt, torch.tensor(lens), c_dim, scale)
        got = mla_decode(q.to(device, dtype), cache.to(device, dtype), bt.to(device),
                         torch.tensor(lens, dtype=torch.int32, device=device), c_dim, scale, splits)
        err = float((got.double().cpu() - ref).abs().max() / ref.abs().max())
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        out.append((f"mla_decode H={heads} C={c_dim} R={r_dim} block={bs} lens={lens} splits={splits}",
                    err <= tol, err))
    return out


def main(device: str, dtype_name: str) -> int:
    dtype = getattr(torch, dtype_name)
    bad = 0
    for name, ok in check_align(device) + check_route(device):
        bad += not ok
        print(f"{device} {name}: {'ok' if ok else 'FAIL'}")
    for name, ok, err in check_mla(device, dtype):
        bad += not ok
        print(f"{device} {dtype_name} {name}: max error / max |ref| = {err:.2e} ({'ok' if ok else 'FAIL'})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
