"""The process groups of a tensor-parallel ``LLM`` and the checks of what can be split N ways.

Two groups join the same ranks:

* the *data* group carries the model's collectives (the all-reduces after the row-parallel
  layers, the all-gather of the vocabulary-parallel logits): NCCL on CUDA (capturable in CUDA
  graphs), gloo on CPU. Its timeout bounds every collective of a step.
* the *control* group (gloo, on host tensors) carries rank 0's step descriptions to the other
  ranks. Ranks > 0 wait on it between steps, for as long as the ``LLM`` stays idle, so its
  timeout is long; rank 0's sends through it are bounded by the data timeout instead.

A rank that dies closes its gloo sockets: the other ranks' pending collectives fail at once.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deepinfer.runtime import switches
from deepinfer.runtime.models.config import ModelConfig

#: Seconds a collective of a step may take before the step fails (``DEEPINFER_TP_TIMEOUT_S``).
DEFAULT_TIMEOUT_S = 120.0
#: How long ranks > 0 may wait for rank 0's next step (an idle LLM).
_IDLE_TIMEOUT = datetime.timedelta(days=365)


def collective_timeout_s() -> float:
    raw = switches.raw("DEEPINFER_TP_TIMEOUT_S")
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"DEEPINFER_TP_TIMEOUT_S must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"DEEPINFER_TP_TIMEOUT_S must be positive, got {raw!r}")
    return value


@dataclass
class TensorParallelGroup:
    """This process's place in a tensor-parallel group of ``world_size`` ranks."""

    rank: int
    world_size: int
    device: torch.device
    data_group: Any = None  # torch.distributed ProcessGroup (None when world_size == 1)
    control_group: Any = None
    timeout_s: float = DEFAULT_TIMEOUT_S

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (nothing to do alone)."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.data_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` [..., n] side by side: [..., world_size * n], rank order."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        out = torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        # all_gather_single replaces all_gather_into_tensor in newer torch; both are capturable with NCCL
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x, group=self.data_group)
        return out.view(self.world_size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], -1)


def single_rank(device: torch.device) -> TensorParallelGroup:
    """The group of one (tensor_parallel_size=1): every collective is the identity."""
    return TensorParallelGroup(rank=0, world_size=1, device=device)


def init_groups(rank: int, world_size: int, device: torch.device, init_method: str,
                timeout_s: float, store: Any = None) -> TensorParallelGroup:
    """Join the default process group (rendezvous at ``init_method``: ``tcp://host:port`` or
    ``env://``; rank 0 of a spawned group passes the ``store`` it hosts) and create the control group."""
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timeout)
    data = dist.group.WORLD
    # Ranks > 0 wait on the control group for rank 0's next step as long as the LLM stays idle.
    # Rank 0 only sends there (and meets the others at start and at close), so its operations
    # are bounded by the collective timeout: one stuck on a killed rank then ends, and the
    # group's threads can be joined when it is freed. With the idle timeout on rank 0, freeing
    # the group of an LLM whose rank had been killed blocked its process for good (a CI run hung
    # in the gc.collect() of a later test).
    control = dist.new_group(backend="gloo", timeout=timeout if rank == 0 else _IDLE_TIMEOUT)
    return TensorParallelGroup(rank=rank, world_size=world_size, device=device, data_group=data,
                               control_group=control, timeout_s=timeout_s)


def agree_num_blocks(group: TensorParallelGroup, num_blocks: int) -> int:
    """The fewest KV blocks any rank can hold (the scheduler on rank 0 plans for every rank)."""
    if group.world_size == 1:
        return num_blocks
    t = torch.tensor([num_blocks], dtype=torch.int64)
    # The ranks load their shards at their own pace: rank 0 waits here for every one of them as
    # long as it takes (its other operations on this group are bounded by the collective timeout).
    dist.monitored_barrier(group=group.control_group, timeout=_IDLE_TIMEOUT)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group.control_group)
    return int(t.item())


def check_divisible(cfg: ModelConfig, n: int) -> None:
    """ValueError naming both numbers when a dimension that is split N ways does not divide."""
    for name, value in (("num_attention_heads", cfg.num_attention_heads),
                        ("num_key_value_heads", cfg.num_key_value_heads),
                        ("intermediate_size", cfg.intermediate_size), ("vocab_size", cfg.vocab_size)):
        if value % n:
            raise ValueError(f"tensor_parallel_size={n} does not divide the model's {name}={value}: "
                             f"choose a tensor_parallel_size that divides it")


def check_devices(n: int, device: torch.device) -> list[torch.device]:
    """The device of each rank: cuda:i, cuda:i+1, ... from the asked device's index; on CPU every
    rank is "cpu" (any N is allowed: the ranks share the host's cores). ValueError when CUDA has
    fewer devices than ranks."""
    if device.type == "cpu":
        return [device] * n
    if device.type != "cuda":
        raise ValueError(f"tensor parallelism runs on CPU (gloo) or CUDA (NCCL), not on {device.type!r}")
    count = torch.cuda.device_count()
    first = device.index or 0
    if first + n > count:
        raise ValueError(f"tensor_parallel_size={n} from {device} needs {first + n} CUDA devices, but "
                         f"{count} are present")
    return [torch.device("cuda", first + i) for i in range(n)]


def torchrun_rank() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when this process was started by ``torchrun`` (its
    environment rendezvous variables are set), else None."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    try:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"]))
    except ValueError:
        raise ValueError(f"torchrun environment: RANK={env['RANK']!r} / WORLD_SIZE={env['WORLD_SIZE']!r} "
                         "are not integers") from None
