"""Turn the engine's ``SamplerInputs`` (numpy views, CSR lists) into the sampler's device tensors.

Penalty token counts come in the SamplerInputs' ``penalty_counts`` mode: "incremental" (the
runtime's) keeps per-slot tables on the device (``PenaltyTables``) that each step's updates
bring up to date; "full" carries every penalized sequence's counts each step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from deepinfer.runtime.host_to_device import host_to_device
from deepinfer.runtime.sampling.sampler import SamplingBatch


def _t(a: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # The engine reuses its storage next step: copy now.
    return torch.from_numpy(np.array(a)).to(device=device, dtype=dtype, non_blocking=True)


def _csr_rows(offsets: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(len(offsets) - 1, dtype=np.int64), np.diff(offsets))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class PenaltyTables:
    """The device-resident penalty counts of one SamplerInputs in "incremental" mode.

    Per slot: ``counts`` int32 [slots, width] (occurrences of each token in the output) and
    ``seen`` bool [slots, width] (token in the prompt or the output); tokens >= width have
    neither. Both grow on demand (slots to ``num_penalty_slots``, width to the largest token sent).
    ``apply`` must see every prepare_sampler_inputs call of its SamplerInputs, in order; it checks
    that with ``SamplerInputs.num_calls``.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.counts = torch.zeros((0, 0), dtype=torch.int32, device=self.device)
        self.seen = torch.zeros((0, 0), dtype=torch.bool, device=self.device)
        self.applied_calls = 0  # SamplerInputs.num_calls of the last call applied

    def grow(self, slots: int, width: int) -> None:
        """Room for ``slots`` slots and tokens below ``width`` (the overlap loop counts tokens the
        tables have not seen yet)."""
        self._grow(slots, width)

    def _grow(self, slots: int, width: int) -> None:
        s0, w0 = self.counts.shape
        if slots <= s0 and width <= w0:
            return
        s1 = max(s0, _round_up(slots, 64))
        w1 = max(w0, _round_up(width, 4096))
        counts = torch.zeros((s1, w1), dtype=torch.int32, device=self.device)
        seen = torch.zeros((s1, w1), dtype=torch.bool, device=self.device)
        counts[:s0, :w0] = self.counts
        seen[:s0, :w0] = self.seen
        self.counts, self.seen = counts, seen

    def apply(self, si: Any) -> None:
        """Brings the tables up to date with the last call that filled ``si`` (a no-op when that
        call is already applied). RuntimeError when a call was missed: call
        ``si.reset_penalty_tables()`` and ``reset()``, then prepare the step again."""
        n = int(si.num_calls)
        if n == self.applied_calls:
            return
        if self.applied_calls >= 0 and n != self.applied_calls + 1:
            raise RuntimeError(
                f"penalty tables: {n - self.applied_calls - 1} prepare_sampler_inputs call(s) were not applied "
                f"(num_calls {n}, last applied {self.applied_calls}); call SamplerInputs.reset_penalty_tables() "
                "and PenaltyTables.reset(), then prepare the step again")
        tr = si.transform
        self.applied_calls = n
        u = int(tr.num_penalty_updates)
        if u == 0:
            self._grow(int(tr.num_penalty_slots), 0)
            return
        slots = np.array(tr.penalty_update_slots, dtype=np.int64)
        reset = np.array(tr.penalty_update_reset).astype(bool)
        toks = np.array(tr.penalty_update_token_ids, dtype=np.int64)
        is_out = np.array(tr.penalty_update_is_output).astype(bool)
        entry_slot = np.repeat(slots, np.diff(np.asarray(tr.penalty_update_offsets)))
        self._grow(int(tr.num_penalty_slots), int(toks.max()) + 1 if len(toks) else 0)
        dev = self.device
        if reset.any():
            r = host_to_device(slots[reset], dev)
            self.counts[r] = 0
            self.seen[r] = False
        if len(toks):
            es, et = host_to_device(entry_slot, dev), host_to_device(toks, dev)
            self.seen[es, et] = True
            o = host_to_device(is_out, dev, bool)
            self.counts.index_put_((es[o], et[o]), torch.ones(int(is_out.sum()), dtype=torch.int32, device=dev),
                                   accumulate=True)

    def reset(self) -> None:
        """Forget every table; the next call applied may have any number. Only together with
        SamplerInputs.reset_penalty_tables() (whose next call sends every table whole)."""
        self.counts.zero_()
        self.seen.zero_()
        self.applied_calls = -1  # accept the next call whatever its number

    def gather(self, penalty_slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows with a slot, their counts float32 [P, width], their seen flags bool [P, width])."""
        slots = np.asarray(penalty_slots)
        rows = np.flatnonzero(slots >= 0)
        s = host_to_device(slots[rows], self.device)
        return host_to_device(rows, self.device), self.counts[s].float(), self.seen[s]


def sampling_batch_from_engine(si: Any, device: torch.device,
                               tables: PenaltyTables | None = None) -> tuple[torch.Tensor, SamplingBatch]:
    """(logits row of each sample row, SamplingBatch) for one step's SamplerInputs ``si``.

    In "incremental" mode ``tables`` (the PenaltyTables that ``si`` feeds, one per SamplerInputs)
    is required: this applies the step's penalty updates to it, so call it once after every
    prepare_sampler_inputs. "full" mode needs no tables.
    """
    k, tr, drv = si.kernel, si.transform, si.driver
    incremental = si.penalty_counts == "incremental"
    if incremental:
        if tables is None:
            raise ValueError("tables: SamplerInputs in 'incremental' penalty mode needs the PenaltyTables it feeds "
                             "(or build it with penalty_counts='full')")
        tables.apply(si)  # every call, penalties this step or not
    rows = _t(k.logits_rows, torch.int64, device)
    b = SamplingBatch(
        temperature=_t(k.temperature, torch.float32, device),
        top_k=_t(k.top_k, torch.int64, device),
        top_p=_t(k.top_p, torch.float32, device),
        min_p=_t(k.min_p, torch.float32, device),
        seeds=_t(k.seeds, torch.int64, device),
        sample_index=_t(k.subsequences, torch.int64, device),
        step=_t(k.offsets, torch.int64, device),
        max_logprobs=int(drv.max_num_logprobs),
        all_greedy=bool(k.all_greedy),
        top_k_used=not bool(k.no_top_k), top_p_used=not bool(k.no_top_p), min_p_used=not bool(k.no_min_p),
    )
    if not tr.no_penalties:
        b.presence_penalty = _t(tr.presence_penalty, torch.float32, device)
        b.frequency_penalty = _t(tr.frequency_penalty, torch.float32, device)
        b.repetition_penalty = _t(tr.repetition_penalty, torch.float32, device)
        if incremental:
            assert tables is not None
            b.penalty_rows, b.penalty_counts, b.penalty_seen = tables.gather(tr.penalty_slots)
        else:
            prow = _csr_rows(np.asarray(tr.penalty_offsets))
            ptok = np.asarray(tr.penalty_token_ids, dtype=np.int64)
            counts = np.asarray(tr.penalty_output_counts)
            in_prompt = np.asarray(tr.penalty_in_prompt).astype(bool)
            out_mask = counts > 0
            b.count_rows = _t(prow[out_mask], torch.int64, device)
            b.count_tokens = _t(ptok[out_mask], torch.int64, device)
            b.count_values = _t(counts[out_mask], torch.float32, device)
            seen = out_mask | in_prompt
            b.seen_rows = _t(prow[seen], torch.int64, device)
            b.seen_tokens = _t(ptok[seen], torch.int64, device)
    if not tr.no_logit_bias:
        b.bias_rows = _t(_csr_rows(np.asarray(tr.bias_offsets)), torch.int64, device)
        b.bias_tokens = _t(tr.bias_token_ids, torch.int64, device)
        b.bias_values = _t(tr.bias_values, torch.float32, device)
    if not tr.no_banned:
        b.mask_rows = _t(_csr_rows(np.asarray(tr.banned_offsets)), torch.int64, device)
        b.mask_tokens = _t(tr.banned_token_ids, torch.int64, device)
    if not tr.no_allowed:
        b.allowed_rows = _t(_csr_rows(np.asarray(tr.allowed_offsets)), torch.int64, device)
        b.allowed_tokens = _t(tr.allowed_token_ids, torch.int64, device)
    return rows, b


def is_plain_greedy(si: Any) -> bool:
    """Every row of the step greedy, without penalties, bias, masks or logprobs: its tokens are the
    argmax of its logits rows (what ``sample`` would draw), no SamplingBatch needed."""
    k, tr = si.kernel, si.transform
    return bool(k.all_greedy and tr.no_penalties and tr.no_logit_bias and tr.no_banned and tr.no_allowed
                and int(si.driver.max_num_logprobs) < 0)
