"""``Worker``: one rank's share of an ``LLM``, built the same way on every rank.

A worker holds the device, the loaded model (its shard under tensor parallelism), the KV cache
sized for the device (the fewest blocks any rank can hold), the ``ModelRunner``, the engine's
step buffers and the decode graphs. Rank 0 of a tensor-parallel group runs a ``DriverRunner``
(it announces every step to the other ranks); ranks > 0 serve rank 0's step messages with
their worker's runner and buffers (``distributed.rank``). With one rank there is no group.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from deepinfer.runtime.engine_args import EngineArgs, physical_memory_bytes
from deepinfer.runtime.worker.step_buffers import StepBuffers, step_buffer_dims

if TYPE_CHECKING:
    from deepinfer.runtime.parallel.process_group import TensorParallelGroup
    from deepinfer.runtime.worker.device import RuntimeDevice
    from deepinfer.runtime.worker.model_runner import ModelRunner

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def runtime_device(device: str | None) -> tuple[torch.device, RuntimeDevice]:
    """The torch device of the ``device`` option (None: the selected backend's) and where it
    came from; ValueError when it is a CUDA device this torch cannot use."""
    from deepinfer.runtime.worker.device import resolve_runtime_device

    where = resolve_runtime_device(device)
    try:
        dev = torch.device(where.device)
    except RuntimeError as exc:  # torch's message lists every device type it parses, ours included or not
        if where.device.split(":", 1)[0] == "npu":
            raise ValueError(f"device={where.device!r} needs torch_npu, which registers the NPU with torch: "
                             "install deepinfer[ascend] on a machine with Ascend NPUs") from exc
        raise ValueError(f"device={where.device!r} is not a device this torch knows: use 'cpu', 'cuda' or "
                         "'cuda:N' (deepinfer[cuda]), or 'npu' (deepinfer[ascend], with torch_npu)") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: CUDA is not available in this torch build/machine")
    return dev, where


def model_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """The ``dtype`` option as a torch dtype (None: float32 on CPU, bfloat16 elsewhere)."""
    if dtype is not None:
        return _DTYPES[dtype]
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def model_path(model: str | None) -> str:
    """The path the ``model`` option names (None: the embedded default), checked to be a file or
    a directory."""
    from deepinfer.runtime.loading.model_loader import resolve_model_path

    path = resolve_model_path(model)
    if not (os.path.isfile(path) or os.path.isdir(path)):
        raise ValueError(f"model={path!r} is neither a regular file (GGUF) nor a model directory")
    return path


def keeps_gguf_quantization(args: EngineArgs, device: torch.device, path: str) -> bool:
    """Whether a GGUF file's quantized projections stay quantized (see load_model): no dtype asked,
    and on CPU (the default there), or on CUDA when asked with ``quantization="gguf"`` and not
    deterministic (its batch-invariant kernels take dense weights). On CUDA the GGUF kernels are
    opt-in: measured on the H200 they still decode slower than the bf16 weights they replace."""
    if args.dtype is not None or not os.path.isfile(path):
        return False
    if device.type == "cpu":
        return True
    return device.type == "cuda" and args.quantization == "gguf" and not args.deterministic


class Worker:
    """Device, model, KV cache, runner, step buffers and decode graphs of one rank.

    ``args``: the engine options with the model's defaults filled (``EngineArgs.for_model``);
    ``device``: this rank's device; ``group``: its tensor-parallel group (None with one rank);
    ``runner_factory``: what builds the runner from the loaded model and the ``ModelRunner``
    keywords (default ``ModelRunner``; rank 0 of a tensor-parallel group passes the
    ``DriverRunner`` that announces each step to the other ranks). Graphs are captured by ``capture_graphs`` (after the engine loop exists on rank
    0; at once on the other ranks: the captures meet in the same collectives).
    """

    def __init__(self, args: EngineArgs, model_path: str, device: torch.device, *,
                 group: TensorParallelGroup | None = None,
                 runner_factory: Callable[..., ModelRunner] | None = None) -> None:
        from deepinfer.runtime.loading.model_loader import load_model
        from deepinfer.runtime.worker.cuda_graph_runner import default_graph_batch_sizes

        assert args.max_model_len is not None and args.max_num_batched_tokens is not None, "args.for_model first"
        self.args, self.device, self.group = args, device, group
        self.dtype = model_dtype(args.dtype, device)
        self.parallel = group is not None and group.world_size > 1
        if args.num_threads is not None:
            torch.set_num_threads(args.num_threads)
        if args.quantization is not None:  # refused before the weights are read
            from deepinfer.runtime.loading.quantization import check_quantization

            check_quantization(args.quantization, device, model_path,
                               group.world_size if self.parallel and group else 1, self.dtype)
        keep_quantized = keeps_gguf_quantization(args, device, model_path) and not self.parallel
        self.loaded = load_model(model_path, device=device, dtype=self.dtype, dummy_weights=args.dummy_weights,
                                 max_positions=args.max_model_len, seed=args.seed,
                                 tensor_parallel=group if self.parallel else None, keep_quantized=keep_quantized)
        if args.quantization is not None and args.quantization != "gguf":
            from deepinfer.runtime.models.fp8_linear import quantize_model

            quantize_model(self.loaded.model, args.quantization)
        # (speculative method "draft_model") the draft model, loaded before the KV cache is sized:
        # its weights take device memory, and its cache takes blocks of the same ids (see below)
        self.draft_loaded: Any = None
        spec = args.speculative_config
        if spec is not None and getattr(spec, "method", None) == "draft_model":
            if self.parallel:
                raise ValueError("speculative_config method 'draft_model' runs on one rank only (no tensor "
                                 "parallelism for the draft yet): use tensor_parallel_size=1 or method 'ngram'")
            from deepinfer.runtime.loading.draft_loader import load_draft_model

            self.draft_loaded = load_draft_model(
                spec.model, self.loaded.config, device=device, dtype=self.dtype, dummy_weights=args.dummy_weights,
                max_positions=args.max_model_len, seed=args.seed,
                keep_quantized=keeps_gguf_quantization(args, device, spec.model))
        self.num_blocks = self._num_kv_blocks()
        kwargs: dict[str, Any] = dict(num_blocks=self.num_blocks, block_size=args.block_size, device=device,
                                      dtype=self.dtype, attention_backend=args.attention_backend,
                                      deterministic=args.deterministic)
        from deepinfer.runtime.worker.model_runner import ModelRunner

        self.runner: Any = (runner_factory or ModelRunner)(self.loaded, **kwargs)
        # the draft's own paged KV cache: the target's block count and size, indexed by the
        # target's block tables (one allocator, one prefix cache, one preemption policy)
        self.draft_runner: Any = None
        if self.draft_loaded is not None:
            self.draft_runner = ModelRunner(self.draft_loaded, **kwargs)
        self.step_buffers = StepBuffers(*step_buffer_dims(args.max_num_batched_tokens, args.max_num_seqs,
                                                          args.max_model_len, args.block_size),
                                        pin=device.type == "cuda")
        # deterministic: eager steps (the decode graphs run the fused one-row kernels, not the
        # batch-invariant ones)
        use_graphs = device.type == "cuda" and not args.enforce_eager and not args.deterministic
        self.graph_batch_sizes = default_graph_batch_sizes(args.max_num_seqs) if use_graphs else None

    def _num_kv_blocks(self) -> int:
        """``num_kv_blocks`` when it fits the device's memory, else the blocks the memory budget
        holds; with several ranks, the fewest any rank can hold."""
        from deepinfer.runtime.worker.kv_cache import bytes_per_block, num_blocks_for

        args, dev, cfg = self.args, self.device, self.loaded.config
        draft = None if self.draft_loaded is None else self.draft_loaded.config
        blocks = args.num_kv_blocks
        if blocks is None:
            blocks = num_blocks_for(cfg, args.block_size, self.dtype, dev,
                                    gpu_memory_utilization=args.gpu_memory_utilization,
                                    cpu_kv_cache_bytes=args.cpu_kv_cache_bytes, draft=draft)
        else:
            per_block = bytes_per_block(cfg, args.block_size, self.dtype)
            if draft is not None:
                per_block += bytes_per_block(draft, args.block_size, self.dtype)
            room = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else physical_memory_bytes()
            if blocks * per_block > room:
                raise ValueError(f"num_kv_blocks={blocks} needs {blocks * per_block} bytes of KV "
                                 f"cache ({per_block} per block), more than the {room} bytes available on {dev}")
        if self.parallel and self.group is not None:
            from deepinfer.runtime.parallel.process_group import agree_num_blocks

            blocks = agree_num_blocks(self.group, blocks)
        return int(blocks)

    def eos_token_ids(self, tokenizer: Any) -> list[int]:
        """The model's end-of-sequence ids (the tokenizer's when the model names none)."""
        ids = list(self.loaded.config.eos_token_ids)
        tok_eos = getattr(tokenizer, "eos_token_id", None)
        if not ids and tok_eos is not None:
            ids = [int(tok_eos)]
        return ids

    def warm_up(self) -> None:
        """Run eager steps of a few row counts on dummy tokens (``worker.warm_up``) so that the first
        real prompt finds the eager kernels compiled: on CUDA unless ``DEEPINFER_WARMUP=0``. On rank
        0 only: under tensor parallelism its runner announces the steps to the other ranks."""
        from deepinfer.runtime.worker import warm_up as wu

        if not wu.warm_up_wanted(self.device.type):
            return
        budget, max_len = self.args.max_num_batched_tokens, self.args.max_model_len
        assert budget is not None and max_len is not None, "args.for_model first"
        for runner in (self.runner, self.draft_runner):
            if runner is not None:
                wu.warm_up(runner, budget, self.args.max_num_seqs, max_len)

    def capture_graphs(self) -> None:
        """Capture the decode graphs over the step buffers (CUDA without ``enforce_eager``; a
        no-op elsewhere), then on one rank the graphs of eager steps (``step_graph_runner``).
        Tensor-parallel ranks capture without GraphTimer regions."""
        if self.graph_batch_sizes is None:
            return
        from deepinfer.runtime.worker.cuda_graph_runner import capture_decode_graphs

        capture_decode_graphs(self.runner, self.step_buffers, self.graph_batch_sizes, self.args.max_model_len,
                              timed=not self.parallel)
        if not self.parallel:  # (tensor-parallel ranks: eager steps stay eager)
            from deepinfer.runtime.worker.step_graph_runner import capture_step_graphs

            budget, max_len = self.args.max_num_batched_tokens, self.args.max_model_len
            assert budget is not None and max_len is not None, "args.for_model first"
            capture_step_graphs(self.runner, budget, self.args.max_num_seqs, max_len)
        spec = self.args.speculative_config
        if spec is not None and not self.parallel:  # (tensor-parallel ranks: verify steps stay eager)
            from deepinfer.runtime.worker.verify_graph_runner import capture_verify_graphs

            capture_verify_graphs(self.runner, self.step_buffers.width, spec.num_speculative_tokens,
                                  self.graph_batch_sizes, self.step_buffers.max_tokens, self.args.max_model_len)
            if self.draft_runner is not None:  # the draft model's forwards, under graphs of their own
                capture_verify_graphs(self.draft_runner, self.step_buffers.width, spec.num_speculative_tokens,
                                      self.graph_batch_sizes, self.step_buffers.max_tokens, self.args.max_model_len,
                                      draft=True)
