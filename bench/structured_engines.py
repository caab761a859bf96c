"""Compare grammar engines (xgrammar, llguidance, outlines-core) on the default model's tokenizer.

For each engine: the time to compile a JSON schema (nested object, array, enum, required fields)
and the per-token cost of computing the allowed-token mask while walking a valid answer token by
token (what the runtime does once per structured row per decode step). CPU only.

    python bench/structured_engines.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time

sys.path.insert(0, "deepinfer-meta/src")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "role", "tags", "address"],
}
ANSWER = json.dumps({"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "engines", "poetry"],
                     "address": {"city": "London", "zip": "W1"}}, separators=(",", ":"))


def main() -> None:
    from deepinfer.runtime.loading.default_model import default_model_path
    from deepinfer.runtime.loading.tokenizer_loader import load_tokenizer

    tok = load_tokenizer(default_model_path())
    ids = tok.encode(ANSWER, add_special_tokens=False)
    vocab = len(tok)
    print(f"tokenizer: {type(tok).__name__}, vocab {vocab}, answer {len(ids)} tokens")
    results = {}

    import numpy as np
    import torch
    import xgrammar as xgr
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[tok.eos_token_id])
    comp = xgr.GrammarCompiler(info, cache_enabled=False)
    t_setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    g = comp.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    t_compile = time.perf_counter() - t0
    m = xgr.GrammarMatcher(g)
    mask = xgr.allocate_token_bitmask(1, vocab)
    per = []
    for t in ids:
        s = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        ok = m.accept_token(t)
        per.append(time.perf_counter() - s)
        assert ok, t
    results["xgrammar"] = (t_setup, t_compile, statistics.median(per), max(per))

    import llguidance
    import llguidance.hf
    import llguidance.numpy
    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    t_setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    grm = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    mt = llguidance.LLMatcher(lltok, grm)
    t_compile = time.perf_counter() - t0
    assert not mt.is_error(), mt.get_error()
    bm = llguidance.numpy.allocate_token_bitmask(1, vocab)
    per = []
    for t in ids:
        s = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask(mt, bm, 0)
        ok = mt.consume_token(t)
        per.append(time.perf_counter() - s)
        assert ok, (t, mt.get_error())
    results["llguidance"] = (t_setup, t_compile, statistics.median(per), max(per))

    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    t0 = time.perf_counter()
    # outlines-core needs the vocabulary as decoded strings (it has no HF loader for a local tokenizer)
    eos = tok.eos_token_id
    voc: dict[str, list[int]] = {}
    for tid in range(vocab):
        if tid == eos:
            continue
        s = tok.convert_ids_to_tokens(tid)
        voc.setdefault(tok.convert_tokens_to_string([s]) if s is not None else "", []).append(tid)
    voc.pop("", None)
    vocabulary = Vocabulary(eos, voc)
    t_setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), vocabulary)
    t_compile = time.perf_counter() - t0
    guide = Guide(index)
    per = []
    bmask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    for t in ids:
        s = time.perf_counter()
        guide.write_mask_into(bmask.data_ptr(), bmask.numel(), bmask.element_size())
        guide.advance(t, return_tokens=False)
        per.append(time.perf_counter() - s)
    results["outlines-core"] = (t_setup, t_compile, statistics.median(per), max(per))
    del np

    print(f"{'engine':14s} {'tokenizer setup s':>18s} {'compile s':>10s} {'mask+accept us/token (median)':>30s} {'max us':>8s}")
    for k, (a, b, c, d) in results.items():
        print(f"{k:14s} {a:18.3f} {b:10.3f} {c * 1e6:30.1f} {d * 1e6:8.1f}")


if __name__ == "__main__":
    main()
