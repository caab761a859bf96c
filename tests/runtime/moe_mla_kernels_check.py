"""Test helper: the MoE routing / sort-by-expert kernels and the MLA decode kernel
(``kernels.fused_moe``, ``attention.triton_mla``) against torch and float64 references.

``python moe_mla_kernels_check.py DEVICE DTYPE [kernels|models|all]``: on CPU run it with
``TRITON_INTERPRET=1`` (Triton's interpreter); prints one line per case and exits non-zero on a
mismatch. ``kernels``: routing, sort by expert, MLA decode; ``models``: the decode graphs'
forward of tiny models against the eager step (float32 only)."""

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


def check_residual_combine(device: str, dtype: torch.dtype) -> list[tuple[str, bool, float]]:
    """fused_experts(residual=r) == r + the experts' weighted sum (float64 reference), with the
    Triton sort (decode-sized) and the torch one (more than TRITON_ALIGN_MAX_PAIRS pairs)."""
    from deepinfer.runtime.kernels import fused_moe
    from fused_moe_check import make_case, reference

    out = []
    for case in ("random", "all_to_one_expert", "experts_without_tokens"):
        x, w, ids, w13, w2 = make_case(case, device, dtype)
        r = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
        ref = reference(x.cpu(), w.cpu(), ids.cpu(), w13.cpu(), w2.cpu()) + r.cpu().double()
        for limit in (fused_moe.TRITON_ALIGN_MAX_PAIRS, 0):
            saved, fused_moe.TRITON_ALIGN_MAX_PAIRS = fused_moe.TRITON_ALIGN_MAX_PAIRS, limit
            try:
                got = fused_moe.fused_experts(x, w, ids, w13, w2, residual=r).double().cpu()
            finally:
                fused_moe.TRITON_ALIGN_MAX_PAIRS = saved
            err = float((got - ref).abs().max() / ref.abs().max())
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            out.append((f"fused_experts + residual {case} ({'triton' if limit else 'torch'} sort)", err <= tol, err))
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


def check_decode_forward(device: str, arch: str) -> tuple[str, bool, float]:
    """The decode graphs' forward of a tiny random float32 model (Qwen3-MoE: the fused Llama
    forward with MoE layers; DeepSeek: its own, with the MLA decode kernel) against the eager
    step's logits, two sequences after a prefill (one a padding row: slot -1)."""
    import tempfile

    import numpy as np
    from deepinfer.runtime.loading.model_loader import load_model
    from deepinfer.runtime.worker.model_runner import ModelRunner
    from tiny_moe_models import save_tiny_moe

    dev = torch.device(device)
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_moe(tmp, arch)
        runner = ModelRunner(load_model(tmp, device=dev, dtype=torch.float32), num_blocks=8, block_size=4,
                             device=dev, dtype=torch.float32, attention_backend="torch")
    prompts = [[5, 17, 33, 2, 99, 140, 7], [8, 9, 10, 11, 250]]
    table = np.array([[1, 2, 3], [4, 5, 6]])
    ids, pos, slots, qsl = [], [], [], [0]
    for i, p in enumerate(prompts):
        ids += p
        pos += list(range(len(p)))
        slots += [int(table[i][j // 4] * 4 + j % 4) for j in range(len(p))]
        qsl.append(qsl[-1] + len(p))
    lens = [len(p) for p in prompts]
    runner.execute(input_ids=np.array(ids), positions=np.array(pos), slot_mapping=np.array(slots),
                   query_start_loc=np.array(qsl), seq_lens=np.array(lens), block_tables=table,
                   logits_indices=np.array([qsl[1] - 1, qsl[2] - 1]))
    new = [12, 300]
    step_slots = [int(table[i][n // 4] * 4 + n % 4) for i, n in enumerate(lens)]
    model = runner.model
    as_t = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    args = (as_t(new + [0]), as_t(lens + [0]), runner.kv_caches, torch.tensor(step_slots + [-1], device=dev),
            as_t(np.vstack([table, [[0, 0, 0]]])), as_t([n + 1 for n in lens] + [1]))
    if hasattr(model, "graph_decode_forward"):
        hidden = model.graph_decode_forward(*args, num_splits=2)
    else:
        from deepinfer.runtime.attention.triton_decode import DecodeWorkspace
        from deepinfer.runtime.models.llama_fused_decode import fused_decode_forward

        cfg = runner.config
        hidden = fused_decode_forward(model, *args, DecodeWorkspace(6, cfg.num_attention_heads, cfg.head_dim, dev), 2)
    got = model.head_logits(hidden[:2]).float()
    ref = runner.execute(input_ids=np.array(new), positions=np.array(lens), slot_mapping=np.array(step_slots),
                         query_start_loc=np.array([0, 1, 2]), seq_lens=np.array([n + 1 for n in lens]),
                         block_tables=table, logits_indices=np.array([0, 1]))
    err = float((got.cpu() - ref.cpu()).abs().max())
    return f"decode graph forward {arch} float32 vs eager", err <= 1e-4, err


def main(device: str, dtype_name: str, part: str = "all") -> int:
    dtype = getattr(torch, dtype_name)
    bad = 0
    if dtype == torch.float32 and part in ("models", "all"):
        for arch in ("qwen3_moe", "deepseek_v2", "deepseek_v3"):
            name, ok, err = check_decode_forward(device, arch)
            bad += not ok
            print(f"{device} {name}: max |logit error| = {err:.2e} ({'ok' if ok else 'FAIL'})")
    if part == "models":
        return 1 if bad else 0
    for name, ok in check_align(device) + check_route(device):
        bad += not ok
        print(f"{device} {name}: {'ok' if ok else 'FAIL'}")
    for name, ok, err in check_residual_combine(device, dtype) + check_mla(device, dtype):
        bad += not ok
        print(f"{device} {dtype_name} {name}: max error / max |ref| = {err:.2e} ({'ok' if ok else 'FAIL'})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
