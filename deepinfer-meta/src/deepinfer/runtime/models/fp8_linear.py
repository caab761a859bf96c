"""FP8 weight-only linear layers (``quantization="fp8"``, vLLM's name for the same option).

A bf16/fp16 projection is quantized once at load to float8_e4m3fn with one float32 scale per
output channel (row amax / 448, so each row's largest weight maps to E4M3's largest finite value;
an all-zero row keeps scale 1). Activations stay in the model dtype: the kernels widen the 1-byte
weights in registers (``kernels/fp8_gemv.py``), so a decode step streams half the bytes of bf16.

Only the decoder layers' projections are quantized (qkv, o, gate/up, down); the embedding and the
LM head stay in the model dtype, as vLLM's fp8 option leaves them. ``DEEPINFER_FP8_LM_HEAD=1``
(experimental) quantizes the LM head too, as ``model.quantized_head`` (a tied head gets its own
fp8 copy; the embedding lookup keeps the table).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.runtime import switches
from deepinfer.runtime.kernels.shared_linear import SharedLinear

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SUPPORTED_METHODS = ("fp8",)
MIN_CAPABILITY = (8, 9)  # Ada / Hopper: E4M3 conversions and FP8 tensor cores (loading/quantization.py checks)
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 codes [N, K], float32 scales [N]) of ``weight`` [N, K]: ``codes.float() * scale[:, None]``
    approximates it. Values are divided by the row's scale, saturated to +-448 (a plain cast would
    give NaN past it) and rounded to nearest even. ValueError for non-finite weights."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_fp8: weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    w = weight.float()
    amax = w.abs().amax(dim=1)
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("quantization='fp8': the weight has non-finite values (inf/NaN); it cannot be scaled")
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale.contiguous()


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight the codes stand for, ``codes * scale`` per row, in ``dtype``."""
    return (codes.float() * scale[:, None]).to(dtype)


class Fp8Linear(nn.Module):
    """``y = x @ (codes * scale).T (+ bias)`` with E4M3 codes [N, K] and float32 scales [N].

    CUDA: one row through ``fp8_gemv``; several through ``gemm_path(rows)``: the weight-only
    Triton ``fp8_gemm`` for few rows, FP8 activations and ``torch._scaled_mm`` from
    ``SCALED_MM_MIN_ROWS`` (``DEEPINFER_FP8_GEMM`` forces one). Elsewhere (tests: no FP8 kernels on
    CPU) the weight is dequantized per call and multiplied by ``F.linear``, which gives the same
    values up to the summation order."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None
    weight_type = "fp8_e4m3 per-channel"
    fused_silu_out = True  # fused_gemv(silu_out=True): models/llama_fused_decode._dense_mlp

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 projection: str | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.projection = projection  # "qkv", "o", "gate_up", "down": picks the one-row tile
        self.register_buffer("weight", codes.contiguous())
        self.register_buffer("weight_scale", scale.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear, projection: str | None = None) -> Fp8Linear:
        codes, scale = quantize_fp8(linear.weight.detach())
        return cls(codes, scale, None if linear.bias is None else linear.bias.detach(), projection)

    @property
    def kernel_path(self) -> str:
        if self.weight.device.type != "cuda":
            return "dequantize + torch matmul (CPU emulation)"
        from deepinfer.runtime.kernels.fp8_gemv import one_row_math

        forced = _forced_path()
        if forced != "auto":
            many = PATH_NAMES[forced]
        else:
            many = ", ".join(f"{PATH_NAMES[path]} from {rows} rows" for rows, path in AUTO_PATHS)
        return f"Triton fp8 GEMV (1 row, fused, {one_row_math()} math) / {many}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.weight.device.type != "cuda":
            y = F.linear(x2, dequantize_fp8(self.weight, self.weight_scale, x.dtype), self.bias)
        elif x2.shape[0] == 1 and x2.stride(1) == 1:
            from deepinfer.runtime.kernels.fp8_gemv import fp8_gemv

            y = fp8_gemv(x2, self.weight, self.weight_scale, self.bias)
        else:
            from deepinfer.runtime.kernels.fp8_act import fp8_scaled_mm, fp8_w8a8_gemm
            from deepinfer.runtime.kernels.fp8_gemv import fp8_gemm

            x2 = x2.contiguous()
            path = gemm_path(x2.shape[0])
            if path == "scaled_mm" and (self.in_features % 16 or self.out_features % 16):
                path = "w8a8"  # cuBLASLt's FP8 GEMM needs both dimensions divisible by 16
            kernel = {"triton": fp8_gemm, "w8a8": fp8_w8a8_gemm, "scaled_mm": fp8_scaled_mm}[path]
            y = kernel(x2, self.weight, self.weight_scale, self.bias)
        return y.reshape(*lead, self.out_features)

    def fused_gemv(self, x: torch.Tensor, *, norm: tuple[torch.Tensor, float] | None = None,
                   residual: torch.Tensor | None = None, silu_mul: bool = False,
                   silu_out: bool = False) -> torch.Tensor:
        """The one-row product with ``kernels.gemv.gemv``'s fusions (the decode graphs' batch-1 path);
        ``silu_out`` (a gate/up projection): SiLU(gate)·up of the product (``fp8_gemv``)."""
        from deepinfer.runtime.kernels.fp8_gemv import fp8_gemv

        return fp8_gemv(x, self.weight, self.weight_scale, self.bias, norm=norm, residual=residual, silu_mul=silu_mul,
                        projection=self.projection, silu_out=silu_out)


# The several-row kernel by row count, (from this many rows, path), picked on the H200
# (bench/fp8_sweep.py --part gemm, Llama-3-8B shapes): the Triton fp8 x fp8 GEMM was the fastest
# fp8 path at 2-32 rows, torch._scaled_mm at 128 and 512 (the weight-only GEMM at none).
SCALED_MM_MIN_ROWS = 64
AUTO_PATHS = ((2, "w8a8"), (SCALED_MM_MIN_ROWS, "scaled_mm"))
GEMM_PATHS = ("auto", "triton", "w8a8", "scaled_mm")
PATH_NAMES = {"triton": "Triton fp8 GEMM (weight-only)", "w8a8": "Triton fp8 x fp8 GEMM (FP8 activations per row)",
              "scaled_mm": "torch._scaled_mm (FP8 activations per row)"}


def _forced_path() -> str:
    return switches.choice("DEEPINFER_FP8_GEMM", GEMM_PATHS)


def gemm_path(rows: int) -> str:
    """The several-row kernel of an fp8 layer for ``rows`` rows: "triton" (weight-only, bf16
    activations), "w8a8" or "scaled_mm" (per-row FP8 activations, FP8 tensor cores)."""
    forced = _forced_path()
    if forced != "auto":
        return forced
    path = AUTO_PATHS[0][1]
    for first, p in AUTO_PATHS:
        if rows >= first:
            path = p
    return path


@torch.no_grad()
def quantize_model(model: nn.Module, method: str) -> int:
    """Replace every plain linear projection of the decoder layers by an ``Fp8Linear``
    (one layer at a time: the bf16 weights of a layer are freed as the next is quantized), and the
    LM head under ``DEEPINFER_FP8_LM_HEAD=1``. Returns how many were replaced."""
    from deepinfer.runtime.models.llama import LlamaForCausalLM

    if method not in SUPPORTED_METHODS:
        raise ValueError(f"quantization={method!r} is not supported; supported methods: {list(SUPPORTED_METHODS)}")
    if type(model) is not LlamaForCausalLM:  # experts and MLA keep other layers: they would stay bf16 unsaid
        raise ValueError(f"quantization={method!r} runs the dense Llama family only, not {type(model).__name__}")
    count = 0
    for layer in cast(nn.ModuleList, getattr(model, "layers", nn.ModuleList())):
        for name in PROJECTIONS:
            linear = getattr(layer, name, None)
            # plain layers and their re-dispatching views (CpuLinear); not tensor-parallel ones
            if type(linear) is nn.Linear or isinstance(linear, SharedLinear):
                setattr(layer, name, Fp8Linear.from_linear(linear, name.removesuffix("_proj")))
                count += 1
    if switches.enabled("DEEPINFER_FP8_LM_HEAD") and quantize_head(model):
        count += 1
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the freed bf16 weights go back to the device: the KV cache is sized next
    return count


def quantize_head(model: nn.Module) -> bool:
    """Make ``model``'s LM head an ``Fp8Linear`` (``model.quantized_head``, which ``head_logits``
    runs): the untied ``lm_head``'s weight, freed, or a copy of a tied embedding's. False where the
    head is not a plain layer (tensor-parallel shards) or is quantized already."""
    lm_head = getattr(model, "lm_head", None)
    source = lm_head if lm_head is not None else getattr(model, "embed_tokens", None)
    if getattr(model, "quantized_head", None) is not None or type(source) not in (nn.Linear, nn.Embedding):
        return False  # (tensor-parallel heads and quantized tables are other types: left alone)
    weight = cast(nn.Linear, source).weight  # [vocab, hidden], an nn.Embedding's too
    model.quantized_head = Fp8Linear(*quantize_fp8(weight.detach()), projection=None)  # type: ignore[assignment]
    model.lm_head = None  # type: ignore[assignment]  # (a tied model's was None: the table stays)
    return True
