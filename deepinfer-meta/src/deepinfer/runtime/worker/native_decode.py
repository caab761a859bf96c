"""The native CPU decode path: whole decode steps in ``deepinfer_engine._cpu_kernels``.

On CPU with a float32 KV cache, a step whose rows are all decode rows (one new token per
sequence) runs every layer in one native call: GEMVs over the GGUF file's own blocks (Q4_0,
Q4_1, Q8_0, the K-quants Q4_K/Q5_K/Q6_K as stored, Q5_0 widened to Q8_0's layout at load --
every type of a Q4_K_M file; activations quantized to 8 bits per 32 values as llama.cpp does)
or over the float32 parameters (``dtype="float32"``), fused RMSNorm, rotary,
SiLU·mul and paged attention over the runtime's KV cache layout, on a persistent pool of
``torch.get_num_threads()`` threads, without the GIL. Prefill and mixed steps stay on torch and
share the same KV cache. ``DEEPINFER_CPU_NATIVE=0`` turns the path off (torch for every step).

With ``LLM(deterministic=True)`` every step runs here (``NativeDecode.step``): a prompt chunk is
one row per token, each row computed alone by the same kernels as a decode row, so a sequence's
logits and KV entries do not depend on which other rows share its steps (batch invariance).
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from torch import nn

from deepinfer.runtime import switches
from deepinfer.runtime.models.llama import LlamaForCausalLM, LlamaLayer

if TYPE_CHECKING:
    from deepinfer.runtime.loading.gguf_loader import GGUFModel

ENV_SWITCH = "DEEPINFER_CPU_NATIVE"
NATIVE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
WeightSpec = tuple[str, np.ndarray]


class Unsupported(Exception):
    """The model has a part the native path does not run (the reason is the message)."""


# Prompt and mixed steps of up to this many token rows run natively where native_prompt_rows says so.
# On a 2-core AVX2 machine (2026-12-03, default model, 2 threads) a 64-token prompt ran at 230 prompt
# tok/s natively against 115 through torch's int4 kernel; at 512 tokens 174 against 312.
NATIVE_PROMPT_ROWS = 128


def native_prompt_rows(model: nn.Module) -> int:
    """How many token rows a prompt or mixed step may have to run on the native kernels (0: such
    steps run on torch): with ``DEEPINFER_CPU_NATIVE_PROMPTS=1`` (opt-in), ``NATIVE_PROMPT_ROWS``
    when the model's projections are the file's int4 blocks (``models.quantized.Int4Linear``) and
    torch's CPU kernels run below AVX-512 (where its int4 kernel costs ~2x the native int8 dots on
    short prompts). Not the default: 8-bit prompt activations move near ties, and on the default
    model they turned the first token of the README's chat answer ("The" by 0.125 on torch's
    path) into "L" by 0.41."""
    from deepinfer.runtime.models.quantized import Int4Linear, dense_from_rows

    if not switches.enabled("DEEPINFER_CPU_NATIVE_PROMPTS") or dense_from_rows() is not None:
        return 0
    return NATIVE_PROMPT_ROWS if any(isinstance(m, Int4Linear) for m in model.modules()) else 0


class NativeDecode:
    """A registered ``_cpu_kernels.DecodeModel``; calling it runs one decode-only step."""

    def __init__(self, native: Any, kind: str, parts: dict[str, collections.Counter[str]] | None = None) -> None:
        self.native = native
        self.kind = kind  # "quantized" or "float32"
        # {tensor kind ("q/k/v", "mlp down", ...): {GGUF type or "F32": registered weights}}
        self.parts = dict(parts or {})

    @property
    def weight_types(self) -> dict[str, int]:
        """{GGUF type or "F32": registered weights of it} (embedding, head, every projection)."""
        total: collections.Counter[str] = collections.Counter()
        for c in self.parts.values():
            total.update(c)
        return dict(total)

    def __call__(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
                 seq_lens: np.ndarray, block_tables: np.ndarray) -> torch.Tensor:
        rows = len(input_ids)
        logits = self.native.decode(
            np.ascontiguousarray(input_ids, dtype=np.int64), np.ascontiguousarray(positions, dtype=np.int64),
            np.ascontiguousarray(slot_mapping, dtype=np.int64), np.ascontiguousarray(seq_lens[:rows], dtype=np.int64),
            np.ascontiguousarray(block_tables[:rows], dtype=np.int64))
        return torch.from_numpy(logits)


    def step(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
             query_start_loc: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray,
             logits_indices: np.ndarray) -> torch.Tensor:
        """Logits [len(logits_indices), vocab] of any step in the runner's var-len layout (prompt
        chunks, decode rows, both): token row i of sequence s attends over its position + 1 keys,
        ``seq_lens[s] - (query_start_loc[s + 1] - 1 - i)``, through sequence s's block table.
        Rows past ``query_start_loc[-1]`` (padding) are not run."""
        qsl = np.asarray(query_start_loc, dtype=np.int64)
        num_seqs = len(qsl) - 1
        rows = int(qsl[-1])
        counts = np.diff(qsl)
        seq_of_row = np.repeat(np.arange(num_seqs, dtype=np.int64), counts)
        row_lens = np.asarray(seq_lens[:num_seqs], dtype=np.int64)[seq_of_row] - (qsl[1:][seq_of_row] - 1
                                                                                - np.arange(rows, dtype=np.int64))
        picked = np.ascontiguousarray(logits_indices, dtype=np.int64)
        logits = self.native.decode(
            np.ascontiguousarray(input_ids[:rows], dtype=np.int64),
            np.ascontiguousarray(positions[:rows], dtype=np.int64),
            np.ascontiguousarray(slot_mapping[:rows], dtype=np.int64), row_lens,
            np.ascontiguousarray(block_tables[:num_seqs], dtype=np.int64),
            table_rows=seq_of_row, logit_rows=picked)
        return torch.from_numpy(logits)


def _f32(t: torch.Tensor) -> np.ndarray:
    if t.dtype != torch.float32:
        raise Unsupported(f"a {t.dtype} parameter (the native path runs float32 or GGUF blocks)")
    return t.detach().contiguous().numpy()


class _Weights:
    """Where each projection's weight comes from: the GGUF file's blocks (quantized layers) or the
    float32 parameter."""

    def __init__(self, model: LlamaForCausalLM, gguf: GGUFModel | None) -> None:
        self.model, self.gguf = model, gguf

    def gguf_blocks(self, name: str) -> WeightSpec:
        from deepinfer.runtime.kernels import gguf_blocks

        if self.gguf is None or name not in self.gguf.tensors:
            raise Unsupported(f"{name}: quantized layer without its GGUF tensor")
        t = self.gguf.tensors[name]
        kind = t.tensor_type.name
        if kind not in NATIVE_TYPES or len(t.shape) != 2:
            raise Unsupported(f"{name}: GGUF type {kind} (native kernels: {', '.join(NATIVE_TYPES)})")
        rows = int(t.shape[1])
        raw = gguf_blocks.raw_blocks(t.data, rows).numpy()
        index = self.gguf.row_index(name, rows)  # llama.cpp's q/k row permutation, undone
        return kind, (raw if index is None else np.ascontiguousarray(raw[index.numpy()]))

    def native_in_file(self, names: list[str]) -> bool:
        """Whether every one of ``names`` is a 2-D tensor of the GGUF file in a native type (the
        kernels then read the file's blocks, whatever layer the torch model holds for prefill)."""
        if self.gguf is None:
            return False
        ts = [self.gguf.tensors.get(n) for n in names]
        return all(t is not None and t.tensor_type.name in NATIVE_TYPES and len(t.shape) == 2 for t in ts)

    def linear(self, module: nn.Module, names: list[str], rows: list[slice]) -> list[WeightSpec]:
        from deepinfer.runtime.models.quantized import Int4Linear

        if isinstance(module, Int4Linear) or self.native_in_file(names):
            return [self.gguf_blocks(n) for n in names]
        if isinstance(module, nn.Linear):
            w = _f32(module.weight)
            return [("F32", np.ascontiguousarray(w[r])) for r in rows]
        raise Unsupported(f"{names[0]}: layer type {type(module).__name__}")


def build_native_decode(model: LlamaForCausalLM, gguf: GGUFModel | None, kv_caches: list[torch.Tensor],
                        num_threads: int | None = None) -> NativeDecode | None:
    """Register ``model`` (and its KV caches) with the native decode kernels; None when the path
    is switched off, not built, or the model has a part it does not run."""
    return build_native_decode_explained(model, gguf, kv_caches, num_threads)[0]


def build_native_decode_explained(model: LlamaForCausalLM, gguf: GGUFModel | None, kv_caches: list[torch.Tensor],
                                  num_threads: int | None = None) -> tuple[NativeDecode | None, str]:
    """``build_native_decode`` and, when it gives None, why (else "")."""
    if not switches.native_cpu_decode_wanted():
        return None, (f"the native CPU kernels are switched off ({ENV_SWITCH}=0) or not in this engine wheel "
                      "(no deepinfer_engine._cpu_kernels)")
    try:
        return _build(model, gguf, kv_caches, num_threads or torch.get_num_threads()), ""
    except Unsupported as exc:
        return None, str(exc)


def _build(model: LlamaForCausalLM, gguf: GGUFModel | None, kv_caches: list[torch.Tensor],
           num_threads: int) -> NativeDecode:
    from deepinfer_engine import _cpu_kernels

    from deepinfer.runtime.models.quantized import Int4Linear, Q8Embedding

    cfg = model.config
    if any(c.dtype != torch.float32 or c.device.type != "cpu" for c in kv_caches):
        raise Unsupported("the KV cache is not float32 on CPU")
    if type(model) is not LlamaForCausalLM:
        # a tensor-parallel shard: its projections all-reduce across ranks, which the kernels don't
        raise Unsupported(f"{type(model).__name__} is not the single-process model")
    if any(cast(LlamaLayer, layer).q_norm is not None for layer in model.layers):
        raise Unsupported("per-head q/k norms (Qwen3) are not in the native kernels")
    native = _cpu_kernels.DecodeModel(cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
                                      cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                      cfg.vocab_size, cfg.rms_norm_eps, num_threads=num_threads)
    weights = _Weights(model, gguf)
    parts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    embed_name = "model.embed_tokens.weight"
    if isinstance(model.embed_tokens, Q8Embedding) or weights.native_in_file([embed_name]):
        embedding = weights.gguf_blocks(embed_name)
    else:
        embedding = ("F32", _f32(model.embed_tokens.weight))
    native.set_embedding(embedding)
    parts["embedding"][embedding[0]] += 1
    head_name = embed_name if model.config.tie_word_embeddings else "lm_head.weight"
    if isinstance(model.quantized_head, Int4Linear) or weights.native_in_file([head_name]):
        head = weights.gguf_blocks(head_name)
    else:
        head = ("F32", _f32(model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight))
    native.set_output(_f32(model.norm.weight), head)
    parts["lm head"][head[0]] += 1
    native.set_rotary(_f32(model.rotary.cos), _f32(model.rotary.sin))
    quantized = head[0] != "F32"
    for i, module in enumerate(model.layers):
        layer = cast(LlamaLayer, module)
        p = f"model.layers.{i}."
        q, kv = layer.split[0], layer.split[1]
        m = layer.intermediate_size
        qkv = weights.linear(layer.qkv_proj, [p + f"self_attn.{n}_proj.weight" for n in "qkv"],
                             [slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv)])
        o = weights.linear(layer.o_proj, [p + "self_attn.o_proj.weight"], [slice(None)])
        gate_up = weights.linear(layer.gate_up_proj, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                                 [slice(0, m), slice(m, 2 * m)])
        down = weights.linear(layer.down_proj, [p + "mlp.down_proj.weight"], [slice(None)])
        bias = getattr(layer.qkv_proj, "bias", None)
        quantized = quantized or any(spec[0] != "F32" for spec in qkv + o + gate_up + down)
        for part, specs in (("q/k/v", qkv), ("attn o", o), ("mlp gate/up", gate_up), ("mlp down", down)):
            parts[part].update(spec[0] for spec in specs)
        native.set_layer(i, _f32(layer.input_layernorm.weight), qkv[0], qkv[1], qkv[2], o[0],
                         _f32(layer.post_attention_layernorm.weight), gate_up[0], gate_up[1], down[0],
                         None if bias is None else _f32(bias), kv_caches[i].numpy())
    return NativeDecode(native, "quantized" if quantized else "float32", dict(parts))


def kernel_paths(model: nn.Module | None, native: NativeDecode | None) -> list[str]:
    """Per tensor kind, what really runs: the weight types and the decode-step kernels (native, with
    its instruction set, or torch: ``models.describe``), then the torch layer of prefill / mixed
    steps; the activation dtype last. One line each."""
    from deepinfer.runtime.models.describe import activation_dtype, describe_model

    if model is None:
        return []
    described = describe_model(model)
    parts = {"embedding": "embedding", "q/k/v": "qkv", "attn o": "o", "mlp gate/up": "gate_up", "mlp down": "down",
             "lm head": "lm_head"}
    table: dict[str, str] = {}
    if native is not None:
        from deepinfer_engine import _cpu_kernels

        table = dict(_cpu_kernels.weight_kernels(str(native.native.isa)))
    lines = []
    for part, kind in parts.items():
        prefill = ", ".join(sorted({f"{path} [{wt}]" for wt, path, _ in described[kind]})) or "-"
        if native is None or part not in native.parts:
            lines.append(f"{part}: decode and prefill {prefill}")
            continue
        types = native.parts[part]
        if part == "embedding":
            lines.append(f"{part}: decode native {', '.join(sorted(types))} rows, dequantized on lookup; "
                         f"prefill {prefill}")
            continue
        kernels = []
        for t in sorted(types):
            where = f"{table.get(t, '?')} kernels"
            act = "float32 activations" if t == "F32" else "int8 activations per 32"
            kernels.append(f"{t} x{types[t]} ({where}, {act})")
        lines.append(f"{part}: decode native {', '.join(kernels)}; prefill {prefill}")
    lines.append(f"activations: {activation_dtype(model)}")
    return lines
