"""Whether ``quantization=...`` can run for a model on a device: checked before any weight is read
(the quantizing itself is ``models/fp8_linear.py``'s ``quantize_model``)."""

from __future__ import annotations

import os

import torch

from deepinfer.runtime.models.fp8_linear import MIN_CAPABILITY, SUPPORTED_METHODS


def check_quantization(method: str | None, device: torch.device, model_path: str | None = None,
                       tensor_parallel_size: int = 1, dtype: torch.dtype = torch.bfloat16) -> None:
    """ValueError when ``quantization=method`` cannot run here: "gguf" for a file that is not GGUF
    or several tensor-parallel ranks; for "fp8": an unknown method, a device
    without FP8 (CPU, a GPU below compute capability 8.9), a GGUF file that is already quantized,
    several tensor-parallel ranks, or float32 activations."""
    if method is None:
        return
    if method == "gguf":  # keep a GGUF file's blocks (worker.keeps_gguf_quantization)
        if model_path is None or not os.path.isfile(model_path):
            raise ValueError(f"quantization='gguf' keeps a GGUF file's quantized blocks; {model_path!r} is not a "
                             "GGUF file (use quantization='fp8' or None for a checkpoint directory)")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"quantization='gguf' runs on cpu or cuda, not {device.type}")
        if tensor_parallel_size > 1:
            raise ValueError("quantization='gguf' runs on one rank only (no tensor-parallel GGUF layers yet); "
                             "use tensor_parallel_size=1, or leave quantization unset (the file is dequantized)")
        return
    if method not in SUPPORTED_METHODS:
        raise ValueError(f"quantization={method!r} is not supported; supported methods: "
                         f"{[*SUPPORTED_METHODS, 'gguf']}")
    if model_path is not None:
        quantized = _gguf_quantized_types(model_path)
        if quantized:
            raise ValueError(f"quantization='fp8': the file is already quantized: {', '.join(quantized)} "
                             f"({model_path}); run it without quantization, or give a bf16/fp16 checkpoint")
    need = f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}"
    if device.type != "cuda":
        raise ValueError(f"quantization='fp8' needs a CUDA GPU with compute capability >= {need}; "
                         f"this device is {device.type}")
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        raise ValueError(f"quantization='fp8' needs a CUDA GPU with compute capability >= {need}; "
                         f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}")
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"quantization='fp8' runs bfloat16/float16 activations, got dtype {dtype}")
    if tensor_parallel_size > 1:
        raise ValueError("quantization='fp8' runs on one rank only (no tensor-parallel fp8 layers yet); "
                         "use tensor_parallel_size=1")


def _gguf_quantized_types(path: str) -> list[str]:
    """The quantized tensor types of a GGUF file (sorted; empty for a directory or an F32/F16/BF16 file)."""
    if os.path.isdir(path) or not os.path.isfile(path):
        return []
    from deepinfer.runtime.loading.gguf_loader import open_gguf

    reader = open_gguf(path)
    plain = {"F32", "F16", "BF16", "F64"}
    return sorted({t.tensor_type.name for t in reader.tensors} - plain)
