"""Whole-weight decoding ahead of time for ``DEEPINFER_GGUF_DENSE_ROWS`` (small models' many-row products).

A GGUF product of many rows may decode its whole weight and multiply with cuBLAS
(``kernels.gguf_gemv.dense_weight``). Decoded in line, each decode is a small launch the product
waits for: on SmolLM2-135M at 256 rows, 121 of them cost a fifth of the step (guide 08). A
``DenseChain`` links a model's GGUF projections in the order a forward pass calls them (layer by
layer: qkv, o, gate/up, down) and gives them two decode buffers in turn. When projection i
multiplies, projection i + 1's weight is already being decoded into the other buffer on a side
stream, so the decodes overlap the products, the attention and the norms.

Ordering, on the device: the side stream's decode of i + 1 is forked from the main stream after i's
weight is ready and before i's product is launched, so it waits for everything enqueued before it,
product i - 1 (the last reader of that buffer) included, and runs beside product i; projection
i + 1 waits for it before its product. A projection called out of the chain's order still gets its own
weight (decoded in line, after any decode still pending for its buffer). The last projection of the
chain prefetches nothing, so a forward pass leaves no side-stream work behind (a CUDA graph capture
must join it); ``join`` waits for any that a partial pass left. On a CPU (Triton's interpreter) the
same bookkeeping runs with every decode done at once, so a wrong buffer turn gives wrong products.
"""

from __future__ import annotations

from typing import Protocol

import torch

from deepinfer.runtime.kernels.gguf_layout import GGUFPlanes


class DenseProjection(Protocol):
    """What the chain needs of a projection (``GGUFLinearCUDA``, which imports this module)."""

    in_features: int
    out_features: int
    parts: list[GGUFPlanes]
    dense_chain: DenseChain | None

    def decode_dense(self, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor: ...


Pending = tuple[int, torch.dtype, "torch.cuda.Event | None"]  # a decode started ahead: (index, dtype, event)


class DenseChain:
    """Two decode buffers, taken in turn by ``layers`` (projections in call order)."""

    def __init__(self, layers: list[DenseProjection]) -> None:
        if len({id(layer) for layer in layers}) != len(layers):
            raise ValueError("DenseChain: a projection appears twice in the chain")
        self.layers = layers
        self._index = {id(layer): i for i, layer in enumerate(layers)}
        self._numel = max((layer.out_features * layer.in_features for layer in layers), default=0)
        self._buffers: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}
        self._side: dict[torch.device, torch.cuda.Stream] = {}
        # buffer slot -> (layer index, dtype, the side stream's "decoded" event; None on a CPU)
        self._pending: dict[int, Pending] = {}
        self.decoded_ahead = 0  # weights a product found decoded ahead (for tests and benchmarks)

    def weight(self, layer: DenseProjection, dtype: torch.dtype) -> torch.Tensor:
        """``layer``'s whole weight [N, K] in ``dtype``, valid on the current stream until the chain's
        next-but-one ``weight`` call; starts decoding the next projection's weight."""
        i = self._index[id(layer)]
        slot = i % 2
        out = self._buffer(layer, dtype, slot)
        main = torch.cuda.current_stream(out.device) if out.device.type == "cuda" else None
        pending = self._take(slot, main)  # this weight decoded ahead, or a stale one
        if pending is not None and pending[:2] == (i, dtype):
            self.decoded_ahead += 1
        else:
            layer.decode_dense(dtype, out=out)
        if i + 1 < len(self.layers):
            self._decode_ahead(i + 1, dtype, main)
        return out

    def join(self) -> None:
        """The current stream waits for every decode still pending (none after a whole pass)."""
        for _i, _dtype, event in self._pending.values():
            if event is not None:
                torch.cuda.current_stream().wait_event(event)
        self._pending.clear()

    def _decode_ahead(self, j: int, dtype: torch.dtype, main: torch.cuda.Stream | None) -> None:
        layer, slot = self.layers[j], j % 2
        out = self._buffer(layer, dtype, slot)
        self._take(slot, main)  # a stale decode there (a capture must join every side-stream op)
        if main is None:  # a CPU: decode now, in the turn a GPU would
            layer.decode_dense(dtype, out=out)
            self._pending[slot] = (j, dtype, None)
            return
        side = self._side.get(out.device)
        if side is None:
            side = self._side[out.device] = torch.cuda.Stream(out.device)
        side.wait_stream(main)  # fork: after the last product that read this buffer (enqueued) is done
        with torch.cuda.stream(side):
            layer.decode_dense(dtype, out=out)
        ready = torch.cuda.Event()
        ready.record(side)
        self._pending[slot] = (j, dtype, ready)

    def _take(self, slot: int, main: torch.cuda.Stream | None) -> Pending | None:
        """The decode pending for ``slot`` (or None), removed, with ``main`` made to wait for it."""
        pending = self._pending.pop(slot, None)
        if pending is not None and pending[2] is not None and main is not None:
            main.wait_event(pending[2])
        return pending

    def _buffer(self, layer: DenseProjection, dtype: torch.dtype, slot: int) -> torch.Tensor:
        device = layer.parts[0].codes.device
        key = (device, dtype, slot)
        buf = self._buffers.get(key)
        if buf is None:  # sized for the chain's largest weight; lives as long as the model
            buf = self._buffers[key] = torch.empty(self._numel, dtype=dtype, device=device)
        return buf[:layer.out_features * layer.in_features].view(layer.out_features, layer.in_features)


def chain_projections(layers: list[DenseProjection]) -> DenseChain:
    """Link ``layers`` (in the order a forward pass calls them) into one ``DenseChain``."""
    chain = DenseChain(layers)
    for layer in layers:
        layer.dense_chain = chain
    return chain
