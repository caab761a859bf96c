"""Decode steps replayed from CUDA graphs, one graph per padded batch size.

A decode step of B sequences launches a few hundred kernels; from Python that takes far longer
than the GPU needs to run them. Here the whole decode forward, the LM head and the greedy
argmax (``kernels/argmax.py`` where the head does not fold it) are captured once per graph batch
size (the engine pads a decode-only step to the next one: ``PrepareArgs(graph_batch_sizes=...)``)
and replayed: per step, one host-to-device copy of
the engine's pinned input buffers (``StepBuffers``) and one graph launch.

Each graph is wrapped in the backend's ``graph_timer.GraphHandle`` through a ``GraphTimer``
with named regions: ``graph`` (the whole replay) and inside it embed, attention and mlp (once per
layer), final_norm, lm_head and sampler. Every graph has two executable forms: torch's, made
from the graph with the timer nodes taken out, and the handle's, with them. Replays run torch's
(exactly an untimed graph); while the timer is enabled one replay in ``timed_replay_every``
runs the handle's instead, so timing costs that replay's event records and bookkeeping spread
over ``timed_replay_every`` steps. ``timer.enable()`` / ``disable()`` switch it (no recapture).
Without a usable backend (or the deepinfer-graph-timer wheel) graphs are captured without
regions and ``timer`` is None.

Prefill and mixed steps of up to 512 tokens replay graphs of their own (``step_graph_runner``);
larger ones stay eager, and so do decode steps whose padded size has no graph.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from deepinfer.runtime import switches
from deepinfer.runtime.attention.metadata import AttentionMetadata
from deepinfer.runtime.models.llama import LlamaForCausalLM
from deepinfer.runtime.worker.step_buffers import StepBuffers

if TYPE_CHECKING:
    from deepinfer.runtime.worker.model_runner import ModelRunner


# The LM head + argmax of a one-row graph (kernels/gemv.py; tiles picked on the H200 with
# bench/gemv_bench.py: a 128k x 4096 head at 4.35 TB/s, a 49k x 576 one at 3.2): saves torch's
# separate argmax pass.
LM_HEAD_GEMV_CONFIG = (2, 1024, 4, 3)
LM_HEAD_GEMV_CONFIG_SMALL_K = (4, 1024, 4, 2)


def default_graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including ``max_num_seqs``."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted({*sizes, max_num_seqs})


def make_graph_timer() -> Any | None:
    """A disabled GraphTimer on the selected backend, or None when no backend / timer is installed."""
    try:
        from deepinfer_graph_timer import GraphTimer

        import deepinfer._C.graph_timer as gt
    except ImportError:  # BackendUnavailableError is an ImportError too
        return None
    return GraphTimer(gt, enabled=False)


class _TimerRefused(Exception):
    """The GraphTimer could not attach to a captured graph (the cause is chained)."""


class CudaGraphRunner:
    """Captures and replays the decode step of ``runner`` for each of ``batch_sizes``.

    ``buffers``: the engine's StepBuffers (pinned); the graphs read a device twin of them.
    ``fused``: the decode forward with the fused Triton kernels (``llama_fused_decode``); False
    replays the model's own forward with the runner's (Triton) attention, op for op what the
    eager path runs. ``new_rows``: the most positions of one row's context that a step stores
    (1 for decode steps; k + 1 for the verify rows of k drafts): the decode attention reads those
    only after its PDL wait (``attention/triton_decode.py``).
    """

    def __init__(self, runner: ModelRunner, buffers: StepBuffers, batch_sizes: list[int], *,
                 fused: bool = True, timer: Any | None = None, max_model_len: int | None = None,
                 new_rows: int = 1) -> None:
        if runner.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {runner.device}")
        if not batch_sizes or any(not isinstance(b, int) or not 1 <= b <= buffers.max_seqs for b in batch_sizes):
            raise ValueError(f"graph batch sizes must be integers in [1, {buffers.max_seqs}], got {batch_sizes!r}")
        self.runner, self.buffers, self.fused, self.timer = runner, buffers, fused, timer
        self.new_rows = new_rows
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_model_len = max_model_len or runner.config.max_position_embeddings
        self.device_bytes = torch.zeros(buffers.nbytes, dtype=torch.uint8, device=runner.device)
        self.views = buffers.device_views(self.device_bytes)
        self._graphs: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self.handles: dict[int, Any] = {}  # batch size -> the timer's GraphHandle (timer nodes in)
        self.timed_replay_every = 32
        self.num_replays = 0
        self._capturing = False
        self._metas: dict[int, AttentionMetadata] = {}
        self._triton_argmax_rows = switches.integer("DEEPINFER_TRITON_ARGMAX_ROWS")
        cfg = runner.config
        # MLA models (DeepSeek) replay their own decode forward (models.deepseek_v2) with the
        # Triton MLA decode kernel, fused or not; its context splits are chosen per batch size here
        self._graph_forward = getattr(runner.model, "graph_decode_forward", None)
        if self._graph_forward is not None:
            from deepinfer.runtime.attention.triton_mla import choose_mla_splits

            sms = torch.cuda.get_device_properties(runner.device).multi_processor_count
            self._splits = {b: choose_mla_splits(b, cfg.num_attention_heads, self.max_model_len, sms)
                            for b in self.batch_sizes}
        elif fused:
            from deepinfer.runtime.attention.triton_decode import DecodeWorkspace, choose_num_splits

            props = torch.cuda.get_device_properties(runner.device)
            self._splits = {b: choose_num_splits(b, cfg.num_key_value_heads, self.max_model_len,
                                                 props.multi_processor_count) for b in self.batch_sizes}
            most = max(b * s for b, s in self._splits.items())
            self._workspace = DecodeWorkspace(most, cfg.num_attention_heads, cfg.head_dim, runner.device)

    # ---- capture -------------------------------------------------------------------------
    @contextlib.contextmanager
    def _region(self, name: str) -> Iterator[None]:
        if self.timer is None or not self._capturing:
            yield
            return
        with self.timer.region(name):
            yield

    def _forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        # "graph" spans the whole replay: the other regions sum to it (minus the gaps between them)
        with self._region("graph"):
            return self._forward_regions(b)

    def _forward_regions(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        v, r = self.views, self.runner
        ids, pos = v["input_ids"][:b], v["positions"][:b]
        slots, seq_lens, bt = v["slot_mapping"][:b], v["seq_lens"][:b], v["block_tables"][:b]
        model = r.model
        if self._graph_forward is not None:
            hidden = self._graph_forward(ids, pos, r.kv_caches, slots, bt, seq_lens, self._splits[b], self._region)
        elif self.fused:
            from deepinfer.runtime.models.llama_fused_decode import fused_decode_forward

            hidden = fused_decode_forward(model, ids, pos, r.kv_caches, slots, bt, seq_lens, self._workspace,
                                          self._splits[b], self._region, new_rows=self.new_rows)
        else:
            meta = self._metas[b]
            meta.slot_mapping = torch.where(slots < 0, torch.full_like(slots, r.scratch_slot), slots)
            with self._region("model"):
                hidden = model(ids.long(), pos.long(), r.kv_caches, meta, r.attention)
        w = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        # the argmax-folded one-row head needs the whole vocabulary in this process (not a
        # tensor-parallel shard, whose head_logits gathers the shards)
        whole_head = type(model).head_logits is LlamaForCausalLM.head_logits and model.quantized_head is None
        if self.fused and b == 1 and whole_head and w.stride(1) == 1:
            from deepinfer.runtime.kernels.gemv import gemv_argmax

            with self._region("lm_head"):  # the argmax is folded into the LM head's kernels
                return gemv_argmax(hidden, w, LM_HEAD_GEMV_CONFIG if w.shape[1] >= 2048 else LM_HEAD_GEMV_CONFIG_SMALL_K)
        with self._region("lm_head"):
            # logits in the model's dtype: the sampler casts the rows it uses to float32, and
            # the argmax of bf16 logits is the argmax of their float32 copy
            logits = model.head_logits(hidden)
        with self._region("sampler"):
            if logits.shape[0] <= self._triton_argmax_rows:  # torch's took 36-39 us of a batch-1 step
                from deepinfer.runtime.kernels.argmax import argmax_rows

                greedy = argmax_rows(logits)
            else:
                greedy = logits.argmax(dim=-1)
        return logits, greedy

    def _reference_metadata(self, b: int) -> AttentionMetadata:
        # The eager Triton attention's inputs for a decode-only batch of b rows, as device tensors
        # the graph reads (tiles precomputed: no host-to-device copy may happen during capture).
        v, dev = self.views, self.runner.device
        qsl = np.arange(b + 1, dtype=np.int64)
        meta = AttentionMetadata(
            slot_mapping=v["slot_mapping"][:b], query_start_loc=qsl, seq_lens=np.ones(b, np.int64),
            seq_lens_t=v["seq_lens"][:b], block_tables=v["block_tables"][:b],
            query_start_loc_t=torch.arange(b + 1, dtype=torch.int32, device=dev), block_size=self.runner.block_size,
            max_query_len=1, max_seq_len=1, decode_seq_idx=np.arange(b), prefill_seq_idx=np.zeros(0, np.int64))
        cfg = self.runner.config
        import triton

        group_pad = triton.next_power_of_2(cfg.num_attention_heads // cfg.num_key_value_heads)
        block_q = max(1, 16 // group_pad)
        meta._triton_tiles = (block_q, torch.arange(b, dtype=torch.int32, device=dev),  # type: ignore[attr-defined]
                              torch.zeros(b, dtype=torch.int32, device=dev))
        return meta

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every batch size (largest first, sharing one memory pool).

        When the timer cannot take a graph (a driver older than CUDA 12.3 cannot read graphs
        whose edges carry data, e.g. cuBLAS kernels with programmatic dependent launch), a
        warning says so and every size is captured again without timer regions."""
        if self.timer is not None and self.timer.enabled:
            raise ValueError("capture the decode graphs with the GraphTimer disabled (enable it afterwards)")
        try:
            self._capture_all()
        except _TimerRefused as exc:
            warnings.warn(f"CUDA graphs are captured without GraphTimer regions: the graph timer refused the "
                          f"decode graph ({exc.__cause__})", RuntimeWarning, stacklevel=2)
            self.timer = None
            self._graphs.clear()
            self.handles.clear()
            self._capture_all()

    def _capture_all(self) -> None:
        v = self.views
        # Inputs of placeholder rows: token 0 at position 0, no KV write, a context of one token.
        v["input_ids"].zero_()
        v["positions"].zero_()
        v["slot_mapping"].fill_(-1)
        v["seq_lens"].fill_(1)
        v["block_tables"].zero_()
        if not self.fused and self._graph_forward is None:
            from deepinfer.runtime.attention.triton_paged import paged_attention

            if self.runner.attention is not paged_attention:
                raise ValueError("CUDA graphs without fused kernels need attention_backend='triton'")
            self._metas = {b: self._reference_metadata(b) for b in self.batch_sizes}
        self._capturing = False
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.runner.device)
        for b in reversed(self.batch_sizes):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(b)  # compiles the Triton kernels, sets up cuBLAS, outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize(self.runner.device)
            graph = torch.cuda.CUDAGraph(keep_graph=self.timer is not None)
            self._capturing = True
            try:
                with torch.cuda.graph(graph, pool=pool):
                    logits, greedy = self._forward(b)
            finally:
                self._capturing = False
            if self.timer is not None:
                try:
                    # the handle's own executable graph holds the timer nodes; torch's is
                    # instantiated after attach() took them out of the graph
                    dev = self.runner.device
                    index = torch.cuda.current_device() if dev.index is None else dev.index
                    handle = self.timer.graph_timer.GraphHandle(int(graph.raw_cuda_graph()), device=index)
                    self.handles[b] = self.timer.attach(handle)
                except (RuntimeError, ValueError) as exc:  # the backend's CudaError is a RuntimeError
                    raise _TimerRefused() from exc
                graph.instantiate()
            self._graphs[b] = (graph, logits, greedy)
        torch.cuda.synchronize(self.runner.device)

    # ---- replay --------------------------------------------------------------------------
    def can_replay(self, args: Any) -> bool:
        """True for a decode-only step (one token per row) padded to a captured size."""
        rows = int(args.num_rows)
        return rows in self._graphs and int(args.num_tokens) == rows and int(args.num_logits) == rows

    def replay(self, rows: int, host: torch.Tensor | None = None,
               before_replay: Any | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the step's inputs up (one copy) and replay the graph of ``rows``; returns its
        logits [rows, vocab] (model dtype) and greedy token ids int64 [rows] (device tensors that
        the next replay overwrites). ``host``: another StepBuffers' allocation of the same layout
        (the overlap loop alternates two); ``before_replay(views, rows)``: device work on the
        copied inputs before the replay (the overlap loop gathers input ids there)."""
        graph, logits, greedy = self._graphs[rows]
        n = self.buffers.bytes_for_batch(rows)
        self.device_bytes[:n].copy_((self.buffers.host if host is None else host)[:n], non_blocking=True)
        if before_replay is not None:
            before_replay(self.views, rows)
        if self.timer is not None and self.timer.enabled and self.num_replays % self.timed_replay_every == 0:
            self.timer.replay(self.handles[rows], stream=torch.cuda.current_stream(self.runner.device))
        else:
            graph.replay()
        self.num_replays += 1
        return logits, greedy


def capture_decode_graphs(runner: ModelRunner, buffers: StepBuffers, batch_sizes: list[int],
                          max_model_len: int | None = None, fused: bool = True,
                          timed: bool = True) -> CudaGraphRunner | None:
    """Capture the decode graphs of ``runner`` and install them as ``runner.graphs``: with the
    fused kernels, or (``fused=False``) the model's own forward with the Triton attention.
    None, with graphs left off, when Triton does not import. ``timed=False``: no GraphTimer
    regions (tensor-parallel ranks: a timer refusing one rank's graph would make that rank
    capture again, alone, with warm-up collectives no other rank joins)."""
    if not getattr(runner.model, "supports_decode_graphs", True):
        return None  # a model whose decode forward cannot be captured runs eagerly
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    graphs = CudaGraphRunner(runner, buffers, batch_sizes, fused=fused, timer=make_graph_timer() if timed else None,
                             max_model_len=max_model_len)
    graphs.capture()
    runner.graphs = graphs
    return graphs
