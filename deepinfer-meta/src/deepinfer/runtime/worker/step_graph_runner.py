"""Eager steps (prompt chunks, mixed steps) replayed from CUDA graphs, one graph per padded token count.

Steps that the decode graphs do not take (``cuda_graph_runner``) used to run eagerly through the
fused kernels (``llama_fused_decode.fused_step_forward``). That means 10-14 launches a layer from
Python, where the host's launches take longer than the GPU needs to run them. On the H200 a
128-token prompt of the Qwen3-30B-A3B shape had 32 ms of wall time for 10 ms of kernels.

Here the same forward is captured once per token count of ``step_graph_token_counts`` (powers of
two from 16). A step of T tokens is padded to the next count, and the padded rows do no harm:
- each padded row is token 0 at position 0;
- it writes its key and value into the scratch block, as the engine's padding rows do;
- it belongs to no sequence, so its attention output is zero (``AttentionMetadata.padded_rows``),
  and a mixture of experts routes it like any finite row.

The attention's query tiles (16 tokens of one sequence each; ``attention.triton_paged``) are
worked out on the host per step. Their count is padded to the graph's fixed grid with tiles of an
empty sequence (no query rows, no context), whose programs return at once.

Per step the host copies up eight small arrays and launches one graph, whatever the model's depth.
The hidden states come back as a view of the graph's output; the caller takes the rows it needs
logits of and runs the LM head eagerly.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import numpy as np
import torch

from deepinfer.runtime import switches
from deepinfer.runtime.attention.metadata import AttentionMetadata
from deepinfer.runtime.worker.warm_up import dummy_step

if TYPE_CHECKING:
    from deepinfer.runtime.worker.model_runner import ModelRunner

# attend_cached's query tile for a step with a prompt row: 16 tokens of one sequence
TILE = 16


# DEEPINFER_STEP_GRAPH_TOKENS=auto (the default): the largest step graph, by the model's hidden size
# ((largest hidden size, tokens); else STEP_GRAPH_TOKENS). Measured on H100s (2026-12-07, guide 08,
# "Step graphs up to 8192 tokens for small models"): SmolLM2-135M (576) at gpu_bench's budget of 8192,
# 256 x (128, 256), graphs to 8192 against 2048: bf16 +5-6 %, GGUF Q4_1 +18-21 %, first tokens twice
# as soon (its 4096- and 8192-token steps were bound by the host's launches); Qwen3-0.6B (1024) and
# Llama-3.2-1B (2048) +0.1 % and +0.3 %. A large model's long step is bound by the device, and its
# graphs' activations would take about a GB of the pool for the 8B (by its shapes).
STEP_GRAPH_TOKENS_BY_HIDDEN = ((1024, 8192),)
STEP_GRAPH_TOKENS = 2048


def step_graph_bound(hidden: int | None = None) -> int:
    """The most tokens a step graph holds (``DEEPINFER_STEP_GRAPH_TOKENS``; 0: no step graphs):
    ``auto`` (default) by ``STEP_GRAPH_TOKENS_BY_HIDDEN`` for a model of ``hidden`` size
    (``STEP_GRAPH_TOKENS`` when it is not listed or unknown), or the number given."""
    tokens = switches.integer_or_auto("DEEPINFER_STEP_GRAPH_TOKENS")
    if tokens is not None:
        return tokens
    if hidden is None:
        return STEP_GRAPH_TOKENS
    return next((n for most, n in STEP_GRAPH_TOKENS_BY_HIDDEN if hidden <= most), STEP_GRAPH_TOKENS)


def step_graph_token_counts(budget: int, top_k: int | None = None, hidden: int | None = None) -> list[int]:
    """Token counts of the step graphs: the powers of two from 16 up to both ``step_graph_bound``
    (for a model of ``hidden`` size) and the step budget ``budget``; larger steps stay eager.
    A mixture of experts (``top_k`` experts a token) stops where its (token, expert) pairs outgrow
    the one-launch sort (``fused_moe.TRITON_ALIGN_MAX_PAIRS``), whose fixed shapes a graph can
    hold. Empty when the switch is 0."""
    bound = min(step_graph_bound(hidden), budget)
    if top_k:
        from deepinfer.runtime.kernels.fused_moe import TRITON_ALIGN_MAX_PAIRS

        bound = min(bound, TRITON_ALIGN_MAX_PAIRS // top_k)
    counts, t = [], TILE
    while t <= bound:
        counts.append(t)
        t *= 2
    return counts


class StepGraphs:
    """The fused eager forward of ``runner`` captured for each of ``token_counts``, for steps of up
    to ``max_num_seqs`` sequences of at most ``max_model_len`` tokens."""

    def __init__(self, runner: ModelRunner, token_counts: list[int], max_num_seqs: int, max_model_len: int) -> None:
        if not token_counts or any(t < 1 for t in token_counts):
            raise ValueError(f"step graph token counts must be positive, got {token_counts!r}")
        self.runner = runner
        self.token_counts = sorted(set(token_counts))
        self.max_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.width = -(-max_model_len // runner.block_size)  # blocks of the longest sequence
        dev, most = runner.device, self.token_counts[-1]
        self.ids = torch.zeros(most, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(most, dtype=torch.int64, device=dev)
        self.slots = torch.zeros(most, dtype=torch.int64, device=dev)
        # one sequence slot more than the engine's: the empty sequence the padding tiles point at
        self.qsl = torch.zeros(max_num_seqs + 2, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(max_num_seqs + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(max_num_seqs + 1, self.width, dtype=torch.int64, device=dev)
        self.tile_seq = torch.zeros(self.max_tiles(most), dtype=torch.int32, device=dev)
        self.tile_start = torch.zeros(self.max_tiles(most), dtype=torch.int32, device=dev)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0

    def max_tiles(self, tokens: int) -> int:
        """Query tiles a step of ``tokens`` rows can have: a whole tile per 16 rows plus at most one
        partial tile per sequence."""
        return tokens // TILE + min(self.max_seqs, tokens)

    def fits(self, rows: int, num_seqs: int) -> bool:
        """Whether a step of ``rows`` tokens over ``num_seqs`` sequences replays a graph."""
        return 0 < rows <= self.token_counts[-1] and 0 < num_seqs <= self.max_seqs

    def _count(self, rows: int) -> int:
        return next(t for t in self.token_counts if t >= rows)

    def _metadata(self, tokens: int) -> AttentionMetadata:
        tiles = self.max_tiles(tokens)
        meta = AttentionMetadata(
            slot_mapping=self.slots[:tokens], query_start_loc=np.zeros(2, np.int64), seq_lens=np.zeros(1, np.int64),
            seq_lens_t=self.seq_lens, block_tables=self.block_tables, query_start_loc_t=self.qsl,
            block_size=self.runner.block_size, max_query_len=TILE, max_seq_len=self.max_model_len,
            decode_seq_idx=np.zeros(0, np.int64), prefill_seq_idx=np.zeros(0, np.int64), padded_rows=True)
        meta._triton_tiles = (TILE, self.tile_seq[:tiles], self.tile_start[:tiles])  # type: ignore[attr-defined]
        return meta

    def _forward(self, tokens: int) -> torch.Tensor:
        from deepinfer.runtime.models.llama_fused_decode import fused_step_forward

        r = self.runner
        return fused_step_forward(r.model, self.ids[:tokens], self.positions[:tokens], r.kv_caches,
                                  self._metadata(tokens))

    def host_inputs(self, tokens: int, positions: np.ndarray, slot_mapping: np.ndarray,
                    query_start_loc: np.ndarray, seq_lens: np.ndarray) -> dict[str, np.ndarray]:
        """One step's graph inputs on the host, padded to ``tokens`` rows (input ids and block tables
        apart): positions, slots (the scratch slot for padding rows), query starts and sequence
        lengths over every sequence slot, and the query tiles."""
        # (imported here: the module needs Triton, this one does not)
        from deepinfer.runtime.attention.triton_paged import query_tiles

        rows, n = len(positions), len(seq_lens)
        scratch = self.runner.scratch_slot
        pos = np.zeros(tokens, np.int64)
        pos[:rows] = positions
        slots = np.full(tokens, scratch, np.int64)
        slots[:rows] = np.where(np.asarray(slot_mapping) < 0, scratch, slot_mapping)
        qsl = np.full(self.max_seqs + 2, rows, np.int32)  # sequences n.. have no query rows
        qsl[:n + 1] = query_start_loc
        lens = np.zeros(self.max_seqs + 1, np.int32)
        lens[:n] = seq_lens
        # the attention's query tiles, then the empty sequence n's up to the grid
        real_seq, real_start = query_tiles(query_start_loc, TILE)
        tile_seq = np.full(self.max_tiles(tokens), n, np.int32)
        tile_start = np.zeros(self.max_tiles(tokens), np.int32)
        tile_seq[:len(real_seq)] = real_seq
        tile_start[:len(real_start)] = real_start
        return {"positions": pos, "slots": slots, "qsl": qsl, "seq_lens": lens, "tile_seq": tile_seq,
                "tile_start": tile_start}

    def _load(self, tokens: int, input_ids: np.ndarray | torch.Tensor, positions: np.ndarray,
              slot_mapping: np.ndarray, query_start_loc: np.ndarray, seq_lens: np.ndarray,
              block_tables: np.ndarray) -> None:
        """Copy one step's arrays into the graph's inputs, padded to ``tokens`` rows."""
        rows, n = len(positions), len(seq_lens)
        host = self.host_inputs(tokens, positions, slot_mapping, query_start_loc, seq_lens)
        width = -(-int(np.max(seq_lens)) // self.runner.block_size)
        if isinstance(input_ids, torch.Tensor):  # (the overlap loop's ids, already on the device)
            self.ids[:rows].copy_(input_ids.reshape(-1))
            self.ids[rows:tokens].zero_()
        else:
            ids = np.zeros(tokens, np.int64)
            ids[:rows] = input_ids
            self.ids[:tokens].copy_(torch.from_numpy(ids), non_blocking=True)
        self.positions[:tokens].copy_(torch.from_numpy(host["positions"]), non_blocking=True)
        self.slots[:tokens].copy_(torch.from_numpy(host["slots"]), non_blocking=True)
        self.qsl.copy_(torch.from_numpy(host["qsl"]), non_blocking=True)
        self.seq_lens.copy_(torch.from_numpy(host["seq_lens"]), non_blocking=True)
        self.block_tables[:n, :width].copy_(torch.from_numpy(
            np.ascontiguousarray(np.asarray(block_tables)[:n, :width], dtype=np.int64)), non_blocking=True)
        tiles = len(host["tile_seq"])
        self.tile_seq[:tiles].copy_(torch.from_numpy(host["tile_seq"]), non_blocking=True)
        self.tile_start[:tiles].copy_(torch.from_numpy(host["tile_start"]), non_blocking=True)

    def run_eager(self, input_ids: np.ndarray | torch.Tensor, positions: np.ndarray, slot_mapping: np.ndarray,
                  query_start_loc: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray) -> torch.Tensor:
        """What a replay computes, run eagerly on the graph's padded inputs (any device: the tests
        run it on CPU under Triton's interpreter): hidden states [rows, hidden]."""
        rows = len(positions)
        tokens = self._count(rows)
        self._load(tokens, input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables)
        return self._forward(tokens)[:rows]

    @torch.inference_mode()
    def capture(self) -> None:
        """Run and capture every token count on dummy tokens (largest first, one memory pool). The
        dummy steps write only the KV cache's scratch block (``warm_up.dummy_step``)."""
        r = self.runner
        if r.device.type != "cuda":
            raise ValueError(f"step graphs need a CUDA device, the model is on {r.device}")
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(r.device)
        for tokens in reversed(self.token_counts):
            step = dummy_step(tokens, self.max_model_len, r.block_size, r.num_blocks)
            self._load(tokens, step["input_ids"], step["positions"], step["slot_mapping"], step["query_start_loc"],
                       step["seq_lens"], step["block_tables"])
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(tokens)  # compiles the Triton kernels, sets up cuBLAS, outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize(r.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(tokens)
            self._graphs[tokens] = (graph, hidden)
        torch.cuda.synchronize(r.device)

    def run(self, input_ids: np.ndarray | torch.Tensor, positions: np.ndarray, slot_mapping: np.ndarray,
            query_start_loc: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray) -> torch.Tensor:
        """The final hidden states [rows, hidden] of a step that ``fits``: a view of the graph's
        output, overwritten by the next replay."""
        rows = len(positions)
        tokens = self._count(rows)
        self._load(tokens, input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables)
        graph, hidden = self._graphs[tokens]
        graph.replay()
        self.num_replays += 1
        return hidden[:rows]


def capture_step_graphs(runner: ModelRunner, budget: int, max_num_seqs: int, max_model_len: int) -> StepGraphs | None:
    """Capture the step graphs of ``runner`` and install them as ``runner.step_graphs``: where its
    eager steps run the fused forward (``llama_fused_decode.fused_step_supported``) and
    ``step_graph_token_counts`` is not empty; else None. Out of device memory while capturing:
    the largest count is dropped and the rest captured again, down to none (the steps run
    eagerly), with one RuntimeWarning that says what was left out and what to lower."""
    from deepinfer.runtime.models.llama_fused_decode import fused_step_supported

    if runner.device.type != "cuda" or not fused_step_supported(runner.model, runner.attention):
        return None
    moe = getattr(runner.config, "moe", None)
    # (a dummy step of t tokens takes ceil(t / max_model_len) sequences)
    counts = [t for t in step_graph_token_counts(budget, moe.top_k if moe is not None else None,
                                                 getattr(runner.config, "hidden_size", None))
              if -(-t // max_model_len) <= max_num_seqs]
    asked, error = counts[-1] if counts else 0, None
    graphs: StepGraphs | None = None
    while counts:
        try:
            graphs = StepGraphs(runner, counts, max_num_seqs, max_model_len)
            graphs.capture()
            break
        except torch.OutOfMemoryError as exc:
            # the KV cache took the memory budget first: fewer, smaller graphs (largest first), else
            # none, rather than not serving at all
            graphs = None  # (what a failed capture holds goes before the next try)
            torch.cuda.empty_cache()
            error, counts = str(exc).splitlines()[0], counts[:-1]
    if error is not None:
        held = f"steps of up to {counts[-1]} tokens replay graphs, longer ones" if counts else "prompt and mixed steps"
        warnings.warn(f"step graphs of more than {counts[-1] if counts else 0} tokens not captured: out of device "
                      f"memory ({error}); {held} run eagerly. Lower gpu_memory_utilization, or "
                      f"DEEPINFER_STEP_GRAPH_TOKENS (asked up to {asked} tokens)", RuntimeWarning, stacklevel=2)
    if graphs is not None:
        runner.step_graphs = graphs
    return graphs
