"""Run by test_fused_kernels.py in a subprocess with TRITON_INTERPRET=1 (set before triton loads),
and on a CUDA device by test_cuda_graphs_gpu.py: the fused eager forward
(``fused_step_forward``) against the model's own forward with the torch paged attention, over
steps of every shape — two prompts, a chunk continuing a prompt beside a decode row and a new
prompt (a mixed step), and a step of one row (the one-row GEMV path) — hidden states and the
KV cache each step leaves.

    python fused_step_check.py MODEL_DIR [cpu|cuda]
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from triton_interpreter_compat import interpreter_loop_bounds_compat  # noqa: E402

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


def main() -> int:
    path, dev = sys.argv[1], torch.device(sys.argv[2] if len(sys.argv) > 2 else "cpu")
    if dev.type == "cpu":
        interpreter_loop_bounds_compat()
    from deepinfer.runtime.attention import torch_paged, triton_paged
    from deepinfer.runtime.attention.metadata import build_attention_metadata
    from deepinfer.runtime.loading.model_loader import load_model
    from deepinfer.runtime.models.llama_fused_decode import fused_step_forward, fused_step_supported
    from deepinfer.runtime.worker.kv_cache import allocate_kv_caches

    dtypes = (torch.float32,) if dev.type == "cpu" else (torch.float32, torch.bfloat16)
    for dtype in dtypes:
        loaded = load_model(path, device=dev, dtype=dtype)
        model = loaded.model
        assert fused_step_supported(model, triton_paged.paged_attention)
        assert not fused_step_supported(model, torch_paged.paged_attention)
        ref_caches = allocate_kv_caches(loaded.config, 8, BLOCK, dtype, dev)
        fused_caches = allocate_kv_caches(loaded.config, 8, BLOCK, dtype, dev)
        for c in ref_caches + fused_caches:  # (allocated uninitialised)
            c.zero_()
        tol = dict(atol=3e-5, rtol=3e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
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
                got = fused_step_forward(model, t_ids, t_pos, fused_caches, meta)
            torch.testing.assert_close(got, want, **tol)
            for a, b in zip(fused_caches, ref_caches, strict=True):
                torch.testing.assert_close(a, b, **tol)
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            print(f"{dev.type} {dtype} step {i} ({len(step)} sequences, {len(ids)} rows): max error / max |ref| "
                  f"= {err:.2e}")
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
