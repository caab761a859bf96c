"""A linear layer whose weight stays in a GGUF file's block quantization on a CUDA device.

``GGUFLinearCUDA`` holds the weight as ``kernels.gguf_layout`` planes (regrouped once at load) and
runs ``kernels.gguf_gemv``: the one-row GEMV for a single row (decode of one sequence; the fused
decode forward also uses its RMSNorm / residual / SiLU·mul fusions), the GEMM that decodes weight
tiles in registers for more rows. A fused projection whose parts a file stores in different types
(Q4_K_M: q and k in Q4_K, v in Q6_K) holds one part per run of equal types, each writing its
slice of the output. No host syncs and fixed shapes: it runs inside the decode CUDA graphs.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from deepinfer.runtime.kernels.gguf_layout import GGUFPlanes, cat_rows
from deepinfer.runtime.models.gguf_dense_chain import DenseChain, DenseProjection, chain_projections


def merge_runs(parts: list[GGUFPlanes]) -> list[GGUFPlanes]:
    """Adjacent parts of the same type stacked into one (fewer launches)."""
    runs: list[list[GGUFPlanes]] = []
    for p in parts:
        if runs and runs[-1][0].kind == p.kind:
            runs[-1].append(p)
        else:
            runs.append([p])
    return [r[0] if len(r) == 1 else cat_rows(r) for r in runs]


class GGUFLinearCUDA(nn.Module):
    """``y = x @ W.T (+ bias)`` with W [N, K] stored as GGUF-quantized planes (one or more row runs)."""

    bias: torch.Tensor | None

    def __init__(self, parts: list[GGUFPlanes], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if not parts or any(p.k != parts[0].k for p in parts):
            raise ValueError(f"GGUFLinearCUDA: one or more parts of one width, got widths {[p.k for p in parts]}")
        parts = merge_runs(parts)
        k = parts[0].k
        self.parts = parts
        self.in_features, self.out_features = k, sum(p.n for p in parts)
        self.offsets = [sum(p.n for p in parts[:i]) for i in range(len(parts))]
        for i, p in enumerate(parts):  # buffers: .to()/state_dict see the planes
            for name, t in p.tensors().items():
                self.register_buffer(f"part{i}_{name}", t, persistent=False)
        self.register_buffer("bias", bias)
        kinds = sorted({p.kind for p in parts}, key=[p.kind for p in parts].index)
        self.weight_type = "+".join(kinds)
        # DEEPINFER_GGUF_DENSE_ROWS: the model's projections in call order, decoding ahead (gguf_dense_chain)
        self.dense_chain: DenseChain | None = None
        # the hidden size DEEPINFER_GGUF_DENSE_ROWS=auto goes by (``dense_rows``): its own width until
        # chain_model gives it its model's (None: a model auto was not measured on)
        self.model_hidden_size: int | None = k

    @property
    def kernel_path(self) -> str:  # models/describe.py: what `deepinfer env` and `deepinfer bench` print
        from deepinfer.runtime.kernels.gguf_gemv import (
            BF16_CODE_KINDS,
            dense_rows,
            gemm_decode,
            one_row_path,
        )
        from deepinfer.runtime.kernels.gguf_mmq import mmq_rows

        rows = mmq_rows()
        few = f" / int8 tensor-core mmq, 8-bit activations (2-{rows} rows)" if rows > 1 else ""
        kinds = self.weight_type.split("+")
        bf16 = [k for k in kinds if k in BF16_CODE_KINDS] if gemm_decode() == "bf16" else []
        decode = "" if not bf16 else ", bf16 decode" if len(bf16) == len(kinds) else f", bf16 decode of {'+'.join(bf16)}"
        dense = dense_rows(self.model_hidden_size)
        if dense > 0:
            return (f"triton gguf {one_row_path()} (one row){few} / gemm{decode} (below {dense} rows) / "
                    f"decoded weight + cuBLAS ({dense} rows or more)")
        return f"triton gguf {one_row_path()} (one row){few} / gemm{decode} (more rows)"

    def _sync_parts(self) -> None:
        # after .to()/.cuda() the buffers are new tensors: point the planes at them
        self.parts = [p.with_tensors({name: cast(torch.Tensor, self._buffers[f"part{i}_{name}"]) for name in p.tensors()})
                      for i, p in enumerate(self.parts)]

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def, override]
        out = super()._apply(fn, recurse)
        self._sync_parts()
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight_type={self.weight_type}"

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)

    def decode_dense(self, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """The whole weight [N, K] in ``dtype``: every part decoded into its rows (of ``out``)."""
        from deepinfer.runtime.kernels.gguf_gemv import dense_weight

        if out is None:
            out = torch.empty((self.out_features, self.in_features), dtype=dtype, device=self.parts[0].codes.device)
        for p, off in zip(self.parts, self.offsets, strict=True):
            dense_weight(p, dtype, out=out[off:off + p.n])
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from deepinfer.runtime.kernels.gguf_gemv import dense_rows, gguf_gemm
        from deepinfer.runtime.kernels.gguf_mmq import (
            gguf_mmq,
            mmq_rows,
            mmq_supports,
            quantize_rows,
        )

        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if x2.shape[0] == 1:
            return self.gemv(x2).reshape(*lead, self.out_features)
        # a few rows on a GPU: activations quantized once, int8 tensor cores (kernels/gguf_mmq.py)
        mmq = (x.device.type == "cuda" and x2.shape[0] <= mmq_rows() and x.dtype != torch.float32
               and all(mmq_supports(p) for p in self.parts))
        if not mmq and 0 < dense_rows(self.model_hidden_size) <= x2.shape[0]:  # DEEPINFER_GGUF_DENSE_ROWS
            # the whole weight (decoded ahead by the model's chain, or now), then one cuBLAS product
            if self.dense_chain is not None:
                dense = self.dense_chain.weight(self, x.dtype)
            else:
                dense = self.decode_dense(x.dtype)
            return torch.nn.functional.linear(x2, dense, self.bias).reshape(*lead, self.out_features)
        out = torch.empty((x2.shape[0], self.out_features), dtype=x.dtype, device=x.device)
        xq = quantize_rows(x2) if mmq else None
        for p, off in zip(self.parts, self.offsets, strict=True):
            b = None if self.bias is None else self.bias[off:off + p.n]
            part_out = out if len(self.parts) == 1 else out[:, off:off + p.n]
            if xq is not None:
                gguf_mmq(xq, p, b, out=part_out)
            else:
                gguf_gemm(x2, p, b, out=part_out)
        return out.reshape(*lead, self.out_features)

    def gemv(self, x: torch.Tensor, *, silu_mul: bool = False, norm: tuple[torch.Tensor, float] | None = None,
             residual: torch.Tensor | None = None,
             quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One row [1, K] (``[1, 2K]`` with ``silu_mul``) -> [1, N], with ``kernels.gemv``'s fusions;
        ``quantized``: x already as 8-bit activations (``kernels.gguf_gemv.gguf_gemv``). Parts of
        several types share one quantization of the row (with its RMSNorm / SiLU·mul) under the dp4a
        GEMV, where each part's GEMV would make the same codes again (Q4_K_M's qkv: Q4_K q and k, Q6_K v)."""
        from deepinfer.runtime.kernels.gemv import check_one_row
        from deepinfer.runtime.kernels.gguf_gemv import dp4a_gemv, quantize_activations, word_codes

        out = torch.empty((1, self.out_features), dtype=x.dtype, device=x.device)
        if len(self.parts) > 1 and quantized is None and word_codes() and dp4a_gemv():
            k = self.in_features  # (checked here: the quantization kernel trusts its caller)
            check_one_row("GGUFLinearCUDA.gemv", x, self.out_features, k, f"the {self.weight_type} weight",
                          silu_mul=silu_mul, bias=self.bias, norm=norm, residual=residual)
            if x.device != self.parts[0].codes.device or (norm is not None and norm[0].device != x.device):
                raise ValueError(f"GGUFLinearCUDA.gemv: x is on {x.device}, the weight on {self.parts[0].codes.device}"
                                 + ("" if norm is None else f", the norm weight on {norm[0].device}"))
            quantized = quantize_activations(x, k, silu_mul, norm, rounding=out)
            x, silu_mul, norm = x[:, :k], False, None  # (the parts read the codes, not x)
        return self.gemv_parts(x, out, silu_mul=silu_mul, norm=norm, residual=residual, quantized=quantized)

    def gemv_parts(self, x: torch.Tensor, out: torch.Tensor, *, silu_mul: bool = False,
                   norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None,
                   quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``gemv`` part by part into ``out`` [1, N]: one ``gguf_gemv`` a part, each on its slice (with
        ``quantized`` None, each dp4a part quantizes the row itself)."""
        from deepinfer.runtime.kernels.gguf_gemv import gguf_gemv

        for p, off in zip(self.parts, self.offsets, strict=True):
            sl = slice(off, off + p.n)
            gguf_gemv(x, p, None if self.bias is None else self.bias[sl], silu_mul=silu_mul, norm=norm,
                      residual=None if residual is None else residual[:, sl], out=out[:, sl], quantized=quantized)
        return out


def chain_model(model: nn.Module) -> DenseChain:
    """Chain a Llama-family model's GGUF projections layer by layer, in call order: qkv, o, gate/up,
    down (``gguf_dense_chain``, for ``DEEPINFER_GGUF_DENSE_ROWS``). The head is left out: a prompt
    step multiplies only its last rows, often too few for that path. The chain carries the model's
    hidden size (layer 0's qkv width) for the ``auto`` rule only where every layer's MLP is a GGUF
    projection, the dense models it was measured on; a mixture of experts' attention keeps the GEMM
    unless the rows are given. A GGUF head (``model.quantized_head``, set before this is called)
    goes by the same hidden size (each layer's ``model_hidden_size``)."""
    layers = cast(nn.ModuleList, model.layers)
    projections = [getattr(layer, name, None) for layer in layers
                   for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
    chained = [p for p in projections if isinstance(p, GGUFLinearCUDA)]
    dense = len(layers) > 0 and all(isinstance(getattr(layer, name, None), GGUFLinearCUDA)
                                    for layer in layers for name in ("gate_up_proj", "down_proj"))
    hidden = chained[0].in_features if dense and chained else None
    head = getattr(model, "quantized_head", None)
    for p in chained + ([head] if isinstance(head, GGUFLinearCUDA) else []):
        p.model_hidden_size = hidden
    return chain_projections(cast(list[DenseProjection], chained))
