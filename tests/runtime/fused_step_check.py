"""Run by test_fused_kernels.py in a subprocess with TRITON_INTERPRET=1 (set before triton loads),
and on a CUDA device by test_cuda_graphs_gpu.py: the fused eager forward
(``fused_step_forward``) against the model's own forward with the torch paged attention, over
steps of every shape — two prompts, a chunk continuing a prompt beside a decode row and a new
prompt (a mixed step), and a step of one row (the one-row GEMV path) — hidden states and the
KV cache each step leaves.

Mixture-of-experts models run their Triton routing and expert kernels on the CPU too (under the
interpreter) in the fused step, while the reference keeps the torch experts. In bf16 their two
paths round differently, and a routing near-tie then sends a token to another expert: a few values
move a lot, which a bound on the largest error cannot tell from a wrong kernel. There the bound is
on the median error (a wrong kernel moves most values), and the 90th percentile and the share of
values beyond 1e-2 are printed for both paths. On the H200 (2026-12-04) the tiny Mixtral's first
step had 30.7 % of its values beyond 1e-2 through the fused step and 18.8 % through the torch
ops, Qwen2-MoE's 23.4 / 15.1 %, Qwen3-MoE's 8.2 / 8.2 %.

    python fused_step_check.py MODEL_DIR [cpu|cuda]
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

BLOCK = 16  # the Triton attention's smallest block
TABLES = np.array([[1, 2, 0], [3, 4, 0], [5, 6, 0]])


def slots_of(seq: int, positions: list[int]) -> list[int]:
    return [int(TABLES[seq][p // BLOCK]) * BLOCK + p % BLOCK for p in positions]


# Each step: (sequence, first position, token ids) rows, in order.
STEPS = [
    [(0, 0, [5, 17, 33, 2, 99, 140, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 20]), (1, 0, [7, 8, 250, 3, 11])],
    [(0, 17, [12]), (1, 5, [30, 31, 32, 33, 34, 35, 36]), (2, 0, [40, 41, 42])],  # decode + chunk + prompt
    [(2, 3, [43])],  # one row
]


def rel_err(a: torch.Tensor, b: torch.Tensor, q: float = 1.0) -> float:
    """The ``q`` quantile (1.0: the largest) of |a - b| over max |b|, in float32; a quantile is
    taken over the values where ``b`` is not zero (a KV cache's written slots)."""
    d = (a.float() - b.float()).abs().flatten()
    top = d.max() if q >= 1.0 else torch.quantile(d[b.flatten() != 0], q)
    return float(top / b.float().abs().max().clamp_min(1e-30))


def moved(a: torch.Tensor, b: torch.Tensor, bound: float) -> float:
    """The share of values of ``a`` further than ``bound`` * max |b| from ``b``."""
    d = (a.float() - b.float()).abs()
    return float((d > bound * b.float().abs().max()).float().mean())


def main() -> int:
    path, dev = sys.argv[1], torch.device(sys.argv[2] if len(sys.argv) > 2 else "cpu")
    from deepinfer.runtime.attention import torch_paged, triton_paged
    from deepinfer.runtime.attention.metadata import build_attention_metadata
    from deepinfer.runtime.loading.model_loader import load_model
    from deepinfer.runtime.models import moe as moe_module
    from deepinfer.runtime.models.llama_fused_decode import fused_step_forward, fused_step_supported
    from deepinfer.runtime.worker.kv_cache import allocate_kv_caches

    dtypes = (torch.float32,) if dev.type == "cpu" else (torch.float32, torch.bfloat16)
    for dtype in dtypes:
        loaded = load_model(path, device=dev, dtype=dtype)
        model = loaded.model
        experts = bool(moe_module.moe_layers(model))
        assert fused_step_supported(model, triton_paged.paged_attention)
        assert not fused_step_supported(model, torch_paged.paged_attention)
        ref_caches = allocate_kv_caches(loaded.config, 8, BLOCK, dtype, dev)
        fused_caches = allocate_kv_caches(loaded.config, 8, BLOCK, dtype, dev)
        for c in ref_caches + fused_caches:  # (allocated uninitialised)
            c.zero_()
        exact = dtype == torch.float32
        if not exact:  # bf16: both bf16 paths are measured against the float32 model
            model32 = load_model(path, device=dev, dtype=torch.float32).model
            caches32 = allocate_kv_caches(loaded.config, 8, BLOCK, torch.float32, dev)
            for c in caches32:
                c.zero_()
        for i, step in enumerate(STEPS):
            ids = np.concatenate([r[2] for r in step])
            pos = np.concatenate([np.arange(r[1], r[1] + len(r[2])) for r in step])
            slots = np.concatenate([slots_of(r[0], list(range(r[1], r[1] + len(r[2])))) for r in step])
            qsl = np.concatenate([[0], np.cumsum([len(r[2]) for r in step])])
            meta = build_attention_metadata(
                slot_mapping=slots, query_start_loc=qsl, seq_lens=np.array([r[1] + len(r[2]) for r in step]),
                block_tables=TABLES[[r[0] for r in step]], block_size=BLOCK, scratch_slot=8 * BLOCK, device=dev)
            t_ids = torch.from_numpy(ids.astype(np.int64)).to(dev)
            t_pos = torch.from_numpy(pos.astype(np.int64)).to(dev)
            with torch.no_grad():
                want = model(t_ids, t_pos, ref_caches, meta, torch_paged.paged_attention)
                moe_module.KERNELS_ON_CPU = experts  # the fused step's experts: Triton kernels on CPU too
                try:
                    got = fused_step_forward(model, t_ids, t_pos, fused_caches, meta)
                finally:
                    moe_module.KERNELS_ON_CPU = False
            if exact:  # float32: the same math, a few ulps apart (reduction orders)
                torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-5)
                for a, b in zip(fused_caches, ref_caches, strict=True):
                    torch.testing.assert_close(a, b, atol=3e-5, rtol=3e-5)
                err = rel_err(got, want)
                print(f"{dev.type} {dtype} step {i} ({len(step)} sequences, {len(ids)} rows): max error / max |ref| "
                      f"= {err:.2e}")
                continue
            # bf16: each path rounds its own way (and diverges further layer by layer), so neither
            # is the reference: the fused step must be about as close to the float32 model as the
            # torch ops' bf16 step is
            with torch.no_grad():
                ref32 = model32(t_ids, t_pos, caches32, meta, torch_paged.paged_attention)
            q = 0.5 if experts else 1.0
            e_fused, e_torch = rel_err(got, ref32, q), rel_err(want, ref32, q)
            c_fused = max(rel_err(a, b, q) for a, b in zip(fused_caches, caches32, strict=True))
            c_torch = max(rel_err(a, b, q) for a, b in zip(ref_caches, caches32, strict=True))
            what = "median" if experts else "largest"
            print(f"{dev.type} {dtype} step {i} ({len(step)} sequences, {len(ids)} rows): vs float32 ({what} error), "
                  f"hidden {e_fused:.2e} fused / {e_torch:.2e} torch ops, KV cache {c_fused:.2e} / {c_torch:.2e}")
            if experts:  # routing near-ties: the tail each path has, and how many values moved past 1e-2
                print(f"  90th percentile error {rel_err(got, ref32, 0.9):.2e} fused / {rel_err(want, ref32, 0.9):.2e} "
                      f"torch ops; values beyond 1e-2 of max |ref|: {moved(got, ref32, 1e-2):.1%} fused / "
                      f"{moved(want, ref32, 1e-2):.1%} torch ops")
            assert e_fused <= max(2 * e_torch, 1e-2) and c_fused <= max(2 * c_torch, 1e-2), (e_fused, e_torch)
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
