"""What ranks > 0 run: load their shard, size their KV cache, then serve rank 0's steps.

``RankSpec`` is everything a rank needs to build its half of the ``LLM`` (picklable, sent to
spawned processes). ``run_rank`` is the same sequence rank 0 runs in ``LLM.__init__`` (load,
agree on the KV block count, capture the same decode graphs), so the collectives of start-up
pair up; then ``serve_steps`` replays rank 0's step messages until it says shut down.
"""

from __future__ import annotations

import datetime
import signal
import sys
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deepinfer.runtime.distributed.step_channel import (
    OP_COPY_BLOCKS,
    OP_EXECUTE,
    OP_REPLAY,
    OP_SHUTDOWN,
    StepChannel,
    unpack_execute,
)
from deepinfer.runtime.parallel.process_group import TensorParallelGroup, init_groups

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RankSpec:
    """The model and engine settings every rank builds from (rank 0's ``LLM`` arguments)."""

    model_path: str
    dtype: str
    devices: list[str]  # one per rank
    max_model_len: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_kv_blocks: int | None
    gpu_memory_utilization: float
    cpu_kv_cache_bytes: int | None
    dummy_weights: bool
    seed: int
    attention_backend: str | None
    num_threads: int | None
    graph_batch_sizes: list[int] | None
    timeout_s: float
    init_method: str  # tcp://host:port of rank 0's store, or env:// under torchrun

    @property
    def world_size(self) -> int:
        return len(self.devices)


def agree_num_blocks(group: TensorParallelGroup, num_blocks: int) -> int:
    """The fewest KV blocks any rank can hold (the scheduler on rank 0 plans for every rank)."""
    if group.world_size == 1:
        return num_blocks
    t = torch.tensor([num_blocks], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group.control_group)
    return int(t.item())


def step_buffer_dims(spec: RankSpec) -> tuple[int, int, int]:
    """(token rows, sequences, block-table width) of the engine's step buffers (as EngineLoop sizes them)."""
    return (max(spec.max_num_batched_tokens, spec.max_num_seqs), spec.max_num_seqs,
            -(-spec.max_model_len // spec.block_size))


def run_rank(spec: RankSpec, group: TensorParallelGroup) -> None:
    """Build this rank's model, KV cache and graphs, then serve steps until rank 0 shuts down."""
    from deepinfer.runtime.loading.model_loader import load_model
    from deepinfer.runtime.worker.kv_cache import num_blocks_for
    from deepinfer.runtime.worker.model_runner import ModelRunner
    from deepinfer.runtime.worker.step_buffers import StepBuffers

    dev, dtype = group.device, _DTYPES[spec.dtype]
    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    loaded = load_model(spec.model_path, device=dev, dtype=dtype, dummy_weights=spec.dummy_weights,
                        max_positions=spec.max_model_len, seed=spec.seed, tensor_parallel=group)
    num_blocks = spec.num_kv_blocks
    if num_blocks is None:
        num_blocks = num_blocks_for(loaded.config, spec.block_size, dtype, dev,
                                    gpu_memory_utilization=spec.gpu_memory_utilization,
                                    cpu_kv_cache_bytes=spec.cpu_kv_cache_bytes)
    num_blocks = agree_num_blocks(group, num_blocks)
    runner = ModelRunner(loaded, num_blocks=num_blocks, block_size=spec.block_size, device=dev, dtype=dtype,
                         attention_backend=spec.attention_backend)
    buffers = StepBuffers(*step_buffer_dims(spec), pin=dev.type == "cuda")
    if spec.graph_batch_sizes is not None:
        from deepinfer.runtime.worker.cuda_graph_runner import capture_decode_graphs

        capture_decode_graphs(runner, buffers, spec.graph_batch_sizes, spec.max_model_len, timed=False)
    serve_steps(runner, StepChannel(group), buffers)


def serve_steps(runner: Any, channel: StepChannel, buffers: Any) -> None:
    """Run rank 0's messages on this rank's shard until OP_SHUTDOWN."""
    while True:
        op, fields, payload = channel.receive()
        if op == OP_SHUTDOWN:
            channel.leave()
            return
        if op == OP_EXECUTE:
            assert payload is not None
            runner.execute(**unpack_execute(fields, payload))
        elif op == OP_COPY_BLOCKS:
            n = fields[0]
            pairs = payload.numpy().reshape(2, n) if payload is not None else None
            if pairs is not None:
                runner.copy_blocks(pairs[0], pairs[1])
        elif op == OP_REPLAY:
            rows, nbytes = fields[0], fields[1]
            assert payload is not None and runner.graphs is not None
            buffers.host[:nbytes].copy_(payload)
            runner.graphs.replay(rows)
        else:
            raise RuntimeError(f"tensor-parallel rank {channel.group.rank}: unknown step message {op}")


def worker_main(rank: int, spec: RankSpec, errors: Any) -> None:
    """Entry point of a spawned rank: any failure is reported to rank 0 (``errors`` queue) and
    ends this process with exit status 1."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    try:
        # what can fail here locally fails before rank 0 is told this rank started (then it
        # reports the failure at once instead of waiting in the rendezvous)
        dev = torch.device(spec.devices[rank])
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        store = None
        if spec.init_method.startswith("tcp://"):  # rank 0's store (see launcher.start_tensor_parallel)
            host, port = spec.init_method[len("tcp://"):].rsplit(":", 1)
            store = dist.TCPStore(host, int(port), spec.world_size, is_master=False,
                                  timeout=datetime.timedelta(seconds=spec.timeout_s))
            store.set(f"deepinfer_tp_started_{rank}", "1")  # launcher.started_key: rank 0 waits for it
        group = init_groups(rank, spec.world_size, dev, spec.init_method, spec.timeout_s, store=store)
        run_rank(spec, group)
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported, then the process ends
        try:
            errors.put((rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        except Exception:  # noqa: BLE001 - rank 0 may be gone
            pass
        print(f"deepinfer: tensor-parallel rank {rank} stops: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.stderr.flush()
        raise SystemExit(1) from None
