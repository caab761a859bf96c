"""The speculative step: verify the drafts the engine scheduled, apply the result through
``process_MTPInfo`` and store each sequence's next drafts.

The engine carries the bookkeeping: a running sequence's ``draft_tokens`` (set by
``process_MTPInfo``'s ``next_drafts``) are scheduled as extra query tokens of its decode row
(``Scheduler.schedule`` drops those that do not fit the token budget or the model length),
``prepare_sampler_inputs`` lists them in ``SpeculativeSamplingInputs`` (draft ids, the logits row
verifying each, the bonus row), and ``process_MTPInfo`` appends the kept drafts and the bonus or
recovered token with the scheduler's own stop checks, rolls back the KV slots of rejected drafts
and stores the next drafts. With a draft model (``draft_model``) the stored drafts are
placeholders: the draft model drafts them when the step launches (``propose``), once the
scheduler has placed them and allocated their KV slots.

Which requests draft: those whose next token depends only on the target's logits at its
position and the temperature / top-k / top-p / min-p filters — no penalties, logit bias,
allowed or bad words, ``min_tokens`` or per-request ``seed`` (their rows are ordinary rows of the
verify step, sampled exactly as without speculation; a seeded request keeps its reproducible
stream). Logprobs (and top-k logprobs) of every appended token are those of the target's raw
logits at that token's position, as without speculation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deepinfer.runtime.sampling.sampler import SamplerOutput, SamplingBatch, sampling_probs
from deepinfer.runtime.sampling_params import GREEDY_TEMPERATURE_THRESHOLD
from deepinfer.runtime.speculative.config import SpeculativeConfig
from deepinfer.runtime.speculative.draft_model import Drafted, DraftModel, batch_rows
from deepinfer.runtime.speculative.metrics import SpecDecodeStats
from deepinfer.runtime.speculative.ngram import next_draft_cap, propose_ngram
from deepinfer.runtime.speculative.rejection import verify_drafts


def may_draft(params: Any) -> bool:
    """Whether a request's tokens may be drafted (see the module docstring)."""
    return bool(params.presence_penalty == 0 and params.frequency_penalty == 0 and params.repetition_penalty == 1
                and not params.logit_bias and not params.allowed_token_ids and not params.bad_words
                and not params.min_tokens and params.seed is None)


@dataclass
class SpecStep:
    """A verified step, ready for ``process_MTPInfo`` (one entry per real sample row)."""

    speculator: Speculator
    seq_ids: np.ndarray  # int64 [R] (-1: placeholder)
    num_drafts: np.ndarray  # int32 [R]
    num_accepted: np.ndarray  # int32 [R]
    tokens: np.ndarray  # int32 [R, k + 1]
    logprobs: np.ndarray | None = None  # float32 [R, k + 1]
    topk_ids: np.ndarray | None = None  # int32 [R, k + 1, K]
    topk_logprobs: np.ndarray | None = None

    def apply(self, scheduler: Any) -> np.ndarray:
        """Store next drafts and apply the step; returns the tokens appended per row."""
        E = self.speculator.E
        nxt = self.speculator.next_drafts(scheduler, self)
        appended = E.process_MTPInfo(scheduler, self.num_accepted, self.tokens, nxt, self.logprobs,
                                     self.topk_ids, self.topk_logprobs)
        self.speculator.stats.observe(self.num_drafts, self.num_accepted)
        return np.asarray(appended)


class Speculator:
    """Drafts and verification for one engine loop.

    ``params_of(request_id)``: the request's SamplingParams (None once it is gone)."""

    def __init__(self, config: SpeculativeConfig, params_of: Callable[[str], Any], *, seed: int = 0,
                 device: torch.device | None = None, draft: DraftModel | None = None) -> None:
        from deepinfer._C import engine

        self.E: Any = engine
        self.config = config
        self.k = config.num_speculative_tokens
        self.params_of = params_of
        self.stats = SpecDecodeStats(self.k)
        self.generator = torch.Generator(device=device or torch.device("cpu"))
        self.generator.manual_seed(seed)
        self.oracle: dict[tuple[int, ...], np.ndarray] = {}
        # seq id -> (request id, SamplingParams, may draft, oracle recording): ``_request_of``
        self._by_seq: dict[int, tuple[str, Any, bool, np.ndarray | None]] = {}
        # draft_length "adaptive": seq id -> (request id, its draft cap) (``next_draft_cap``)
        self._caps: dict[int, tuple[str, int]] = {}
        if (config.method == "draft_model") != (draft is not None):
            raise ValueError("Speculator: method 'draft_model' needs its DraftModel (and only it takes one)")
        self.draft = draft

    def propose(self, scheduler: Any, scheduled: Any, si: Any, arrays: dict[str, np.ndarray], num_seqs: int,
                batch: SamplingBatch) -> Drafted | None:
        """(method "draft_model", before the target's forward) run the draft model for the step's
        scheduled drafts and write them into its input ids; None for the other methods, whose
        drafts the engine already holds."""
        if self.draft is None:
            return None
        return self.draft.propose(scheduler, scheduled, si, arrays, num_seqs, batch, self.generator)

    def record_oracle(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Method "oracle": the drafts of a request with this prompt follow ``output_ids`` (a
        recorded greedy run of the same request). Method "draft_model": the draft model still
        drafts (its cost is paid) but greedy requests verify these instead (benchmarks: the
        draft's cost at the oracle's acceptance)."""
        self.oracle[tuple(int(t) for t in prompt_ids)] = np.asarray(output_ids, dtype=np.int32)
        self._by_seq.clear()  # sequences looked up before may have this prompt
        if self.draft is not None:  # benchmarks: the draft model runs, its drafts replaced by these
            self.draft.override = self._oracle_drafts

    @property
    def forced(self) -> bool:
        """Oracle mode (method "oracle", or a draft model whose drafts recorded runs replace):
        greedy requests keep every draft without comparing it with the target's argmax (the
        target still computes all k + 1 positions and the bonus token). On random weights the
        verify forward and the decode forward that recorded the run may break near-ties
        differently (bf16 numerics of other kernels), so acceptance by equality would measure
        numerics; forced acceptance measures what oracle mode is for, the verification path's
        cost at 100 % acceptance. Benchmarks only: a greedy output then follows the recording.
        Sampled requests still go through rejection sampling (the tests use oracle drafts as a
        deliberately bad draft)."""
        return self.config.method == "oracle" or (self.draft is not None and self.draft.override is not None)

    def _oracle_drafts(self, history: np.ndarray, num_prompt: int, count: int) -> np.ndarray | None:
        rec = self.oracle.get(tuple(int(t) for t in history[:num_prompt]))
        num_out = len(history) - num_prompt
        return None if rec is None else rec[num_out:num_out + count]

    # ---- verification (launch) ---------------------------------------------------------------
    def verify(self, si: Any, logits: torch.Tensor, rows: torch.Tensor, batch: SamplingBatch,
               res: SamplerOutput, drafted: Drafted | None = None) -> SpecStep:
        """Verify the step's drafts. ``rows``/``batch``/``res``: the sample rows' logits rows,
        sampling batch and ordinary samples (the bonus token of a row with drafts); ``drafted``:
        the draft model's drafts and their q (``propose``; None: the engine's drafts, one-hot)."""
        k = self.k
        real = int(si.driver.num_real_rows)
        S = si.speculative
        ns, nd = int(S.num_seqs), int(S.num_drafts_total)
        sample_tokens = res.tokens
        tokens = np.zeros((real, k + 1), np.int32)
        tokens[:, 0] = sample_tokens[:real].cpu().numpy()
        num_accepted = np.zeros(real, np.int32)
        num_drafts = np.zeros(real, np.int32)
        rows_h = rows[:real].cpu().numpy()
        token_rows = np.repeat(rows_h[:, None], k + 1, axis=1)  # logits row of each output token
        if ns:
            sr = np.array(S.sample_rows[:ns], dtype=np.int64)
            cu = np.array(S.cu_num_drafts[:ns + 1], dtype=np.int64)
            trows = np.array(S.target_logits_rows[:nd], dtype=np.int64)
            dev = logits.device
            if drafted is None:
                drafts = torch.from_numpy(np.array(S.draft_token_ids[:nd], dtype=np.int64)).to(dev)
            else:
                drafts = drafted.ids.to(dev)
            per_draft = torch.from_numpy(sr[np.repeat(np.arange(ns), np.diff(cu))]).to(dev)
            target = logits[torch.from_numpy(trows).to(dev)].float()
            temp = batch.temperature[per_draft]
            greedy = temp < GREEDY_TEMPERATURE_THRESHOLD
            probs = None
            if not bool(greedy.all()):
                probs = sampling_probs(target, batch_rows(batch, per_draft))
            argmax = target.argmax(dim=-1)
            if self.forced:  # oracle mode: greedy rows keep every draft (see ``forced``)
                argmax = torch.where(greedy, drafts, argmax)
            v = verify_drafts(drafts, cu, greedy, argmax, probs, sample_tokens[torch.from_numpy(sr).to(dev)],
                              self.generator, None if drafted is None else drafted.probs)
            for s in range(ns):
                r, a, b = int(sr[s]), int(cu[s]), int(cu[s + 1])
                if r >= real:
                    continue
                n = int(v.num_accepted[s])
                num_drafts[r], num_accepted[r] = b - a, n
                tokens[r, :n + 1] = v.tokens[s, :n + 1]
                token_rows[r, :b - a] = trows[a:b]
        step = SpecStep(self, np.array(si.driver.seq_ids[:real], dtype=np.int64), num_drafts, num_accepted, tokens)
        if batch.max_logprobs >= 0:
            flat = torch.from_numpy(token_rows.reshape(-1)).to(logits.device)
            logp = torch.log_softmax(logits[flat].float(), dim=-1)
            toks = torch.from_numpy(tokens.reshape(-1).astype(np.int64)).to(logits.device)
            step.logprobs = np.ascontiguousarray(
                logp.gather(1, toks[:, None]).squeeze(1).cpu().numpy().reshape(real, k + 1), dtype=np.float32)
            if batch.max_logprobs > 0:
                vals, ids = logp.topk(batch.max_logprobs, dim=-1)
                step.topk_ids = np.ascontiguousarray(ids.cpu().numpy().reshape(real, k + 1, -1), dtype=np.int32)
                step.topk_logprobs = np.ascontiguousarray(vals.cpu().numpy().reshape(real, k + 1, -1),
                                                          dtype=np.float32)
        return step

    def verify_greedy(self, si: Any, argmax: torch.Tensor) -> SpecStep:
        """``verify`` for a step whose rows are all plain greedy (``is_plain_greedy``: no
        penalties, bias, masks or logprobs) with drafts the engine holds: ``argmax`` int64 [L] is
        the argmax of each logits row (the sample of a sample row, the target's token at a draft
        row). One device-to-host copy; the rest on the host. Same tokens as ``verify``."""
        k = self.k
        real = int(si.driver.num_real_rows)
        am = argmax.cpu().numpy()  # the step's one sync
        rows_h = np.asarray(si.kernel.logits_rows[:real], dtype=np.int64)
        tokens = np.zeros((real, k + 1), np.int32)
        tokens[:, 0] = am[rows_h]
        num_accepted = np.zeros(real, np.int32)
        num_drafts = np.zeros(real, np.int32)
        S = si.speculative
        ns, nd = int(S.num_seqs), int(S.num_drafts_total)
        if ns:
            sr = np.asarray(S.sample_rows[:ns], dtype=np.int64)
            cu = np.asarray(S.cu_num_drafts[:ns + 1], dtype=np.int64)
            target = am[np.asarray(S.target_logits_rows[:nd], dtype=np.int64)]
            drafts = np.asarray(S.draft_token_ids[:nd], dtype=np.int64)
            forced = self.forced
            for s in range(ns):
                r, a, b = int(sr[s]), int(cu[s]), int(cu[s + 1])
                if r >= real:
                    continue
                miss = np.flatnonzero(drafts[a:b] != target[a:b])
                n = b - a if forced or not len(miss) else int(miss[0])
                num_drafts[r], num_accepted[r] = b - a, n
                tokens[r, :n] = drafts[a:a + n]
                tokens[r, n] = target[a + n] if n < b - a else am[rows_h[r]]  # recovered, or the bonus token
        return SpecStep(self, np.array(si.driver.seq_ids[:real], dtype=np.int64), num_drafts, num_accepted, tokens)

    def _request_of(self, seq: Any) -> tuple[Any, bool, np.ndarray | None]:
        """(its SamplingParams, whether it may draft, its oracle recording) for a sequence, looked
        up once per sequence (per step they cost a prompt-long tuple and a dozen attribute reads
        per sequence: milliseconds at 32 sequences)."""
        sid, rid = int(seq.seq_id), seq.request_id
        hit = self._by_seq.get(sid)
        if hit is not None and hit[0] == rid:
            return hit[1], hit[2], hit[3]
        params = self.params_of(rid)
        ok = params is not None and may_draft(params)
        rec = None
        if ok and self.config.method == "oracle":
            rec = self.oracle.get(tuple(int(t) for t in list(seq.token_ids)[:int(seq.num_prompt_tokens)]))
        if len(self._by_seq) >= 4096:  # finished sequences' entries: dropped wholesale now and then
            self._by_seq.clear()
        if params is not None:  # (a request gone: not cached, it is looked up again)
            self._by_seq[sid] = (rid, params, ok, rec)
        return params, ok, rec

    def _drafting(self, scheduler: Any, seq_id: int, num_new: int) -> tuple[Any, np.ndarray | None, int, int] | None:
        """(the sequence, its oracle recording, its output tokens, room for drafts) of a live
        sequence that may draft at its next step once ``num_new`` more tokens are appended;
        None when it may not (gone, finished, a request that is never drafted, no room left
        before ``max_tokens``: the next step's last token is not a draft)."""
        if seq_id < 0:
            return None
        try:
            seq = scheduler.get_sequence(seq_id)
        except (KeyError, ValueError):
            return None
        if seq.is_finished:
            return None
        params, ok, rec = self._request_of(seq)
        if not ok:
            return None
        num_out = int(seq.num_tokens) + num_new - int(seq.num_prompt_tokens)
        room = min(self.k, int(params.max_tokens) - num_out - 1)
        return None if room <= 0 else (seq, rec, num_out, room)

    # ---- the overlap loop (engine.overlap): plain decode steps run ahead ------------------------
    def expects_drafts(self, scheduler: Any, seq_ids: np.ndarray) -> bool:
        """Whether any of these sequences, each with one token in flight (a plain decode step
        launched, its token not yet on the host), would likely draft at its next step: the
        overlap loop then applies that step before scheduling the next one (which then verifies
        the drafts) instead of running one ahead of it without drafts. A draft model or an oracle
        recording drafts for every request that may draft and has room left; the n-gram method
        looks the known tokens up (a match there predicts the in-flight token and the drafts after
        it). A wrong guess costs one step's drafts (or one step not run ahead), never a token."""
        cfg = self.config
        for seq_id in seq_ids:
            found = self._drafting(scheduler, int(seq_id), 1)  # (1: the token in flight)
            if found is None:
                continue
            seq, rec, num_out, room = found
            if cfg.method == "draft_model":
                return True
            if cfg.method == "oracle":
                if rec is not None and len(rec) > num_out:
                    return True
                continue
            history = np.asarray(seq.token_ids, dtype=np.int32)
            if len(propose_ngram(history, cfg.prompt_lookup_min, cfg.prompt_lookup_max, room, cfg.ngram_match)):
                return True
        return False

    def apply_plain(self, scheduler: Any, seq_ids: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Apply a plain decode step (one token per row, no drafts; ``seq_ids`` int64 and
        ``tokens`` int32 by sample row) with ``process_MTPInfo``, storing each sequence's next
        drafts: the overlap loop's step that no step runs ahead of."""
        n = len(tokens)
        if len(seq_ids) != n:
            raise RuntimeError(f"apply_plain: {len(seq_ids)} sequence ids for {n} sample rows")
        zeros = np.zeros(n, np.int32)
        step = SpecStep(self, np.asarray(seq_ids, dtype=np.int64), zeros, zeros,
                        np.ascontiguousarray(np.asarray(tokens, dtype=np.int32).reshape(n, 1)))
        return step.apply(scheduler)

    # ---- drafting (apply) --------------------------------------------------------------------
    def next_drafts(self, scheduler: Any, step: SpecStep) -> np.ndarray:
        """int32 [R, k]: each row's drafts for its next step, -1 after its last."""
        cfg, k = self.config, self.k
        out = np.full((len(step.seq_ids), k), -1, np.int32)
        for r, seq_id in enumerate(step.seq_ids):
            n_step = int(step.num_accepted[r]) + 1
            found = self._drafting(scheduler, int(seq_id), n_step)
            if found is None:
                continue
            seq, rec, num_out, room = found
            if cfg.method == "draft_model":  # placeholders: the draft model drafts them at launch
                drafts = np.zeros(room, np.int32)
            elif cfg.method == "oracle":
                drafts = np.zeros(0, np.int32) if rec is None else rec[num_out:num_out + room]
            else:
                if cfg.draft_length == "adaptive":
                    room = min(room, self._draft_cap(seq, int(step.num_drafts[r]), int(step.num_accepted[r])))
                history = np.concatenate([np.asarray(seq.token_ids, dtype=np.int32), step.tokens[r, :n_step]])
                drafts = propose_ngram(history, cfg.prompt_lookup_min, cfg.prompt_lookup_max, room, cfg.ngram_match)
            out[r, :len(drafts)] = drafts
        return out

    def _draft_cap(self, seq: Any, num_drafts: int, num_accepted: int) -> int:
        """draft_length "adaptive": the sequence's draft cap after a step that verified
        ``num_drafts`` of its drafts and kept ``num_accepted`` (k before its first drafts)."""
        sid, rid = int(seq.seq_id), seq.request_id
        hit = self._caps.get(sid)
        cap = hit[1] if hit is not None and hit[0] == rid else self.k
        cap = next_draft_cap(cap, self.k, num_drafts, num_accepted)
        if len(self._caps) >= 4096:  # finished sequences' entries: dropped wholesale now and then
            self._caps.clear()
        self._caps[sid] = (rid, cap)
        return cap
