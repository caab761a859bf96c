"""Incremental detokenizer: microseconds per streamed token, tokenizers' DecodeStream vs the
Python window it replaced (kept as the fallback), interleaved in one run on the default model's
tokenizer (byte-level BPE) with English, CJK and emoji text.

    python bench/detokenizer_bench.py [--tokens 2000] [--repeats 20]
    python bench/detokenizer_bench.py --long 65536   # one long stream, us/token per eighth of it

``--long N`` streams N tokens through one detokenizer as a front end does (``append_delta``) and
prints the cost per token in each eighth of the stream: flat when a token costs the same late in
a long completion as early (the text's pieces, not a string copied whole per token). It then
feeds the same deltas to a tool-call parser (``serve.tool_parsers``, hermes format: content until
a ``<tool_call>`` that never comes), which also keeps the whole text, per eighth likewise.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from deepinfer.runtime.engine.detokenizer import IncrementalDetokenizer
from deepinfer.runtime.loading.default_model import default_model_path
from deepinfer.runtime.loading.tokenizer_loader import load_tokenizer
from deepinfer.serve.tool_parsers import ToolCallParser


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
    ap.add_argument("--long", type=int, default=0, help="one stream of this many tokens, cost per eighth")
    args = ap.parse_args()
    tok = load_tokenizer(default_model_path())
    if args.long:
        long_stream(tok, args.long)
        return
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


def long_stream(tok: Any, n: int) -> None:
    text = "The quick brown fox 這是一個測試 🙂 jumps over the lazy dog. " * 100
    unit = tok.encode(text, add_special_tokens=False)
    ids = (unit * (n // len(unit) + 1))[:n]
    d = IncrementalDetokenizer(tok, tok.encode("Say something:", add_special_tokens=False))
    eighth = max(1, n // 8)
    costs, deltas = [], []
    t = time.perf_counter()
    for i, x in enumerate(ids, 1):
        deltas.append(d.append_delta([x]))
        if i % eighth == 0:
            now = time.perf_counter()
            costs.append((now - t) / eighth * 1e6)
            t = now
    print(f"{n} tokens ({len(d.text)} characters), us/token per eighth: {', '.join(f'{c:.2f}' for c in costs)}")
    parser, costs = ToolCallParser("hermes"), []
    t = time.perf_counter()
    for i, delta in enumerate(deltas, 1):
        parser.feed(delta)
        if i % eighth == 0:
            now = time.perf_counter()
            costs.append((now - t) / eighth * 1e6)
            t = now
    print(f"tool-call parser (hermes) fed the same deltas, us/token per eighth: {', '.join(f'{c:.2f}' for c in costs)}")


if __name__ == "__main__":
    main()
