"""Megatron-style sharded layers of the Llama-family model and the per-rank model built from them.

Rank r of N holds:

* the fused QKV and gate/up projections column-parallel: its q heads, kv heads and
  intermediate columns (the layer is an ordinary ``LlamaLayer`` built with the per-rank counts);
* the O and down projections row-parallel (``RowParallelLinear``): its input columns, with the
  partial outputs summed by an all-reduce;
* the embedding and the LM head vocabulary-parallel: rows ``r*V/N .. (r+1)*V/N``; an embedding
  lookup outside the shard gives zeros before the all-reduce, and the head's logit shards are
  all-gathered (every rank gets the full logits; only rank 0 samples).

The KV cache of each rank holds its kv heads only (``shard_config``), so it is 1/N of the whole.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.runtime.models.config import ModelConfig
from deepinfer.runtime.models.llama import LlamaForCausalLM, LlamaLayer
from deepinfer.runtime.parallel.process_group import TensorParallelGroup

# Hugging Face tensor name (suffix) -> the dimension split across ranks; names not listed are replicated.
_ROW_SHARDED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
                "mlp.gate_proj.weight", "mlp.up_proj.weight", "model.embed_tokens.weight", "lm_head.weight")
_COLUMN_SHARDED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def shard_dim(name: str) -> int | None:
    """The dimension of Hugging Face tensor ``name`` that is split across ranks (0: rows, 1:
    columns), or None when every rank holds all of it (norms)."""
    if name.endswith(_ROW_SHARDED):
        return 0
    if name.endswith(_COLUMN_SHARDED):
        return 1
    return None


def shard_range(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank ``rank``'s [start, stop) of a dimension of ``size`` split in ``world_size`` equal parts."""
    part = size // world_size
    return rank * part, (rank + 1) * part


def shard_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The per-rank shape: q heads, kv heads and intermediate size divided by N (the vocabulary
    keeps its full size here: token ids and the sampler see the whole vocabulary)."""
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // world_size,
                               num_key_value_heads=cfg.num_key_value_heads // world_size,
                               intermediate_size=cfg.intermediate_size // world_size)


class RowParallelLinear(nn.Linear):
    """A bias-free linear layer holding the rank's input columns; outputs are summed over ranks."""

    def __init__(self, in_features: int, out_features: int, group: TensorParallelGroup) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(F.linear(x, self.weight))


class VocabParallelEmbedding(nn.Embedding):
    """The rank's rows of the embedding table; ids of other ranks' rows look up zeros, then the
    ranks' results are summed (each id is found on exactly one rank)."""

    def __init__(self, num_local: int, dim: int, group: TensorParallelGroup) -> None:
        super().__init__(num_local, dim, _weight=torch.empty(num_local, dim))
        self.group = group
        self.start = group.rank * num_local

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(out)


class TensorParallelLlama(LlamaForCausalLM):
    """Rank ``group.rank``'s shard of a Llama-family model (see the module docstring). Built like
    ``LlamaForCausalLM`` (on the meta device, then materialized and loaded); its ``weight_slots``
    have the per-rank shapes, filled from ``sharded_loading``."""

    def __init__(self, cfg: ModelConfig, group: TensorParallelGroup, max_positions: int | None = None,
                 rope_freq_factors: torch.Tensor | None = None) -> None:
        n = group.world_size
        super().__init__(shard_config(cfg, n), max_positions, rope_freq_factors)
        self.group = group
        local_vocab = cfg.vocab_size // n
        self.embed_tokens = VocabParallelEmbedding(local_vocab, cfg.hidden_size, group)
        if self.lm_head is not None:
            self.lm_head = nn.Linear(cfg.hidden_size, local_vocab, bias=False)
        for module in self.layers:
            layer: LlamaLayer = module  # type: ignore[assignment]
            layer.o_proj = RowParallelLinear(layer.o_proj.in_features, cfg.hidden_size, group)
            layer.down_proj = RowParallelLinear(layer.down_proj.in_features, cfg.hidden_size, group)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last_dim(super().head_logits(hidden))
