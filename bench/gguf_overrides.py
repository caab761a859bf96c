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
  X_GEMM_TILE_FEW_ROWS="bm,bn,bk,warps,stages"  the GEMM's tile up to 32 rows, plain and swapped,
  X_GEMM_TILE_SWAP_FEW_ROWS="..."               for every type (``GEMM_CONFIG_FEW_ROWS``,
                                               ``GEMM_CONFIG_SWAP_FEW_ROWS[_BY_KIND]``); read once
  X_GEMM_SPLITS_<KIND>="narrow,wide"            ``choose_split_k``'s splits of that type up to 32
                                               rows (``SPLIT_K_FEW_ROWS``); read once, at start
  X_GEMM_TILE="bm,bn,bk,warps,stages"           the GEMM's tile above 32 rows, plain and swapped
  X_GEMM_TILE_SWAP="..."                        (``GEMM_CONFIG``, ``GEMM_CONFIG_SWAP[_BY_KIND]``:
                                               the swapped one for every type); read once

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


def integers(name: str, spec: str, names: str) -> tuple[int, ...]:
    """``spec`` (the value of variable ``name``) as positive integers, as many as ``names`` (e.g.
    "rows,block_k,warps,stages") lists; else a ValueError naming the variable."""
    want = len(names.split(","))
    try:
        values = tuple(int(v) for v in spec.split(","))
    except ValueError:
        values = ()
    if len(values) != want or min(values) < 1:
        count = {2: "two", 4: "four", 5: "five"}.get(want, str(want))
        raise ValueError(f"{name} must be {count} positive integers {names}, got {spec!r}")
    return values


def dp4a_tile(n: int, k: int) -> tuple[int, int, int, int] | None:
    """``X_DP4A_<n>x<k>`` as (rows, block_k, warps, stages), or None when unset."""
    name = f"X_DP4A_{n}x{k}"
    spec = os.environ.get(name)
    return integers(name, spec, "rows,block_k,warps,stages") if spec else None  # type: ignore[return-value]


# X_GEMM_TILE_* variable -> the ``kernels.gguf_gemv`` default tile it replaces
GEMM_TILE_VARIABLES = {"X_GEMM_TILE_FEW_ROWS": "GEMM_CONFIG_FEW_ROWS",
                       "X_GEMM_TILE_SWAP_FEW_ROWS": "GEMM_CONFIG_SWAP_FEW_ROWS",
                       "X_GEMM_TILE": "GEMM_CONFIG", "X_GEMM_TILE_SWAP": "GEMM_CONFIG_SWAP"}
# ... and the per-type exceptions to that tile, which such a variable clears
PER_TYPE_TILES = {"X_GEMM_TILE_SWAP_FEW_ROWS": "GEMM_CONFIG_SWAP_FEW_ROWS_BY_KIND",
                  "X_GEMM_TILE_SWAP": "GEMM_CONFIG_SWAP_BY_KIND"}


def gemm_tile(name: str) -> tuple[int, int, int, int, int] | None:
    """``name`` (an ``X_GEMM_TILE_*`` variable) as (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), or None."""
    spec = os.environ.get(name)
    return integers(name, spec, "bm,bn,bk,warps,stages") if spec else None  # type: ignore[return-value]


def few_rows_splits() -> dict[str, tuple[int, int]]:
    """The ``X_GEMM_SPLITS_<KIND>`` variables set, as {kind: (narrow, wide)}."""
    return {name.removeprefix("X_GEMM_SPLITS_"): integers(name, spec, "narrow,wide")  # type: ignore[misc]
            for name, spec in os.environ.items() if name.startswith("X_GEMM_SPLITS_")}


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

    own_tables = {name: getattr(gguf_gemv, name) for name in (*GEMM_TILE_VARIABLES.values(),
                                                               *PER_TYPE_TILES.values(), "SPLIT_K_FEW_ROWS")}
    for variable, name in GEMM_TILE_VARIABLES.items():
        tile = gemm_tile(variable)
        if tile:
            setattr(gguf_gemv, name, tile)
            if variable in PER_TYPE_TILES:  # every type's: the per-type table's exceptions go too
                setattr(gguf_gemv, PER_TYPE_TILES[variable], {})
    gguf_gemv.SPLIT_K_FEW_ROWS = {**gguf_gemv.SPLIT_K_FEW_ROWS, **few_rows_splits()}
    gguf_gemv.dp4a_config = dp4a_config
    gemv.argmax_partials = argmax_partials
    gguf_linear.GGUFLinearCUDA.gemv = per_part_gemv  # type: ignore[method-assign]
    gguf_gemv.unmasked_tiles = unmasked_tiles

    def undo() -> None:
        gguf_gemv.dp4a_config = own_tile
        gemv.argmax_partials = own_partials
        gguf_linear.GGUFLinearCUDA.gemv = own_gemv  # type: ignore[method-assign]
        gguf_gemv.unmasked_tiles = own_unmasked
        for name, value in own_tables.items():
            setattr(gguf_gemv, name, value)

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
