"""Run by test_tensor_parallel.py in a subprocess with TRITON_INTERPRET=1 (set before triton loads):
the fused decode forward (the path CUDA graphs capture) on a Llama split over 2 gloo ranks gives
the logits of the unsplit model's fused decode forward.

    python tp_fused_check.py MODEL_DIR

Each rank prefills two prompts through the eager path, then runs one fused decode step; rank 0
compares its gathered logits with those of the same steps in this (unsplit) process.
"""

from __future__ import annotations

import datetime
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PROMPTS = [[5, 17, 33, 2, 99, 140, 7], [7, 8, 250, 3, 11]]
NEXT = [12, 301]
BLOCK = 4


def run_steps(path: str, group) -> torch.Tensor:  # type: ignore[no-untyped-def]
    from deepinfer.runtime.attention.triton_decode import DecodeWorkspace
    from deepinfer.runtime.loading.model_loader import load_model
    from deepinfer.runtime.models.llama_fused_decode import fused_decode_forward
    from deepinfer.runtime.worker.model_runner import ModelRunner

    cpu = torch.device("cpu")
    loaded = load_model(path, device=cpu, dtype=torch.float32, tensor_parallel=group)
    runner = ModelRunner(loaded, num_blocks=16, block_size=BLOCK, device=cpu, dtype=torch.float32)
    tables = np.array([[1, 2, 3], [4, 5, 6]])
    ids = np.concatenate(PROMPTS)
    pos = np.concatenate([np.arange(len(p)) for p in PROMPTS])
    slots = np.concatenate([tables[i][pos_i // BLOCK] * BLOCK + pos_i % BLOCK
                            for i, pos_i in enumerate([np.arange(len(p)) for p in PROMPTS])])
    runner.execute(input_ids=ids, positions=pos, slot_mapping=slots,
                   query_start_loc=np.array([0, len(PROMPTS[0]), len(ids)]),
                   seq_lens=np.array([len(p) for p in PROMPTS]), block_tables=tables,
                   logits_indices=np.array([len(PROMPTS[0]) - 1, len(ids) - 1]))
    lens = [len(p) for p in PROMPTS]
    d_slots = torch.tensor([tables[i][n // BLOCK] * BLOCK + n % BLOCK for i, n in enumerate(lens)])
    cfg = runner.config
    hidden = fused_decode_forward(
        runner.model, torch.tensor(NEXT, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
        runner.kv_caches, d_slots, torch.tensor(tables, dtype=torch.int32),
        torch.tensor([n + 1 for n in lens], dtype=torch.int32),
        DecodeWorkspace(4, cfg.num_attention_heads, cfg.head_dim, cpu), 2)
    return runner.model.head_logits(hidden)


def rank_main(rank: int, port: int, path: str, results) -> None:  # type: ignore[no-untyped-def]
    from deepinfer.runtime.parallel.process_group import init_groups

    group = init_groups(rank, 2, torch.device("cpu"), f"tcp://127.0.0.1:{port}", 120.0)
    logits = run_steps(path, group)
    if rank == 0:
        results.put(logits.numpy())
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import socket

    from deepinfer.runtime.parallel.process_group import single_rank

    path = sys.argv[1]
    expected = run_steps(path, single_rank(torch.device("cpu")))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, port, path, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = torch.from_numpy(results.get(timeout=datetime.timedelta(seconds=300).total_seconds()))
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, p.exitcode
    assert got.shape == expected.shape == (2, 320), (got.shape, expected.shape)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    print("ok")


if __name__ == "__main__":
    main()
