"""Run a bench script with GGUF kernel choices overridden from the environment, read at each call.

``bench/decode_profile.py --variants`` sets environment variables between captures; this wrapper
turns them into the choices the runtime makes itself, so a sweep or an A/B of a choice against
the one before it runs in one process, side by side (guide 08 reports such runs):

  X_DP4A_<N>x<K>="rows,block_k,warps,stages"   the one-row dp4a GEMV's tile of an [N, K] weight
                                               (``kernels.gguf_gemv.dp4a_config``)
  X_ARGMAX_SPAN=<n>                            ``kernels.gemv.argmax_partials``' first-pass span
                                               (a huge value: one pass, as before 2026-12-06)
  X_PER_PART_QUANT=1                           a projection of several GGUF types quantizes its
                                               row once per part (as before 2026-12-06)
  X_GEMM_MASKS=1                               the GEMM keeps its weight masks where it would
                                               drop them (``kernels.gguf_gemv.unmasked_tiles``;
                                               as before 2026-12-06)

    python bench/gguf_overrides.py bench/decode_profile.py --shape llama3-8b --batch 1 \\
        --weights q4_0 --variants "gu 1w:X_DP4A_28672x4096=4,512,1,2|again:"

A malformed value is a ValueError naming the variable. Nothing here is read by the runtime itself.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Callable
from typing import Any


def dp4a_tile(n: int, k: int) -> tuple[int, int, int, int] | None:
    """``X_DP4A_<n>x<k>`` as (rows, block_k, warps, stages), or None when unset."""
    name = f"X_DP4A_{n}x{k}"
    spec = os.environ.get(name)
    if not spec:
        return None
    try:
        tile = tuple(int(v) for v in spec.split(","))
    except ValueError:
        tile = ()
    if len(tile) != 4 or min(tile) < 1:
        raise ValueError(f"{name} must be four positive integers rows,block_k,warps,stages, got {spec!r}")
    return tile  # type: ignore[return-value]


def argmax_span() -> int | None:
    """``X_ARGMAX_SPAN``, or None when unset."""
    spec = os.environ.get("X_ARGMAX_SPAN")
    if not spec:
        return None
    if not spec.isdigit() or int(spec) < 1:
        raise ValueError(f"X_ARGMAX_SPAN must be a positive integer, got {spec!r}")
    return int(spec)


def install() -> Callable[[], None]:
    """Wrap the runtime's choices so that the variables above override them; returns the undo."""
    from deepinfer.runtime.kernels import gemv, gguf_gemv
    from deepinfer.runtime.models import gguf_linear

    own_tile = gguf_gemv.dp4a_config

    def dp4a_config(w: Any) -> tuple[int, int, int, int]:
        return dp4a_tile(w.n, w.k) or own_tile(w)

    own_partials = gemv.argmax_partials

    def argmax_partials(maxes: Any, args: Any, out: Any, **kw: Any) -> Any:
        span = argmax_span()
        if span is not None:
            kw["span"] = span
        return own_partials(maxes, args, out, **kw)

    own_gemv = gguf_linear.GGUFLinearCUDA.gemv

    def per_part_gemv(self: Any, x: Any, **kw: Any) -> Any:
        if os.environ.get("X_PER_PART_QUANT") != "1" or kw.get("quantized") is not None:
            return own_gemv(self, x, **kw)
        import torch

        return self.gemv_parts(x, torch.empty((1, self.out_features), dtype=x.dtype, device=x.device), **kw)

    own_unmasked = gguf_gemv.unmasked_tiles

    def unmasked_tiles(w: Any, block_n: int, block_k: int) -> bool:
        return os.environ.get("X_GEMM_MASKS") != "1" and own_unmasked(w, block_n, block_k)

    gguf_gemv.dp4a_config = dp4a_config
    gemv.argmax_partials = argmax_partials
    gguf_linear.GGUFLinearCUDA.gemv = per_part_gemv  # type: ignore[method-assign]
    gguf_gemv.unmasked_tiles = unmasked_tiles

    def undo() -> None:
        gguf_gemv.dp4a_config = own_tile
        gemv.argmax_partials = own_partials
        gguf_linear.GGUFLinearCUDA.gemv = own_gemv  # type: ignore[method-assign]
        gguf_gemv.unmasked_tiles = own_unmasked

    return undo


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python bench/gguf_overrides.py SCRIPT [ARGS...]")
    install()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
