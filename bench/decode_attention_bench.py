"""Decode attention on CUDA: the split-K kernel (several split counts) against the paged Triton
kernel used for prefill/mixed steps, for batch sizes and context lengths of the GPU benchmarks.

    python bench/decode_attention_bench.py

Prints microseconds per call (triton.testing.do_bench median) and the KV bandwidth reached.
The timings include each call's host-side launch, so the small cases (batch 1, short contexts)
measure the launch path rather than the kernel; inside a CUDA graph those launches are gone.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
import triton
from deepinfer.runtime.attention import triton_paged
from deepinfer.runtime.attention.metadata import build_attention_metadata
from deepinfer.runtime.attention.triton_decode import choose_num_splits, decode_attention


def main() -> None:
    dev = torch.device("cuda")
    bs = 16
    print(f"{torch.cuda.get_device_name()}; bf16, block size {bs}")
    for heads, kvh, d, name in ((9, 3, 64, "SmolLM2-135M"), (32, 8, 128, "Llama-3-8B")):
        for b, ctx in ((1, 384), (1, 4096), (32, 256), (256, 384)):
            nblk = -(-ctx // bs)
            num_blocks = b * nblk + 1
            cache = torch.randn(2, num_blocks, bs, kvh, d, device=dev, dtype=torch.bfloat16)
            q = torch.randn(b, heads, d, device=dev, dtype=torch.bfloat16)
            tables = np.arange(b * nblk, dtype=np.int32).reshape(b, nblk)
            lens = np.full(b, ctx)
            bt = torch.from_numpy(tables).to(dev)
            sl = torch.from_numpy(lens.astype(np.int32)).to(dev)
            kv_bytes = 2 * b * ctx * kvh * d * 2
            auto = choose_num_splits(b, kvh, ctx, torch.cuda.get_device_properties(dev).multi_processor_count)
            row = []
            for splits in sorted({1, auto, 4 * auto}):
                us = triton.testing.do_bench(partial(decode_attention, q, cache, bt, sl, d ** -0.5, splits)) * 1e3
                row.append(f"splits {splits:>2}: {us:7.1f} us ({kv_bytes / us / 1e3:6.0f} GB/s)")
            meta = build_attention_metadata(slot_mapping=np.full(b, -1), query_start_loc=np.arange(b + 1),
                                            seq_lens=lens, block_tables=tables, block_size=bs,
                                            scratch_slot=(num_blocks - 1) * bs, device=dev)
            empty = torch.zeros(b, kvh, d, device=dev, dtype=torch.bfloat16)
            us = triton.testing.do_bench(partial(triton_paged.paged_attention, q, empty, empty, cache, meta,
                                                 d ** -0.5)) * 1e3
            row.append(f"paged kernel (+KV write): {us:7.1f} us")
            print(f"{name:<13} B={b:<4} ctx={ctx:<5} " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
