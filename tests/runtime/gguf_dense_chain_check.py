"""Test helper: ``models.gguf_dense_chain`` (DEEPINFER_GGUF_DENSE_ROWS' weights decoded ahead)
against a float64 matmul of ``gguf.quants``' dequantization.

``python gguf_dense_chain_check.py DEVICE``: on CPU run it with ``TRITON_INTERPRET=1``. Four GGUF
projections in a chain (one of two types), fed one into the next as a forward pass does, at 5 rows
with ``DEEPINFER_GGUF_DENSE_ROWS=2``:

* each product matches the reference within the GEMM bound of ``gguf_gpu_check.py`` (bf16
  weights and activations, float32 sums: ``2**-7 * mag + 2**-8 * |ref|``), over two passes;
* every projection after the first found its weight decoded ahead (three a pass), and the last
  one left nothing pending; the two buffers alternate, so a wrong turn multiplies by the wrong
  weight and fails the bound;
* called out of order (the third, then the first, second and fourth), each still gets its own
  weight;
* on CUDA, a pass captured in a CUDA graph (which fails if a side-stream decode is left unjoined)
  and replayed on new rows gives the eager pass's outputs exactly.

Prints one line per case and exits non-zero on a mismatch.
"""

from __future__ import annotations

import os
import sys

import torch
from deepinfer.runtime.kernels.gguf_layout import regroup
from deepinfer.runtime.models.gguf_dense_chain import chain_projections
from deepinfer.runtime.models.gguf_linear import GGUFLinearCUDA
from gguf_gpu_check import _check, random_blocks, reference_weight

# (rows, K, types): 256 -> 512 -> 256 -> 768 (Q4_1 + Q8_0) -> 256
SHAPES = [(512, 256, ["Q4_0"]), (256, 512, ["Q4_K"]), (768, 256, ["Q4_1", "Q8_0"]), (256, 768, ["Q6_K"])]


def build(device: str) -> tuple[list[GGUFLinearCUDA], list[torch.Tensor]]:
    layers, refs = [], []
    for i, (n, k, kinds) in enumerate(SHAPES):
        rows = [n // len(kinds)] * len(kinds)
        raws = [random_blocks(kind, r, k, seed=70 + 10 * i + j) for j, (kind, r) in enumerate(zip(kinds, rows))]
        layers.append(GGUFLinearCUDA([regroup(torch.from_numpy(raw), kind) for raw, kind in zip(raws, kinds)])
                      .to(device))
        refs.append(torch.cat([reference_weight(raw, kind, r) for raw, kind, r in zip(raws, kinds, rows)]))
    return layers, refs


def run_pass(layers: list[GGUFLinearCUDA], x: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each projection's (input, output): the next input is the output scaled to at most 1 (no host
    sync: a fixed factor of the reference bound's size, so it also runs inside a capture)."""
    inputs, outs = [x], []
    for layer in layers:
        outs.append(layer(inputs[-1]))
        inputs.append(outs[-1] / 64)
    return inputs[:-1], outs


def check_pass(name: str, layers: list[GGUFLinearCUDA], refs: list[torch.Tensor], inputs: list[torch.Tensor],
               outs: list[torch.Tensor]) -> bool:
    ok = True
    for i, (inp, out, w) in enumerate(zip(inputs, outs, refs)):
        a = inp.double().cpu()
        ok &= _check(f"{name}: projection {i} ({layers[i].weight_type})", out, a @ w.T, a.abs() @ w.abs().T,
                     2**-7, 2**-8)
    return ok


def main() -> int:
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    os.environ["DEEPINFER_GGUF_DENSE_ROWS"] = "2"
    bf = torch.bfloat16
    layers, refs = build(device)
    chain = chain_projections(layers)
    g = torch.Generator().manual_seed(5)
    ok = True
    for p in range(2):
        x = torch.randn(5, SHAPES[0][1], generator=g).to(bf).to(device)
        before = chain.decoded_ahead
        ok &= check_pass(f"pass {p}", layers, refs, *run_pass(layers, x))
        ahead, left = chain.decoded_ahead - before, len(chain._pending)
        good = ahead == len(layers) - 1 and left == 0
        print(f"{'ok  ' if good else 'FAIL'} pass {p}: {ahead} weights decoded ahead, {left} left pending")
        ok &= good
    # out of order: the third projection first (it decodes the fourth ahead), then the rest
    order = [2, 0, 1, 3]
    xs = {i: torch.randn(5, layers[i].in_features, generator=g).to(bf).to(device) for i in order}
    for i in order:
        out = layers[i](xs[i])
        a = xs[i].double().cpu()
        ok &= _check(f"out of order: projection {i}", out, a @ refs[i].T, a.abs() @ refs[i].abs().T, 2**-7, 2**-8)
    chain.join()
    if device == "cuda":
        x = torch.randn(5, SHAPES[0][1], generator=g).to(bf).to(device)
        static = x.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run_pass(layers, static)  # warm-up outside the capture, as the graph runners do
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run_pass(layers, static)
        static.copy_(x)
        graph.replay()
        eager = run_pass(layers, x)
        torch.cuda.synchronize()
        same = all(torch.equal(c, e) for c, e in zip(captured[1], eager[1]))
        print(f"{'ok  ' if same else 'FAIL'} a pass captured in a CUDA graph and replayed equals the eager pass")
        ok &= same and check_pass("graph replay", layers, refs, *captured)
    print("ok" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
