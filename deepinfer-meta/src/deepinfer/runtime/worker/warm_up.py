"""Start-up warm-up: eager steps of a few row counts on dummy tokens, so that the first real prompt
does not pay Triton's compiles.

On a GPU the eager steps (prompt chunks, mixed steps) run Triton kernels that compile on first use,
once per set of compile-time values: the fused attention and norms, the grouped MoE GEMMs and, for a
GGUF model kept quantized, its GEMM tiles. A fresh machine's first prompts therefore waited for
those compiles (H200, empty Triton cache, 32 prompts of a Q4_0 SmolLM2-135M: TTFT 1,670 ms, then
891 ms in the second call, against 32 ms with this warm-up; guide 08). The decode graphs are
captured at start-up and compile theirs then; this does the same for the eager steps.

Which kernel variant a step runs depends on its row count, in ways each kernel decides: Triton
specialises every integer argument on whether it is a multiple of 16 (a step's rows, and the
(token, expert) pairs of a MoE layer: rows times top-k), tiles change with the rows (the GGUF GEMM
at 16, 32 and ``gemm_swap_rows()`` rows, the fused MoE at 64 and 4096 pairs), and the step budget
(``max_num_batched_tokens``) is the largest count; the LM head and the eager decode rows run one
row per sequence, so the number of sequences of a step matters as much. ``warm_up_rows`` takes
every power of two up to a bound and each one plus one (an odd count: not a multiple of 16 in rows
or in pairs), which puts a count on each side of every such edge that is a power of two, and at
least one count in each range between. ``warm_up`` runs those row counts as whole prompts, and those
sequence counts (up to ``max_num_seqs``, from one) as one row each after a cached block: eager
decode rows, as a prefix-cache hit of a whole prompt or a step mixing decodes with prompts has.

The dummy steps read and write only the KV cache's scratch block (the block padding rows write
into), so no sequence's cache changes; their logits are thrown away.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from deepinfer.runtime import switches


def warm_up_wanted(device_type: str) -> bool:
    """Whether ``warm_up`` runs at start-up: on CUDA (where the eager kernels compile on first use)
    unless ``DEEPINFER_WARMUP=0``."""
    return device_type == "cuda" and switches.enabled("DEEPINFER_WARMUP")


def warm_up_rows(bound: int, start: int = 2) -> list[int]:
    """Counts of the warm-up steps up to ``bound``: each power of two p from 2, p + 1 where it fits,
    and ``bound``; none below ``start``."""
    rows = {1, bound}
    p = 2
    while p <= bound:
        rows.update((p, p + 1))
        p *= 2
    return sorted(r for r in rows if start <= r <= bound)


def dummy_step(rows: int, max_model_len: int, block_size: int, scratch_block: int,
               context: int = 0, per_seq: int | None = None) -> dict[str, np.ndarray]:
    """``ModelRunner.execute``'s arrays for a step of ``rows`` dummy tokens: sequences of at most
    ``per_seq`` (default: ``max_model_len - context``) new tokens after ``context`` cached ones,
    whose block tables name only the scratch block and whose rows write its slots; logits of each
    sequence's last row."""
    most = max_model_len - context
    per_seq = most if per_seq is None else per_seq
    if not 1 <= per_seq <= most:
        raise ValueError(f"dummy_step: {per_seq} new tokens a sequence after context={context} do not fit "
                         f"max_model_len={max_model_len}")
    lens = [per_seq] * (rows // per_seq)
    if rows % per_seq:
        lens.append(rows % per_seq)
    q_lens = np.asarray(lens, dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    seq_lens = q_lens + context
    width = -(-int(seq_lens.max()) // block_size)
    positions = np.concatenate([np.arange(context, context + n, dtype=np.int32) for n in lens])
    return {
        "input_ids": np.zeros(rows, dtype=np.int32),
        "positions": positions,
        "slot_mapping": (scratch_block * block_size + positions % block_size).astype(np.int64),
        "query_start_loc": qsl,
        "seq_lens": seq_lens.astype(np.int32),
        "block_tables": np.full((len(lens), width), scratch_block, dtype=np.int32),
        "logits_indices": (qsl[1:] - 1).astype(np.int32),
    }


def warm_up(runner: Any, budget: int, max_num_seqs: int, max_model_len: int) -> list[tuple[int, int]]:
    """Run ``runner.execute`` on dummy tokens (see ``dummy_step``): whole prompts of each of
    ``warm_up_rows(budget)`` rows, then each of ``warm_up_rows(min(budget, max_num_seqs), 1)``
    one-row sequences after a cached block (where the model length leaves room for it), except the
    steps that the runner's step graphs replay (their capture compiled those kernels); then wait
    for the device. Returns the steps run, as (rows, sequences)."""
    import torch

    bs, scratch = runner.block_size, runner.num_blocks
    steps = [dummy_step(r, max_model_len, bs, scratch) for r in warm_up_rows(budget)]
    if max_model_len > bs:
        steps += [dummy_step(n, max_model_len, bs, scratch, context=bs, per_seq=1)
                  for n in warm_up_rows(min(budget, max_num_seqs), start=1)]
    graphs = getattr(runner, "step_graphs", None)
    if graphs is not None:
        steps = [a for a in steps if not graphs.fits(len(a["input_ids"]), len(a["seq_lens"]))]
    for arrays in steps:
        runner.execute(**arrays)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return [(len(a["input_ids"]), len(a["seq_lens"])) for a in steps]
