"""Size and allocate the paged KV cache: a memory fraction on GPU, a byte budget on CPU."""

from __future__ import annotations

import torch

from deepinfer.runtime.models.config import ModelConfig

DEFAULT_CPU_KV_BYTES = 1 << 30  # 1 GiB


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """KV bytes one block of ``block_size`` tokens takes across all layers (keys and values)."""
    elem = torch.empty((), dtype=dtype).element_size()
    planes, heads, dim = cfg.kv_cache_layout()  # (2, kv heads, head_dim); MLA: (1, 1, latent + rope)
    return planes * cfg.num_hidden_layers * block_size * heads * dim * elem


def num_blocks_for(cfg: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device, *,
                   gpu_memory_utilization: float = 0.9, cpu_kv_cache_bytes: int | None = None,
                   draft: ModelConfig | None = None) -> int:
    """How many KV blocks fit: on CUDA, ``gpu_memory_utilization`` of the device minus what is in
    use now (weights, activations); elsewhere ``cpu_kv_cache_bytes`` (default 1 GiB). ``draft``:
    a draft model whose cache holds the same number of blocks (speculative decoding) shares the
    budget: a block then costs the bytes of both."""
    per_block = bytes_per_block(cfg, block_size, dtype)
    if draft is not None:
        per_block += bytes_per_block(draft, block_size, dtype)
    if device.type == "cuda":
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * gpu_memory_utilization) - used
    else:
        budget = DEFAULT_CPU_KV_BYTES if cpu_kv_cache_bytes is None else int(cpu_kv_cache_bytes)
        if budget <= 0:
            raise ValueError(f"cpu_kv_cache_bytes must be positive, got {cpu_kv_cache_bytes!r}")
    blocks = budget // per_block
    if blocks < 1:
        where = ""
        if device.type == "cuda":
            where = (f": the device has {total} bytes, gpu_memory_utilization={gpu_memory_utilization} allows "
                     f"{int(total * gpu_memory_utilization)}, and {used} are in use already "
                     f"({_memory_holders(device, used)})")
        raise ValueError(
            f"the KV cache budget ({budget} bytes) holds no block of {block_size} tokens "
            f"({per_block} bytes each){where}; raise gpu_memory_utilization / cpu_kv_cache_bytes"
            + (", or free the device's memory (another server on the same GPU must leave room: "
               "lower its --gpu-memory-utilization)" if device.type == "cuda" else ""))
    return int(blocks)


def _memory_holders(device: torch.device, used: int) -> str:
    """Who holds the device's memory in use: this process's torch allocator (weights,
    activations), and the rest (other processes, CUDA contexts), by process where NVML says."""
    reserved = int(torch.cuda.memory_reserved(device))
    parts = [f"{reserved} reserved by this process's torch allocator (weights, activations)",
             f"{max(0, used - reserved)} by CUDA contexts and other processes"]
    try:  # NVML (pynvml) names the processes; without it the split above is all there is
        listing = torch.cuda.list_gpu_processes(device)
    except Exception:  # noqa: BLE001 - optional detail of an error message
        listing = ""
    lines = [ln.strip() for ln in listing.splitlines()[1:] if ln.strip() and "no processes" not in ln]
    if lines:
        parts.append("processes on the device: " + "; ".join(lines))
    return ", ".join(parts)


def allocate_kv_caches(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    """One ``[2, num_blocks + 1, block_size, kv_heads, head_dim]`` tensor per layer (MLA models:
    ``[1, num_blocks + 1, block_size, 1, kv_lora_rank + qk_rope_head_dim]``); the extra last
    block is a scratch area that padding rows (slot -1) write into.

    On CPU the cache is not zero-filled (zeroing 1 GiB takes ~0.5 s and touches every page):
    attention reads only slots below each sequence's length, which were written, and the torch
    backend zeroes the masked tail of gathered blocks (attention.torch_paged). Other devices get
    zeros, which are cheap there and keep kernels that multiply masked slots by 0 NaN-free."""
    planes, heads, dim = cfg.kv_cache_layout()
    shape = (planes, num_blocks + 1, block_size, heads, dim)
    alloc = torch.empty if device.type == "cpu" else torch.zeros
    return [alloc(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
