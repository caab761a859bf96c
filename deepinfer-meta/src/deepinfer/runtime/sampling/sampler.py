"""The sampler: logits -> next tokens (+ logprobs) for one step, on the model's device.

Order of work per row, as in vLLM: logit bias / banned / allowed ids / min_tokens masking, then
repetition, frequency and presence penalties, then greedy argmax or: temperature, top-k, top-p
(on the top-k renormalised distribution), min-p, and a draw from a counter-based random stream
keyed by (seed, sample index, step) so a seeded request is reproducible in any batch. Logprobs
are those of ``SamplingBatch.logprobs_mode`` (vLLM's): by default the log_softmax of the model's
raw logits, before any processing.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.runtime.sampling.random_streams import exponential_noise, stream_keys
from deepinfer.runtime.sampling_params import GREEDY_TEMPERATURE_THRESHOLD


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step (rows = logits rows), as device tensors.

    Sparse entries are (row, token[, value]) triples: ``bias_*`` logit bias, ``mask_*`` tokens
    forced to -inf (banned ids, EOS/stop ids before min_tokens), ``allowed_*`` rows restricted to
    a set of tokens, ``count_*`` output-token counts (frequency/presence), ``seen_*`` tokens of the
    prompt or the output (repetition penalty). The penalty counts may come dense instead (from
    per-slot tables): ``penalty_rows`` [P] the rows that have them, ``penalty_counts`` float32
    [P, W] output counts and ``penalty_seen`` bool [P, W] prompt-or-output flags of tokens < W
    (W <= vocab; later tokens have none).
    """

    temperature: torch.Tensor  # float32 [R]; below GREEDY_TEMPERATURE_THRESHOLD (e.g. 0) = greedy
    top_k: torch.Tensor  # int64 [R]; <= 0 or >= vocab = off
    top_p: torch.Tensor  # float32 [R]; 1 = off
    min_p: torch.Tensor  # float32 [R]; 0 = off
    seeds: torch.Tensor  # int64 [R]
    sample_index: torch.Tensor  # int64 [R]
    step: torch.Tensor  # int64 [R] (output tokens generated so far by that sample)
    presence_penalty: torch.Tensor | None = None  # float32 [R]
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    count_rows: torch.Tensor | None = None
    count_tokens: torch.Tensor | None = None
    count_values: torch.Tensor | None = None
    seen_rows: torch.Tensor | None = None
    seen_tokens: torch.Tensor | None = None
    penalty_rows: torch.Tensor | None = None
    penalty_counts: torch.Tensor | None = None
    penalty_seen: torch.Tensor | None = None
    bias_rows: torch.Tensor | None = None
    bias_tokens: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    mask_rows: torch.Tensor | None = None
    mask_tokens: torch.Tensor | None = None
    allowed_rows: torch.Tensor | None = None
    allowed_tokens: torch.Tensor | None = None
    # structured outputs: sample rows [G] and their allowed-token bitmask int32 [G, ceil(V/32)]
    # (bit t % 32 of word t // 32 set = token t allowed), filled on the host by runtime.structured
    grammar_rows: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None
    max_logprobs: int = -1  # largest top-k logprobs asked by any row; -1 = none
    # what logprobs report (vLLM's logprobs_mode): raw_logprobs, raw_logits, processed_logprobs, processed_logits
    logprobs_mode: str = "raw_logprobs"
    # rows that asked the whole vocabulary's logprobs (logprobs=-1): SamplerOutput.full has their rows
    full_rows: torch.Tensor | None = None
    all_greedy: bool = False
    # Whether some random row uses top-k / top-p / min-p, when the host knows it (the engine's
    # no_top_k / no_top_p / no_min_p): no device-to-host sync to find out. None: checked on the device.
    top_k_used: bool | None = None
    top_p_used: bool | None = None
    min_p_used: bool | None = None


@dataclass
class SamplerOutput:
    """Sampled token per row and, when asked, its raw logprob and the top-k ids/logprobs."""

    tokens: torch.Tensor  # int64 [R]
    logprobs: torch.Tensor | None  # float32 [R] (sampled token)
    topk_ids: torch.Tensor | None  # int64 [R, k]
    topk_logprobs: torch.Tensor | None  # float32 [R, k]
    full: torch.Tensor | None = None  # float32 [F, V]: the logprobs of SamplingBatch.full_rows, whole rows


def apply_logits_processing(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Bias, masks and penalties applied to a copy of float32 ``logits`` [R, V]."""
    x = logits.clone()
    if b.bias_rows is not None and b.bias_tokens is not None and b.bias_values is not None and b.bias_rows.numel():
        x.index_put_((b.bias_rows, b.bias_tokens), b.bias_values.to(x.dtype), accumulate=True)
    if b.allowed_rows is not None and b.allowed_rows.numel():
        keep = torch.zeros_like(x, dtype=torch.bool)
        keep[b.allowed_rows, b.allowed_tokens] = True
        restricted = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
        restricted[b.allowed_rows] = True
        x = x.masked_fill(restricted[:, None] & ~keep, float("-inf"))
    if b.repetition_penalty is not None and b.seen_rows is not None and b.seen_rows.numel():
        seen = torch.zeros_like(x, dtype=torch.bool)
        seen[b.seen_rows, b.seen_tokens] = True
        rp = b.repetition_penalty[:, None].to(x.dtype)
        penalised = torch.where(x > 0, x / rp, x * rp)
        x = torch.where(seen, penalised, x)
    if b.count_rows is not None and b.count_tokens is not None and b.count_values is not None \
            and b.count_rows.numel() and (b.frequency_penalty is not None or b.presence_penalty is not None):
        counts = torch.zeros_like(x)
        counts.index_put_((b.count_rows, b.count_tokens), b.count_values.to(x.dtype), accumulate=True)
        if b.frequency_penalty is not None:
            x = x - b.frequency_penalty[:, None] * counts
        if b.presence_penalty is not None:
            x = x - b.presence_penalty[:, None] * (counts > 0).to(x.dtype)
    if b.penalty_rows is not None and b.penalty_counts is not None and b.penalty_seen is not None \
            and b.penalty_rows.numel():
        x = _apply_dense_penalties(x, b)
    if b.mask_rows is not None and b.mask_rows.numel():
        x[b.mask_rows, b.mask_tokens] = float("-inf")
    if b.grammar_rows is not None and b.grammar_bitmask is not None and b.grammar_rows.numel():
        x = apply_token_bitmask(x, b.grammar_rows, b.grammar_bitmask)
    return x


_BITS: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [G, vocab] of a packed int32 bitmask [G, W] (bit t % 32 of word t // 32 = token t).
    Tokens past 32 * W are not allowed."""
    bits_of = _BITS.get(bitmask.device)
    if bits_of is None:  # 1 << k for k in 0..31 as int32 (bit 31 is the sign bit)
        bits_of = _BITS[bitmask.device] = torch.tensor([1 << k if k < 31 else -(1 << 31) for k in range(32)],
                                                       dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.to(torch.int32)[:, :, None] & bits_of) != 0).reshape(bitmask.shape[0], -1)
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    return torch.nn.functional.pad(bits, (0, vocab - bits.shape[1]), value=False)


def masked_argmax(logits: torch.Tensor, argmax: torch.Tensor | None, rows: torch.Tensor,
                  bitmask: torch.Tensor) -> torch.Tensor:
    """The argmax of each row of ``logits`` [R, V] (``argmax``: already computed, e.g. by a CUDA
    graph, or None), where ``rows`` [G] take only the tokens ``bitmask`` [G, W] allows: a greedy
    step with structured rows, without the sampler's other work (the torch form; on CUDA the
    engine takes ``kernels.grammar_mask``'s kernel through ``StructuredOutputs.masked_argmax``)."""
    tokens = logits.argmax(dim=-1) if argmax is None else argmax.clone()
    rows = rows.long()
    tokens[rows] = _masked(logits[rows], bitmask).argmax(dim=-1).to(tokens.dtype)
    return tokens


def apply_token_bitmask(x: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``x`` [R, V] with the tokens ``bitmask`` [G, W] does not allow in ``rows`` [G] set to -inf."""
    if x.is_cuda and x.stride(-1) == 1:
        from deepinfer.runtime.kernels.grammar_mask import mask_logits_

        return mask_logits_(x, rows, bitmask)
    rows = rows.long()
    x[rows] = _masked(x[rows], bitmask)
    return x


def _masked(sub: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of ``sub`` [G, V] (a gathered copy already, changed in place where possible) with
    the tokens ``bitmask`` [G, W] does not allow set to -inf."""
    if sub.device.type == "cpu":
        xgrammar: Any
        try:  # xgrammar's CPU kernel (several times faster than unpacking on CPU)
            xgrammar = importlib.import_module("xgrammar")
        except ImportError:
            xgrammar = None
        if xgrammar is not None:
            sub = sub.contiguous()
            xgrammar.apply_token_bitmask_inplace(sub, bitmask.to(torch.int32).contiguous())
            return sub
    return sub.masked_fill(~unpack_bitmask(bitmask, sub.shape[-1]), float("-inf"))


def _apply_dense_penalties(x: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    # The same element-wise math as the sparse path, on the penalized rows' first W columns.
    assert b.penalty_rows is not None and b.penalty_counts is not None and b.penalty_seen is not None
    rows = b.penalty_rows
    width = min(b.penalty_counts.shape[1], x.shape[1])  # the tables may be wider than the vocabulary
    sub = x[rows, :width]
    if b.repetition_penalty is not None:
        rp = b.repetition_penalty[rows][:, None].to(x.dtype)
        sub = torch.where(b.penalty_seen[:, :width], torch.where(sub > 0, sub / rp, sub * rp), sub)
    counts = b.penalty_counts[:, :width].to(x.dtype)
    if b.frequency_penalty is not None:
        sub = sub - b.frequency_penalty[rows][:, None] * counts
    if b.presence_penalty is not None:
        sub = sub - b.presence_penalty[rows][:, None] * (counts > 0).to(x.dtype)
    x[rows, :width] = sub
    return x


def _used(known: bool | None, mask: torch.Tensor) -> bool:
    # A host-known answer costs nothing; asking the device waits for it.
    return bool(mask.any()) if known is None else known


def sampling_probs(x: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Probabilities [R, V] after temperature, top-k, top-p and min-p (greedy rows, temperature
    below GREEDY_TEMPERATURE_THRESHOLD, are treated as temperature 1 here; the caller takes their
    argmax instead)."""
    return _truncate(x, b)[0]


def _truncate(x: torch.Tensor, b: SamplingBatch
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(``sampling_probs``, the logits divided by the temperature with the top-k cut at -inf,
    the tokens top-p and min-p removed (bool [R, V]) or None when neither ran)."""
    temp = torch.where(_sampled_rows(b), b.temperature, torch.ones_like(b.temperature))
    x = x / temp[:, None]
    vocab = x.shape[-1]
    k = b.top_k
    use_k = (k > 0) & (k < vocab)
    if _used(b.top_k_used, use_k):
        kk = torch.where(use_k, k, torch.full_like(k, vocab)).clamp(max=vocab)
        sorted_x = x.sort(dim=-1, descending=True).values
        kth = sorted_x.gather(1, (kk - 1)[:, None])
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    removed = None
    use_p = b.top_p < 1.0
    if _used(b.top_p_used, use_p):
        sp, idx = probs.sort(dim=-1, descending=True)
        before = sp.cumsum(dim=-1) - sp  # probability mass strictly ahead of each token
        drop_sorted = (before >= b.top_p[:, None]) & use_p[:, None]
        removed = torch.zeros_like(drop_sorted).scatter_(1, idx, drop_sorted)
        probs = probs.masked_fill(removed, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    use_min = b.min_p > 0
    if _used(b.min_p_used, use_min):
        thresh = probs.max(dim=-1, keepdim=True).values * b.min_p[:, None]
        drop = (probs < thresh) & use_min[:, None]
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        removed = drop if removed is None else removed | drop
    return probs, x, removed


def _sampled_rows(b: SamplingBatch) -> torch.Tensor:
    # A smaller temperature would overflow logits / temperature to inf (softmax NaN).
    return b.temperature >= GREEDY_TEMPERATURE_THRESHOLD


def sample(logits: torch.Tensor, b: SamplingBatch) -> SamplerOutput:
    """Draw one token per row of float32 ``logits`` [R, V]."""
    logits = logits.float()
    x = apply_logits_processing(logits, b)
    greedy_tokens = x.argmax(dim=-1)
    processed = x  # what processed logprobs report: greedy rows' logits after bias, masks, penalties
    if b.all_greedy:
        tokens = greedy_tokens
    else:
        probs, scaled, removed = _truncate(x, b)
        noise = exponential_noise(stream_keys(b.seeds, b.sample_index, b.step), x.shape[-1])
        drawn = (probs / noise).argmax(dim=-1)
        sampled = _sampled_rows(b)
        tokens = torch.where(sampled, drawn, greedy_tokens)
        if b.max_logprobs >= 0 and b.logprobs_mode.startswith("processed"):
            if removed is not None:
                scaled = scaled.masked_fill(removed, float("-inf"))
            processed = torch.where(sampled[:, None], scaled, x)  # greedy rows: no temperature or cut (vLLM)
    lp = topk_ids = topk_lp = full = None
    if b.max_logprobs >= 0:
        logp = reported_logprobs(logits, processed, b.logprobs_mode)
        lp = logp.gather(1, tokens[:, None]).squeeze(1)
        if b.max_logprobs > 0:
            topk_lp, topk_ids = logp.topk(b.max_logprobs, dim=-1)
        if b.full_rows is not None and b.full_rows.numel():
            full = logp[b.full_rows]
    return SamplerOutput(tokens=tokens, logprobs=lp, topk_ids=topk_ids, topk_logprobs=topk_lp, full=full)


LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


def reported_logprobs(raw: torch.Tensor, processed: torch.Tensor, mode: str) -> torch.Tensor:
    """The values logprobs report in ``mode`` (vLLM's ``logprobs_mode``): the log_softmax of the
    raw or the processed logits, or those logits themselves."""
    if mode == "raw_logprobs":
        return torch.log_softmax(raw, dim=-1)
    if mode == "raw_logits":
        return raw
    if mode == "processed_logprobs":
        return torch.log_softmax(processed, dim=-1)
    if mode == "processed_logits":
        return processed
    raise ValueError(f"logprobs_mode must be one of {list(LOGPROBS_MODES)}, got {mode!r}")


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Raw logprob of each row's target token, and the rows' top-k ids/logprobs when ``k`` > 0."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    lp = logp.gather(1, targets.to(torch.int64)[:, None]).squeeze(1)
    if k > 0:
        vals, ids = logp.topk(k, dim=-1)
        return lp, ids, vals
    return lp, None, None
