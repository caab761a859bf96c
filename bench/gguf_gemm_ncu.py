"""The 32-row GGUF GEMMs of the Llama-3-8B gate_up and down shapes, launched with the tile, swap
and K split a CUDA-graph decode step of 32 sequences takes (``gguf_gemm``'s choices), for a
profiler to read (guide 08, "Two pipeline stages and splits by type up to 32 rows"):

    ncu --kernel-name regex:_gguf_gemm_kernel --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \\
        python bench/gguf_gemm_ncu.py Q4_0 [REPS]

Random weights quantized on the GPU (``tests/runtime/gguf_quantizer.py``); each shape runs REPS
times (default 3), so ``--launch-skip`` can pass the first (compiling) launches.
"""

from __future__ import annotations

import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "runtime"))

SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = 32


def main() -> None:
    from deepinfer.runtime.kernels.gguf_gemv import (
        choose_split_k,
        gemm_swapped,
        gemm_tile_for,
        gguf_gemm,
    )
    from deepinfer.runtime.kernels.gguf_layout import regroup
    from gguf_quantizer import quantize

    kinds = sys.argv[1].split(",") if len(sys.argv) > 1 else ["Q4_0"]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    for kind in kinds:
        for name, (n, k) in SHAPES.items():
            planes = regroup(quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.02, kind), kind)
            x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16)
            swap = gemm_swapped(kind, ROWS, capturing=True)  # as in a graph
            _, block_n, block_k, _, _ = gemm_tile_for(kind, ROWS, swap)
            split = choose_split_k(kind, triton.cdiv(n, block_n), ROWS,
                                   triton.cdiv(planes.codes.shape[1], block_k), sms)
            for _ in range(reps):
                gguf_gemm(x, planes, swap=swap, split_k=split)
            torch.cuda.synchronize()
            print(f"{kind} {name}: {ROWS} rows, swapped {swap}, tile {gemm_tile_for(kind, ROWS, swap)}, "
                  f"split {split}", flush=True)
            del planes


if __name__ == "__main__":
    main()
