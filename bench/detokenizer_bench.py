"""Incremental detokenizer: microseconds per streamed token, tokenizers' DecodeStream vs the
Python window it replaced (kept as the fallback), interleaved in one run on the default model's
tokenizer (byte-level BPE) with English, CJK and emoji text.

    python bench/detokenizer_bench.py [--tokens 2000] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from deepinfer.runtime.engine.detokenizer import IncrementalDetokenizer
from deepinfer.runtime.loading.default_model import default_model_path
from deepinfer.runtime.loading.tokenizer_loader import load_tokenizer


class PythonWindow(IncrementalDetokenizer):
    """The fallback path: the decode window in Python."""

    def _decode_stream(self, ctx: list[int]) -> Any:
        return None


def per_token_us(cls: type[IncrementalDetokenizer], tok: Any, prompt: list[int], ids: list[int]) -> float:
    t = time.perf_counter()
    d = cls(tok, prompt)
    for x in ids:
        d.append([x])
        d.take_delta()
    d.append([], final=True)
    return (time.perf_counter() - t) / len(ids) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    tok = load_tokenizer(default_model_path())
    text = "The quick brown fox 這是一個測試 🙂 jumps over the lazy dog. " * 100
    ids = tok.encode(text, add_special_tokens=False)[:args.tokens]
    prompt = tok.encode("Say something:", add_special_tokens=False)
    best = {"DecodeStream": float("inf"), "Python window": float("inf")}
    for _ in range(args.repeats):  # interleaved: both see the same machine load
        best["DecodeStream"] = min(best["DecodeStream"], per_token_us(IncrementalDetokenizer, tok, prompt, ids))
        best["Python window"] = min(best["Python window"], per_token_us(PythonWindow, tok, prompt, ids))
    for name, us in best.items():
        print(f"{name:14s} {us:7.2f} us/token")
    print(f"ratio {best['Python window'] / best['DecodeStream']:.1f}x, {len(ids)} tokens, "
          f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
