"""Run by test_structured_outputs.py in a subprocess with TRITON_INTERPRET=1 (set before triton
loads), and directly on a CUDA device: structured outputs' Triton mask kernels
(``runtime.kernels.grammar_mask``) against the torch unpack-and-mask they replace.

    python grammar_mask_check.py [cpu|cuda]
"""

from __future__ import annotations

import sys

import torch
from deepinfer.runtime.kernels.grammar_mask import (
    BLOCK,
    MaskedArgmaxGraphs,
    mask_logits_,
    masked_argmax_,
    packed_size,
)
from deepinfer.runtime.sampling.sampler import unpack_bitmask


def _case(vocab: int, rows: int, groups: list[int], dtype: torch.dtype, device: str, gen: torch.Generator
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = torch.randn(rows, vocab, generator=gen).to(dtype).to(device)
    words = (vocab + 31) // 32
    bm = torch.randint(-2**31, 2**31 - 1, (len(groups), words), generator=gen, dtype=torch.int64).to(torch.int32)
    if len(groups) > 0:
        bm[0] = -1  # every token allowed: the plain argmax
    if len(groups) > 1:
        bm[1] = 0  # nothing allowed: token 0, as torch.argmax of an all -inf row
    if len(groups) > 2:  # only the last token allowed
        bm[2] = 0
        bm[2, (vocab - 1) // 32] = 1 << ((vocab - 1) % 32) if (vocab - 1) % 32 < 31 else -(1 << 31)
    if len(groups) > 3:  # a tie between an early and a late block, both allowed: the first wins
        r = groups[3]
        bm[3] = -1
        top = float(logits[r].float().max()) + 1.0
        logits[r, 5] = top
        logits[r, vocab - 3] = top
    return logits, torch.tensor(groups, dtype=torch.int32, device=device), bm.to(device)


def _reference(logits: torch.Tensor, where: torch.Tensor, bm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the logits with refused tokens at -inf, the expected tokens: 12345 where no mask applies)."""
    rows, vocab = logits.shape
    idx = where.cpu().long()
    ref_logits = logits.cpu().float().clone()
    ref_logits[idx] = ref_logits[idx].masked_fill(~unpack_bitmask(bm.cpu(), vocab), float("-inf"))
    want = torch.full((rows,), 12345, dtype=torch.int64)
    want[idx] = ref_logits[idx].argmax(dim=-1)
    return ref_logits, want


def _packed(where: torch.Tensor, bm: torch.Tensor, capacity: int) -> torch.Tensor:
    """The kernels' flat buffer: count, ``capacity`` row slots (the unused ones poisoned), the masks."""
    g, words = bm.shape
    flat = torch.full((packed_size(capacity, g, words),), -7, dtype=torch.int32)
    flat[0] = g
    flat[1:1 + g] = where.cpu()
    flat[1 + capacity:] = bm.cpu().reshape(-1)
    return flat


def main(device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    for vocab in (40, BLOCK + 37, 3 * BLOCK):
        for dtype in (torch.float32, torch.bfloat16):
            rows = 9
            groups = [4, 0, 7, 2, 8, 1]  # out of order, a subset of the rows
            logits, where, bm = _case(vocab, rows, groups, dtype, device, gen)
            ref_logits, want = _reference(logits, where, bm)
            for capacity in (len(groups), rows):  # slots past the count are never read
                plain = torch.full((rows,), 12345, dtype=torch.int64, device=device)
                packed = _packed(where, bm, capacity).to(device)
                got = masked_argmax_(plain, logits, packed, capacity, bm.shape[1]).cpu()
                assert torch.equal(got, want), (vocab, dtype, capacity, got.tolist(), want.tolist())
            if device == "cpu":  # no CUDA: the capture fails, and the direct launch answers instead
                graphs, tokens = MaskedArgmaxGraphs(), torch.full((rows,), 12345, dtype=torch.int64)
                got = graphs.run(tokens, logits, _packed(where, bm, rows), bm.shape[1])
                assert torch.equal(got, want) and len(graphs) == 0, (vocab, dtype, "fallback", got.tolist())
            if device == "cuda":  # the captured form, replayed over other masks copied into its buffer
                graphs, tokens = MaskedArgmaxGraphs(), torch.full((rows,), 12345, dtype=torch.int64, device=device)
                for shift in range(3):
                    bm_i = torch.roll(bm, shift, 0)
                    tokens.fill_(12345)
                    got = graphs.run(tokens, logits, _packed(where, bm_i, rows).pin_memory(), bm.shape[1]).cpu()
                    want_i = _reference(logits, where, bm_i)[1]
                    assert torch.equal(got, want_i), (vocab, dtype, "graph", got.tolist(), want_i.tolist())
                assert len(graphs) == 1
            masked = mask_logits_(logits.clone(), where, bm).cpu().float()
            assert torch.equal(torch.isinf(masked), torch.isinf(ref_logits)), (vocab, dtype)
            finite = ~torch.isinf(ref_logits)
            assert torch.equal(masked[finite], logits.cpu().float()[finite]), (vocab, dtype)
    # bad shapes are refused with a message, never read out of bounds
    logits, where, bm = _case(64, 2, [0], torch.float32, device, gen)
    packed = _packed(where, bm, 1).to(device)
    for call, what in ((lambda: masked_argmax_(torch.zeros(2, dtype=torch.int64, device=device), logits, packed, 1, 1),
                        "covers fewer"),
                       (lambda: masked_argmax_(torch.zeros(2, dtype=torch.int64, device=device), logits,
                                               packed.long(), 1, 2), "int32"),
                       (lambda: mask_logits_(logits, where, bm.long()), "int32"),
                       (lambda: mask_logits_(logits, where[:0], bm), "rows for a bitmask")):
        try:
            call()
        except ValueError as exc:
            assert what in str(exc), exc
        else:
            raise AssertionError(f"a bad bitmask ({what}) was accepted")
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cpu")
