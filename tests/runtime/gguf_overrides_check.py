"""``bench/gguf_overrides.py`` on the runtime (Triton's interpreter on the CPU, or a GPU): each
variable changes the choice it names and nothing else.

``python gguf_overrides_check.py [cpu|cuda]``; prints ``ok`` last."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import gguf_overrides
from deepinfer.runtime.kernels import gemv, gguf_gemv
from deepinfer.runtime.kernels.gguf_layout import regroup
from deepinfer.runtime.models.gguf_linear import GGUFLinearCUDA
from gguf_gpu_check import random_blocks
from gguf_gpu_model_check import counted_quantizations, spied_launches


def main() -> None:
    dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cpu")
    parts = [regroup(torch.from_numpy(random_blocks(kind, 8, 256, seed=i)), kind).map(lambda t: t.to(dev))
             for i, kind in enumerate(("Q4_0", "Q8_0"))]
    layer = GGUFLinearCUDA(parts)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 256, generator=g).to(dev)
    nw = (1 + 0.1 * torch.randn(256, generator=g)).to(dev)
    undo = gguf_overrides.install()
    try:
        # X_PER_PART_QUANT=1: one quantization a part, the same bits as the shared one
        with counted_quantizations(DEEPINFER_GGUF_DP4A="1") as launches:
            shared = layer.gemv(x, norm=(nw, 1e-5))
            assert len(launches) == 1, launches
            launches.clear()
            os.environ["X_PER_PART_QUANT"] = "1"
            try:
                each = layer.gemv(x, norm=(nw, 1e-5))
            finally:
                del os.environ["X_PER_PART_QUANT"]
            assert len(launches) == 2 and torch.equal(each, shared), len(launches)
        # X_DP4A_<N>x<K>: that shape's tile, the others' unchanged
        default = gguf_gemv.dp4a_config(parts[0])
        os.environ["X_DP4A_8x256"] = "2,512,1,3"
        try:
            assert gguf_gemv.dp4a_config(parts[0]) == (2, 512, 1, 3)
            os.environ["X_DP4A_8x256"] = "2,512"
            try:
                gguf_gemv.dp4a_config(parts[0])
                raise AssertionError("a tile of two values was taken")
            except ValueError as err:
                assert "X_DP4A_8x256" in str(err), err
        finally:
            del os.environ["X_DP4A_8x256"]
        assert gguf_gemv.dp4a_config(parts[0]) == default
        # X_ARGMAX_SPAN: the span argmax_partials gets (the answer is the same)
        maxes = torch.randn(100, generator=g).to(dev)
        args = torch.arange(100, device=dev, dtype=torch.int64)
        out = torch.empty(1, dtype=torch.int64, device=dev)
        seen: list[int] = []
        with spied_launches(gemv, "_argmax_partials_kernel", lambda grid, kw: seen.append(grid[0])):
            os.environ["X_ARGMAX_SPAN"] = "16"
            try:
                assert int(gemv.argmax_partials(maxes, args, out)) == int(maxes.argmax())
            finally:
                del os.environ["X_ARGMAX_SPAN"]
            assert seen == [7, 1], seen  # 100 partials in slices of 16, then their 7 results
            seen.clear()
            assert int(gemv.argmax_partials(maxes, args, out)) == int(maxes.argmax())
            assert seen == [1], seen  # the default span (2,048) holds them all
        # X_GEMM_MASKS=1: the GEMM keeps its weight masks where its tiles divide the weight; same bits
        even = regroup(torch.from_numpy(random_blocks("Q4_0", 32, 256, seed=5)), "Q4_0").map(lambda t: t.to(dev))
        xm = torch.randn(3, 256, generator=g).to(dev, torch.bfloat16)
        flags: list[bool] = []
        with spied_launches(gguf_gemv, "_gguf_gemm_kernel", lambda grid, kw: flags.append(bool(kw["EVEN"]))):
            unmasked = gguf_gemv.gguf_gemm(xm, even, config=(16, 16, 32, 4, 2), split_k=1)
            os.environ["X_GEMM_MASKS"] = "1"
            try:
                masked = gguf_gemv.gguf_gemm(xm, even, config=(16, 16, 32, 4, 2), split_k=1)
            finally:
                del os.environ["X_GEMM_MASKS"]
        assert flags == [True, False] and torch.equal(unmasked, masked), flags
    finally:
        undo()
    assert gguf_gemv.dp4a_config.__module__ == gguf_gemv.unmasked_tiles.__module__ == gguf_gemv.__name__  # undone
    # X_GEMM_TILE_SWAP_FEW_ROWS / X_GEMM_SPLITS_<KIND>, read at install: the swapped tile of every
    # type up to 32 rows and that type's splits; the same product; all put back by the undo
    own = (gguf_gemv.GEMM_CONFIG_SWAP_FEW_ROWS_BY_KIND, gguf_gemv.SPLIT_K_FEW_ROWS, gguf_gemv.GEMM_CONFIG_SWAP,
           gguf_gemv.GEMM_CONFIG_SWAP_BY_KIND)
    variables = {"X_GEMM_TILE_SWAP_FEW_ROWS": "16,16,32,4,2", "X_GEMM_SPLITS_Q4_0": "4,2",
                 "X_GEMM_TILE_SWAP": "64,32,64,4,2"}
    os.environ.update(variables)
    try:
        undo = gguf_overrides.install()
    finally:
        for name in variables:
            del os.environ[name]
    try:
        assert gguf_gemv.gemm_tile_for("Q4_0", 33, True) == (64, 32, 64, 4, 2)  # X_GEMM_TILE_SWAP: above 32 rows
        assert gguf_gemv.gemm_tile_for("Q8_0", 33, True) == (64, 32, 64, 4, 2)  # ... of Q8_0 too
        assert gguf_gemv.GEMM_CONFIG_SWAP_FEW_ROWS == (16, 16, 32, 4, 2)
        assert gguf_gemv.gemm_tile_for("Q4_0", 20, True) == gguf_gemv.gemm_tile_for("Q4_K", 3, True) == (16, 16, 32, 4, 2)
        assert gguf_gemv.choose_split_k("Q4_0", 448, 32, 16, 132) == 2  # the table's 1 overridden
        assert gguf_gemv.choose_split_k("Q4_K", 448, 32, 16, 132) == 3  # the others' kept
        blocks: list[tuple[int, int, int]] = []
        with spied_launches(gguf_gemv, "_gguf_gemm_kernel",
                            lambda grid, kw: blocks.append((kw["BLOCK_N"], kw["BLOCK_K"], kw["num_stages"]))):
            swapped = gguf_gemv.gguf_gemm(xm, even, swap=True, split_k=1)
        assert blocks == [(16, 32, 2)], blocks
    finally:
        undo()
    assert (gguf_gemv.GEMM_CONFIG_SWAP_FEW_ROWS_BY_KIND, gguf_gemv.SPLIT_K_FEW_ROWS, gguf_gemv.GEMM_CONFIG_SWAP,
            gguf_gemv.GEMM_CONFIG_SWAP_BY_KIND) == own
    assert torch.equal(swapped, gguf_gemv.gguf_gemm(xm, even, swap=True, split_k=1))
    print("ok")


if __name__ == "__main__":
    main()
