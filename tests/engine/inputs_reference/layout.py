"""Reference of the flattened var-len model-input layout of prepare_prompt_v4 / prepare_decode_v4.

A step is a list of RefRow (one per batch row, in order). Everything is recomputed from scratch
with plain Python loops; the C++ builders must produce exactly these arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .engram import engram_rows

SAMPLE, PROMPT_LOGPROB, PAD = 0, 1, 2


@dataclass
class RefRow:
    seq_id: int
    request_id: str
    tokens: list[int]          # prompt + outputs known on the host
    num_prompt: int
    start: int                 # num_computed_tokens
    num_new: int
    block_table: list[int]
    drafts: list[int] = field(default_factory=list)
    is_prompt: bool | None = None
    prompt_logprobs: int = -1
    sampling: dict = field(default_factory=dict)   # SamplingParams fields (-1: None), plus eos_token_id
    zos_src: int = -1          # ZOS: logits row of step N holding the pending token, -1 host-known
    plp_done: int = 0          # prompt positions whose logprobs the request already holds

    def __post_init__(self):
        if self.is_prompt is None:
            self.is_prompt = self.start < len(self.tokens) - 1

    @property
    def end(self):
        return self.start + self.num_new

    def token(self, p):
        return self.tokens[p] if p < len(self.tokens) else self.drafts[p - len(self.tokens)]

    def params(self):
        """The row's engine SamplingParams (the pool never stops a row: max_tokens only bounds min_tokens)."""
        from deepinfer_engine import _engine as E

        kw = {k: v for k, v in self.sampling.items() if k != "eos_token_id"}
        for k in ("logprobs", "prompt_logprobs"):
            if kw.get(k) == -1:
                kw[k] = None
        if self.prompt_logprobs >= 0:
            kw["prompt_logprobs"] = self.prompt_logprobs
        kw.setdefault("max_tokens", max(16, kw.get("min_tokens", 0)))
        return E.SamplingParams(**kw)

    def add_to(self, pool):
        pool.add_sequence(seq_id=self.seq_id, request_id=self.request_id, token_ids=self.tokens,
                          num_prompt_tokens=self.num_prompt, num_computed_tokens=self.start,
                          num_new_tokens=self.num_new, block_table=self.block_table,
                          draft_tokens=self.drafts or None, is_prompt=self.is_prompt,
                          params=self.params(), eos_token_id=self.sampling.get("eos_token_id", -1))


def next_graph_size(n, sizes):
    bigger = [s for s in sorted(sizes) if s >= n]
    return bigger[0] if bigger else n


def reference_layout(rows, *, block_size, width, graph_sizes=(), pad=False, yoco="NONE", engram=None,
                     engram_table=None, zos_prev=None):
    """Returns a dict of numpy arrays (the used prefix of every buffer) plus per-logits-row info.

    zos_prev: {seq_id: step-N logits row} of sequences whose token of step N is pending; their
    decode rows become one token at position len(tokens), sourced from that row.
    """
    rows = [RefRow(**{**r.__dict__}) for r in rows]
    if zos_prev is not None:
        for r in rows:
            if not r.is_prompt and r.seq_id in zos_prev:
                r.start, r.num_new, r.zos_src, r.drafts = len(r.tokens), 1, zos_prev[r.seq_id], []
    n = len(rows)
    num_rows = next_graph_size(n, graph_sizes) if pad else n
    q_pad = max([r.num_new for r in rows] + [1])
    ids, pos, slots, src, logits, kinds, lrow, lpos, kept, cu_kept = [], [], [], [], [], [], [], [], [], [0]
    qsl, seq_lens = [0], []
    bt = np.zeros((num_rows, width), np.int32)
    eng = []
    for i in range(num_rows):
        if i < n:
            r = rows[i]
            base = len(ids)
            for p in range(r.start, r.end):
                ids.append(0 if r.zos_src >= 0 else r.token(p))
                pos.append(p)
                slots.append(r.block_table[p // block_size] * block_size + p % block_size)
                src.append(r.zos_src)
            if engram is not None:
                known = r.tokens + r.drafts
                eng.extend(engram_rows(known, range(r.start, r.end), engram, engram_table))
            my_logits = []
            if r.is_prompt and r.zos_src < 0:
                if r.prompt_logprobs >= 0:
                    for p in range(max(r.start, r.plp_done), min(r.end, r.num_prompt - 1)):
                        my_logits.append((base + p - r.start, PROMPT_LOGPROB, p))
                if r.end == len(r.tokens):
                    my_logits.append((base + r.num_new - 1, SAMPLE, r.end - 1))
            else:
                my_logits = [(base + j, SAMPLE, r.start + j) for j in range(r.num_new)]
            seq_lens.append(r.end)
            bt[i, : len(r.block_table)] = r.block_table
            last = base + r.num_new - 1
        else:
            base = len(ids)
            for _ in range(q_pad):
                ids.append(0)
                pos.append(0)
                slots.append(-1)
                src.append(-1)
            if engram is not None:
                eng.extend([[0] * engram.num_columns] * q_pad)
            my_logits = [(base + j, PAD, 0) for j in range(q_pad)]
            seq_lens.append(q_pad)
            last = base + q_pad - 1
        for row, kind, p in my_logits:
            logits.append(row)
            kinds.append(kind)
            lrow.append(i)
            lpos.append(p)
        if yoco == "LAST_TOKEN":
            kept.append(last)
        elif yoco == "LOGITS_ROWS":
            kept.extend(row for row, _, _ in my_logits)
        cu_kept.append(len(kept))
        qsl.append(len(ids))
    out = dict(
        input_ids=np.array(ids, np.int32), positions=np.array(pos, np.int32),
        slot_mapping=np.array(slots, np.int64), query_start_loc=np.array(qsl, np.int32),
        seq_lens=np.array(seq_lens, np.int32), block_tables=bt, logits_indices=np.array(logits, np.int32),
        zos_source_index=np.array(src, np.int32),
        logit_kind=kinds, logit_row=lrow, logit_position=lpos, num_rows=num_rows,
    )
    if yoco != "NONE":
        out["yoco_kept_rows"] = np.array(kept, np.int32)
        out["yoco_cu_seqlens"] = np.array(cu_kept, np.int32)
    if engram is not None:
        out["engram_indices"] = np.array(eng, np.int32).reshape(-1, engram.num_columns)
    return out
