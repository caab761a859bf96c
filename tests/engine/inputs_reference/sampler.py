"""Reference of prepare_sampler_inputs (plain Python, from the RefRow list and the layout reference)."""

from __future__ import annotations

from collections import Counter

from .layout import PAD, PROMPT_LOGPROB


def reference_sampler(rows, layout):
    """Per sample row dicts + prompt-logprob rows + speculative lists, from the same step."""
    kinds, lrow, lpos = layout["logit_kind"], layout["logit_row"], layout["logit_position"]
    last_logit = {}
    first_logit = {}
    for k, i in enumerate(lrow):
        last_logit[i] = k
        first_logit.setdefault(i, k)
    out = []
    spec = []
    for i in range(layout["num_rows"]):
        if i >= len(rows):
            out.append(dict(real=False, logits_row=last_logit[i], prompt=False))
            continue
        r = rows[i]
        if not (not r.is_prompt or r.end == len(r.tokens)):
            continue  # mid-prefill chunk: no sample row
        s = r.sampling
        num_out = lpos[last_logit[i]] + 1 - r.num_prompt
        toks = r.tokens
        if s.get("presence_penalty", 0) or s.get("frequency_penalty", 0) or s.get("repetition_penalty", 1) != 1:
            outc = Counter(toks[r.num_prompt:])
            inp = set(toks[: r.num_prompt])
            pen = {t: (outc.get(t, 0), int(t in inp)) for t in set(toks)}
        else:
            pen = {}
        banned = set(s.get("banned_token_ids") or [])
        # vLLM's bad words: a word's last token is banned when the output tokens before the
        # sampled one end with its other tokens (the pending token of a ZOS row is unknown: then
        # only one-token words)
        words = s.get("bad_words_token_ids") or []
        if words:
            known_end = len(toks) + (0 if r.zos_src >= 0 else len(r.drafts))
            hist = [r.token(p) for p in range(r.num_prompt, min(r.num_prompt + max(num_out, 0), known_end))]
            complete = len(hist) == max(num_out, 0)
            for w in words:
                k = len(w) - 1
                if k == 0 or (complete and k <= len(hist) and hist[len(hist) - k:] == w[:-1]):
                    banned.add(w[-1])
        if num_out < s.get("min_tokens", 0):
            banned |= set(s.get("stop_token_ids") or [])
            if s.get("eos_token_id", -1) >= 0:
                banned.add(s["eos_token_id"])
        out.append(dict(
            real=True, prompt=r.is_prompt, logits_row=last_logit[i], seq_id=r.seq_id,
            temperature=s.get("temperature", 1.0), top_k=s.get("top_k", -1), top_p=s.get("top_p", 1.0),
            min_p=s.get("min_p", 0.0), seed=s.get("seed"), offset=num_out, penalties=pen,
            bias=sorted((s.get("logit_bias") or {}).items()), banned=sorted(banned),
            allowed=sorted(set(s.get("allowed_token_ids") or [])), logprobs=s.get("logprobs", -1),
        ))
        if r.drafts and not r.is_prompt and r.zos_src < 0:
            k0 = first_logit[i]
            spec.append(dict(sample_row=len(out) - 1, drafts=list(r.drafts[: r.num_new - 1]),
                             targets=[k0 + d for d in range(r.num_new - 1)], bonus=k0 + r.num_new - 1))
    plp = []
    for k, kind in enumerate(kinds):
        if kind == PROMPT_LOGPROB:
            r = rows[lrow[k]]
            plp.append(dict(logits_row=k, target=r.tokens[lpos[k] + 1], position=lpos[k] + 1, seq_id=r.seq_id))
    assert all(kinds[d["logits_row"]] != PAD for d in out if d["real"])
    return out, plp, spec
