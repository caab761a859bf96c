"""Build the runtime's model from a path (HF directory or GGUF file) or random "dummy" weights."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from deepinfer.runtime import switches
from deepinfer.runtime.kernels.gguf_blocks import Int4Groups
from deepinfer.runtime.models.config import ModelConfig
from deepinfer.runtime.models.llama import LlamaForCausalLM, LlamaLayer
from deepinfer.runtime.models.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from deepinfer.runtime.loading.gguf_loader import GGUFModel
    from deepinfer.runtime.parallel.process_group import TensorParallelGroup


@dataclass
class LoadedModel:
    """A model ready to run, with its configuration and where it came from."""

    model: LlamaForCausalLM
    config: ModelConfig  # the shape this process holds (per-rank head counts under tensor parallelism)
    path: str
    # The memory-mapped GGUF file of a model whose layers kept its quantization: the native CPU
    # decode path reads their blocks from it (models.native_decode).
    gguf: GGUFModel | None = None


def resolve_model_path(model: str | os.PathLike[str] | None) -> str:
    """The model path to load: the embedded default when ``model`` is None."""
    if model is None:
        from deepinfer.runtime.loading.default_model import default_model_path

        return default_model_path()
    path = os.fspath(model)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"model={path!r}: no such file or directory (expected a GGUF file or a Hugging Face "
            f"model directory; nothing is downloaded)")
    if os.path.isfile(path) and not path.lower().endswith(".gguf"):
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError(f"model={path!r}: a file that is not GGUF (no GGUF magic)")
    return path


def read_config(path: str) -> ModelConfig:
    """Only the architecture of the model at ``path`` (cheap: no weights are dequantized)."""
    if os.path.isdir(path):
        from deepinfer.runtime.loading.safetensors_loader import load_hf_config

        return load_hf_config(path)
    from deepinfer.runtime.loading.gguf_loader import gguf_config, open_gguf

    return gguf_config(open_gguf(path), path)


def load_model(path: str, *, device: torch.device, dtype: torch.dtype, dummy_weights: bool = False,
               max_positions: int | None = None, seed: int = 0, keep_quantized: bool = False,
               tensor_parallel: TensorParallelGroup | None = None) -> LoadedModel:
    """Load weights from ``path`` (or random ones of its shape) into a LlamaForCausalLM on ``device``.

    The model is built on the meta device and its parameters allocated on ``device`` in ``dtype``
    (uninitialised); weights are then read and copied one tensor at a time, so host memory stays
    about the model's size plus its largest tensor. With ``keep_quantized`` (GGUF files)
    projections stored as Q4_0/Q4_1/Q4_K/Q8_0 stay in that form on CPU (``models.quantized``),
    and those stored as Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K on CUDA (``models.gguf_linear``); other
    tensors are dequantized to ``dtype``.

    ``tensor_parallel`` of more than one rank: this rank's Megatron shard
    (``distributed.parallel_layers``), reading only its slices of the weights
    (``distributed.sharded_loading``); GGUF projections are then dequantized.
    """
    shard = tensor_parallel if tensor_parallel is not None and tensor_parallel.world_size > 1 else None
    gguf_model = None
    if os.path.isdir(path):
        from deepinfer.runtime.loading.safetensors_loader import load_hf_config

        config = load_hf_config(path)
    elif dummy_weights:
        config = read_config(path)
    else:
        from deepinfer.runtime.loading.gguf_loader import GGUFModel

        gguf_model = GGUFModel(path)
        config = gguf_model.config
    if keep_quantized and shard is not None:
        raise ValueError("keep_quantized: GGUF quantized layers do not run tensor-parallel; load with a dtype")
    if keep_quantized and device.type not in ("cpu", "cuda"):
        raise ValueError(f"keep_quantized: GGUF quantized layers run on CPU and CUDA only, got device {device}")
    freq_factors = None
    if gguf_model is not None:
        freq_factors = gguf_model.rope_freq_factors()  # shape and values checked
        if not dummy_weights:
            gguf_model.check_values()  # every tensor finite (block scales of quantized ones)
    if config.moe is not None and shard is not None:
        raise ValueError(f"architecture {config.architecture!r} (mixture of experts) runs on one rank only "
                         "(no tensor parallelism yet)")
    if config.moe is not None:
        keep_quantized = False  # MoE GGUF tensors are dequantized to dtype (no int4 experts yet)
    with torch.device("meta"):
        if shard is None:
            model = model_class(config)(config, max_positions=1, rope_freq_factors=freq_factors)
        else:
            from deepinfer.runtime.parallel.layers import TensorParallelLlama

            model = TensorParallelLlama(config, shard, max_positions=1, rope_freq_factors=freq_factors)
    # dense weights that decode steps will stream go on 2 MiB pages (not the int4 path's)
    materialize(model, device, dtype, huge_pages=device.type == "cpu" and not keep_quantized)
    if gguf_model is not None and config.moe is not None:
        from deepinfer.runtime.models.moe import MoeForCausalLM

        if isinstance(model, MoeForCausalLM):
            model.gguf_names = True  # the experts' slots take llama.cpp's stacked tensors
    with torch.no_grad():
        if dummy_weights:
            model.init_dummy_weights(seed)
        elif gguf_model is not None:
            if keep_quantized and device.type == "cuda":  # GGUF kernels on the GPU (models.gguf_linear)
                from deepinfer.runtime.loading.gguf_gpu_loader import keep_gguf_quantization_cuda

                keep_gguf_quantization_cuda(model, gguf_model, device, dtype)
            elif keep_quantized:
                keep_gguf_quantization(model, gguf_model)
            names = model.weight_slots().keys() & gguf_model.tensors.keys()
            if shard is None:
                model.load_weights(gguf_model.dense_tensors(names))
            else:
                from deepinfer.runtime.loading.sharded_loading import iter_gguf_shard

                model.load_weights(iter_gguf_shard(gguf_model, names, shard.rank, shard.world_size))
        elif shard is None:
            from deepinfer.runtime.loading.safetensors_loader import iter_safetensors

            model.load_weights(iter_safetensors(path))
        else:
            from deepinfer.runtime.loading.sharded_loading import iter_safetensors_shard

            model.load_weights(iter_safetensors_shard(path, shard.rank, shard.world_size))
    model.eval()
    if device.type == "cpu":
        # The native decode kernels (float32 models) read [out, in] rows; torch's few-row
        # matmuls are faster over [in, out] (see the method), which matters when torch runs
        # decode steps.
        if dtype != torch.float32 or not switches.native_cpu_decode_wanted():
            model.store_wide_projections_input_major()
        model.use_cpu_linears()
    # cos/sin tables are built on the device in float32: .to(dtype) would round them
    model.rotary = RotaryEmbedding(config.head_dim, max_positions or config.max_position_embeddings,
                                   config.rope_theta, config.rope_scaling, freq_factors).to(device)
    return LoadedModel(model=model, config=model.config, path=path,
                       gguf=gguf_model if keep_quantized and not dummy_weights else None)


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The single-process model class of ``config.architecture``."""
    if config.mla is not None:
        from deepinfer.runtime.models.deepseek_v2 import DeepseekV2ForCausalLM

        return DeepseekV2ForCausalLM
    if config.moe is not None:
        from deepinfer.runtime.models.moe import MoeForCausalLM

        return MoeForCausalLM
    return LlamaForCausalLM


def materialize(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, huge_pages: bool = False) -> None:
    """Give every meta parameter and buffer uninitialised storage on ``device`` (floating ones in
    ``dtype``). Does what ``to(dtype).to_empty(device)`` does, without the sympy import that
    ``to_empty`` triggers (0.3 s of CPU). ``huge_pages`` (CPU): the floating parameters share one
    mapping on 2 MiB pages where the OS allows (``host_arena``: decode steps stream them)."""
    slots = [(store, name, t, store is module._parameters) for module in model.modules()
             for store in (module._parameters, module._buffers) for name, t in store.items() if t is not None]
    in_arena = [i for i, (_, _, t, is_param) in enumerate(slots)
                if huge_pages and is_param and device.type == "cpu" and t.is_floating_point()]
    given: dict[int, torch.Tensor] = {}
    if in_arena:
        from deepinfer.runtime.loading.host_arena import host_arena_tensors

        arena = host_arena_tensors([slots[i][2].shape for i in in_arena], dtype)
        if arena is not None:
            given = dict(zip(in_arena, arena, strict=True))
    for i, (store, name, t, is_param) in enumerate(slots):
        empty = given.get(i)
        if empty is None:
            empty = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
        store[name] = torch.nn.Parameter(empty, requires_grad=False) if is_param else empty  # type: ignore[assignment]


def keep_gguf_quantization(model: LlamaForCausalLM, gguf_model: GGUFModel) -> None:
    """Replace the projections (and a Q8_0 embedding / output head) whose GGUF types have an int4
    form with quantized layers; the rest keep their dense parameters, loaded afterwards."""
    from deepinfer.runtime.models.quantized import (
        ROW_MULTIPLE,
        Int4Linear,
        Q8Embedding,
        int4_supported,
    )

    def quantized(names: list[str], bias_names: list[str] | None = None) -> Int4Linear | None:
        if any(n not in gguf_model.tensors for n in names):
            return None
        parts = [gguf_model.int4(n) for n in names]
        if any(p is None for p in parts) or len({len(p) for p in parts if p is not None}) != 1:
            return None  # a type without int4 form, or Q8_0 mixed with 4-bit types: keep dense
        fused = [Int4Groups(torch.cat([p[i].q for p in parts if p is not None]),
                            torch.cat([p[i].scale for p in parts if p is not None]),
                            torch.cat([p[i].zero for p in parts if p is not None]))
                 for i in range(len(parts[0] or []))]
        if not int4_supported(fused[0].q.shape[1]):
            return None
        bias = None
        if bias_names and all(n in gguf_model.tensors for n in bias_names):
            bias = torch.cat([gguf_model.dense(n) for n in bias_names])
        return Int4Linear(fused, bias)

    for i, module in enumerate(model.layers):
        layer = cast(LlamaLayer, module)
        p = f"model.layers.{i}."
        attn = [p + f"self_attn.{n}_proj." for n in "qkv"]
        qkv = quantized([a + "weight" for a in attn], [a + "bias" for a in attn] if layer.qkv_proj.bias is not None
                        else None)
        if qkv is not None:
            layer.qkv_proj = qkv  # type: ignore[assignment]  # same forward(x) interface
        for attr, names in (("o_proj", [p + "self_attn.o_proj.weight"]),
                            ("gate_up_proj", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                            ("down_proj", [p + "mlp.down_proj.weight"])):
            q = quantized(names)
            if q is not None:
                setattr(layer, attr, q)
    embed = "model.embed_tokens.weight"
    head = embed if model.lm_head is None else "lm_head.weight"
    model.quantized_head = quantized([head])
    if model.quantized_head is not None:
        model.lm_head = None
    codes = gguf_model.q8_codes(embed)
    if codes is not None:
        model.embed_tokens = Q8Embedding(*codes)  # type: ignore[assignment]  # same forward(ids)
    padded = [f"{name} ({m.out_features} -> {m.padded_rows} rows)" for name, m in model.named_modules()
              if isinstance(m, Int4Linear) and m.padded_rows != m.out_features]
    if padded:
        import logging

        logging.getLogger(__name__).info(
            "int4 path: %d layer(s) padded with zero rows to a multiple of %d (output sliced back): %s",
            len(padded), ROW_MULTIPLE, ", ".join(padded))
