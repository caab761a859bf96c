"""Read only one rank's slices of a model's weights (safetensors slices, GGUF block rows).

* safetensors: ``safe_open(...).get_slice(name)[a:b]`` (rows) or ``[:, a:b]`` (columns) reads
  just those bytes of the memory-mapped file; replicated tensors (norms) are read whole.
* GGUF: quantization blocks run along a row, so a row shard is a contiguous byte range of the
  mapped tensor, dequantized alone. A column shard (O and down projections) takes the same
  byte columns of every row when the shard's width is a whole number of blocks (32 weights for
  Q4_0/Q4_1/Q8_0, 256 for K-quants); otherwise the rank dequantizes whole rows and keeps its
  columns (it reads the full tensor, one tensor at a time). llama.cpp's rotary permutation of
  Q/K rows stays inside each head, so it is undone on the rank's heads alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import torch

from deepinfer.runtime.kernels import gguf_blocks
from deepinfer.runtime.loading.gguf_file import TensorInfo
from deepinfer.runtime.loading.gguf_loader import GGUFError, GGUFModel, unpermute_index
from deepinfer.runtime.loading.safetensors_loader import safetensors_files
from deepinfer.runtime.parallel.layers import shard_dim, shard_range


def iter_safetensors_shard(model_dir: str, rank: int, world_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, rank ``rank``'s slice of the tensor) one at a time."""
    from safetensors import safe_open

    for f in safetensors_files(model_dir):
        try:
            with safe_open(f, framework="pt", device="cpu") as st:
                for name in st.keys():
                    dim = shard_dim(name)
                    if dim is None:
                        yield name, st.get_tensor(name)
                        continue
                    part = st.get_slice(name)
                    a, b = shard_range(int(part.get_shape()[dim]), rank, world_size)
                    yield name, part[a:b] if dim == 0 else part[:, a:b]
        except Exception as exc:  # safetensors raises its own SafetensorError, OSError, ...
            raise ValueError(f"model: cannot read safetensors file {f!r}: {exc}") from exc


def gguf_shard(model: GGUFModel, name: str, rank: int, world_size: int) -> torch.Tensor:
    """Float32 rank ``rank``'s slice of GGUF tensor ``name`` in the Hugging Face layout."""
    dim = shard_dim(name)
    t = model.tensors[name]
    if dim is None or len(t.shape) != 2:
        w = model.dense(name)  # replicated, or a 1-D bias (small)
        if dim is None:
            return w
        a, b = shard_range(w.shape[0], rank, world_size)
        return w[a:b]
    from gguf.constants import GGML_QUANT_SIZES

    cols, rows = int(t.shape[0]), int(t.shape[1])  # GGUF order: innermost first
    block, block_bytes = GGML_QUANT_SIZES[t.tensor_type]
    raw = np.asarray(t.data).reshape(rows, -1)
    try:
        if dim == 0:
            a, b = shard_range(rows, rank, world_size)
            w = gguf_blocks.dequantize(TensorInfo(t.name, (cols, b - a), t.tensor_type, raw[a:b].reshape(-1)))
            heads = {"q_proj": model.config.num_attention_heads, "k_proj": model.config.num_key_value_heads}
            kind = name.rsplit(".", 2)[-2]
            if model.config.architecture == "llama" and kind in heads:
                w = w[unpermute_index(b - a, heads[kind] // world_size)]
            return w
        a, b = shard_range(cols, rank, world_size)
        if a % block or b % block:
            return model.dense(name)[:, a:b]
        part = np.ascontiguousarray(raw[:, a // block * block_bytes:b // block * block_bytes]).reshape(-1)
        return gguf_blocks.dequantize(TensorInfo(t.name, (b - a, rows), t.tensor_type, part))
    except GGUFError:
        raise
    except Exception as exc:
        raise model.load_error(name, exc) from exc


def iter_gguf_shard(model: GGUFModel, names: Iterable[str], rank: int,
                    world_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 slice) one at a time for ``names``."""
    for name in names:
        yield name, gguf_shard(model, name, rank, world_size)
