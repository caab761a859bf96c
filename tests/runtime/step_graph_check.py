"""Run by test_step_graphs.py in a subprocess with TRITON_INTERPRET=1 (set before triton loads), and
on a CUDA device by hand (``python step_graph_check.py MODEL_DIR cuda``): the step graphs' padded
forward (``StepGraphs.run_eager``; on CUDA also the captured graphs' ``run``) against the unpadded
fused eager step (``fused_step_forward``), float32, over the steps of ``fused_step_check.py`` (two
prompts of 17 and 5 tokens padded to 32 rows; a decode row, a chunk and a new prompt padded to 16;
one row padded to 16): hidden states of the real rows and every KV-cache block but the scratch one.

    python step_graph_check.py MODEL_DIR [cpu|cuda]
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from fused_step_check import BLOCK, STEPS, TABLES, slots_of  # noqa: E402

NUM_BLOCKS = 8  # the scratch block is block 8


def step_arrays(step) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    return {
        "input_ids": np.concatenate([r[2] for r in step]).astype(np.int64),
        "positions": np.concatenate([np.arange(r[1], r[1] + len(r[2])) for r in step]),
        "slot_mapping": np.concatenate([slots_of(r[0], list(range(r[1], r[1] + len(r[2])))) for r in step]),
        "query_start_loc": np.concatenate([[0], np.cumsum([len(r[2]) for r in step])]),
        "seq_lens": np.array([r[1] + len(r[2]) for r in step]),
        "block_tables": TABLES[[r[0] for r in step]],
    }


def main() -> int:
    path, dev = sys.argv[1], torch.device(sys.argv[2] if len(sys.argv) > 2 else "cpu")
    from deepinfer.runtime.attention.metadata import build_attention_metadata
    from deepinfer.runtime.attention.triton_paged import paged_attention
    from deepinfer.runtime.loading.model_loader import load_model
    from deepinfer.runtime.models import moe as moe_module
    from deepinfer.runtime.models.llama_fused_decode import fused_step_forward
    from deepinfer.runtime.worker.kv_cache import allocate_kv_caches
    from deepinfer.runtime.worker.step_graph_runner import StepGraphs

    loaded = load_model(path, device=dev, dtype=torch.float32)
    model = loaded.model
    moe_module.KERNELS_ON_CPU = True  # both paths: the Triton experts (as on CUDA)

    def runner() -> SimpleNamespace:
        caches = allocate_kv_caches(loaded.config, NUM_BLOCKS, BLOCK, torch.float32, dev)
        for c in caches:  # (allocated uninitialised)
            c.zero_()
        return SimpleNamespace(model=model, config=loaded.config, device=dev, block_size=BLOCK,
                               num_blocks=NUM_BLOCKS, scratch_slot=NUM_BLOCKS * BLOCK, kv_caches=caches,
                               attention=paged_attention)

    forms = ["run_eager"] + (["run"] if dev.type == "cuda" else [])
    for form in forms:
        ref, padded = runner(), runner()
        graphs = StepGraphs(padded, [16, 32, 64], max_num_seqs=4, max_model_len=TABLES.shape[1] * BLOCK)  # type: ignore[arg-type]
        if form == "run":
            graphs.capture()  # (writes only the scratch block)
        for i, step in enumerate(STEPS):
            a = step_arrays(step)
            meta = build_attention_metadata(
                slot_mapping=a["slot_mapping"], query_start_loc=a["query_start_loc"], seq_lens=a["seq_lens"],
                block_tables=a["block_tables"], block_size=BLOCK, scratch_slot=NUM_BLOCKS * BLOCK, device=dev)
            ids = torch.from_numpy(a["input_ids"]).to(dev)
            pos = torch.from_numpy(a["positions"].astype(np.int64)).to(dev)
            with torch.no_grad():
                want = fused_step_forward(model, ids, pos, ref.kv_caches, meta)
                got = getattr(graphs, form)(**a)
            torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-5)
            for c_got, c_want in zip(padded.kv_caches, ref.kv_caches, strict=True):
                torch.testing.assert_close(c_got[:, :NUM_BLOCKS], c_want[:, :NUM_BLOCKS], atol=3e-5, rtol=3e-5)
            err = float((got - want).abs().max() / want.abs().max())
            print(f"{dev.type} {form} step {i} ({len(step)} sequences, {len(a['positions'])} rows, graph of "
                  f"{graphs._count(len(a['positions']))}): max error / max |ref| = {err:.2e}")
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
