"""prepare_sampler_inputs against the pure-Python reference; seeds independent of the batch."""

from __future__ import annotations

import random

import numpy as np
import pytest
from deepinfer_engine import _engine as E
from inputs_helpers import make_args, make_buffers, pool_of, random_row
from inputs_reference.layout import RefRow, reference_layout
from inputs_reference.sampler import reference_sampler
from penalty_consumer import PenaltyTables, full_counts


def rich_sampling(rng):
    s = dict(temperature=rng.choice([0.0, 0.5, 1.0]), top_k=rng.choice([-1, 3, 40]), top_p=rng.choice([1.0, 0.8]),
             min_p=rng.choice([0.0, 0.05]), seed=rng.choice([None, rng.randrange(1 << 40)]),
             logprobs=rng.choice([-1, 0, 3]))
    if rng.random() < 0.4:
        s.update(presence_penalty=rng.choice([0.0, 0.5]), frequency_penalty=rng.choice([0.0, 0.3]),
                 repetition_penalty=rng.choice([1.0, 1.2]))
    if rng.random() < 0.3:
        s["logit_bias"] = {rng.randrange(1000): rng.uniform(-5, 5) for _ in range(rng.randint(1, 4))}
    if rng.random() < 0.3:
        s["banned_token_ids"] = rng.sample(range(1000), rng.randint(1, 5))
    if rng.random() < 0.2:
        s["allowed_token_ids"] = rng.sample(range(1000), rng.randint(1, 5))
    if rng.random() < 0.4:
        s.update(min_tokens=rng.randint(0, 60), eos_token_id=rng.randrange(1000),
                 stop_token_ids=rng.sample(range(1000), rng.randint(0, 3)))
    return s


def bad_words_for(rng, r):
    """Bad words for a row: one-token words, words ending the row's output so far (they match),
    words that do not, and one spanning the prompt's last token (never matched: only output counts)."""
    out = [r.token(p) for p in range(r.num_prompt, len(r.tokens) + len(r.drafts))]
    words = [[rng.randrange(1000)] for _ in range(rng.randint(0, 2))]
    for _ in range(rng.randint(1, 3)):
        k = rng.randint(1, 4)
        tail = out[len(out) - k:] if k <= len(out) else [rng.randrange(1000) for _ in range(k)]
        words.append([*tail, rng.randrange(1000)])
    words.append([rng.randrange(1000), rng.randrange(1000), rng.randrange(1000)])
    words.append([r.tokens[r.num_prompt - 1], *out[:1], rng.randrange(1000)])
    return words


def csr(offsets, values, r):
    return values[offsets[r]: offsets[r + 1]].tolist()


def check(si, rows, layout, tables=None):
    """Compares si with the reference; ``tables``: the PenaltyTables consumer of an incremental si
    (this call's updates are applied here)."""
    ref, plp, spec = reference_sampler(rows, layout)
    K, T, D = si.kernel, si.transform, si.driver
    assert K.num_rows == T.num_rows == D.num_rows == len(ref)
    if si.penalty_counts == "incremental":
        tables.apply(T)
        assert T.penalty_offsets.tolist() == [0] * (T.num_rows + 1) and len(T.penalty_token_ids) == 0
        assert len(T.penalty_output_counts) == len(T.penalty_in_prompt) == 0
    else:
        assert T.num_penalty_updates == 0 and T.num_penalty_slots == 0
        assert T.penalty_slots.tolist() == [-1] * T.num_rows and T.penalty_update_offsets.tolist() == [0]
    for r, e in enumerate(ref):
        assert K.logits_rows[r] == e["logits_row"]
        if not e["real"]:
            assert D.seq_ids[r] == -1 and K.temperature[r] == 0.0 and T.penalty_slots[r] == -1
            continue
        assert D.seq_ids[r] == e["seq_id"] and D.num_logprobs[r] == e["logprobs"]
        assert K.temperature[r] == np.float32(e["temperature"]) and K.top_k[r] == e["top_k"]
        assert K.top_p[r] == np.float32(e["top_p"]) and K.min_p[r] == np.float32(e["min_p"])
        assert K.offsets[r] == e["offset"]
        if e["seed"] is not None:
            assert K.seeds[r] == e["seed"]
        if si.penalty_counts == "incremental":
            assert (T.penalty_slots[r] >= 0) == bool(e["penalties"])
            assert tables.row_counts(T, r) == e["penalties"]
        else:
            assert full_counts(T, r) == e["penalties"]
            assert len(csr(T.penalty_offsets, T.penalty_token_ids, r)) == len(e["penalties"])  # no duplicates
        bias = list(zip(csr(T.bias_offsets, T.bias_token_ids, r), csr(T.bias_offsets, T.bias_values, r)))
        assert [t for t, _ in bias] == [t for t, _ in e["bias"]]
        np.testing.assert_allclose([v for _, v in bias], [v for _, v in e["bias"]], rtol=1e-6)
        assert csr(T.banned_offsets, T.banned_token_ids, r) == e["banned"]
        assert csr(T.allowed_offsets, T.allowed_token_ids, r) == e["allowed"]
    real = [e for e in ref if e["real"]]
    rnd = [e for e in real if e["temperature"] > 0]
    assert K.all_greedy == all(e["temperature"] == 0 for e in real)
    assert K.all_random == (bool(real) and all(e["temperature"] > 0 for e in real))
    assert K.no_top_k == all(e["top_k"] < 0 for e in rnd)
    assert K.no_top_p == all(e["top_p"] >= 1 for e in rnd)
    assert K.no_min_p == all(e["min_p"] <= 0 for e in rnd)
    assert T.no_penalties == (not any(e["penalties"] for e in real))
    assert si.prefill.sample_rows.tolist() == [r for r, e in enumerate(ref) if e["prompt"]]
    assert si.decode.sample_rows.tolist() == [r for r, e in enumerate(ref) if not e["prompt"]]
    assert si.decode.num_real_rows == sum(1 for e in ref if e["real"] and not e["prompt"])
    P = si.prompt_logprobs
    assert P.num_rows == len(plp)
    assert P.logits_rows.tolist() == [p["logits_row"] for p in plp]
    assert P.target_token_ids.tolist() == [p["target"] for p in plp]
    assert P.positions.tolist() == [p["position"] for p in plp]
    S = si.speculative
    assert S.num_seqs == len(spec)
    assert S.sample_rows.tolist() == [s["sample_row"] for s in spec]
    assert S.draft_token_ids.tolist() == [d for s in spec for d in s["drafts"]]
    assert S.target_logits_rows.tolist() == [d for s in spec for d in s["targets"]]
    assert S.bonus_logits_rows.tolist() == [s["bonus"] for s in spec]
    assert S.cu_num_drafts.tolist() == list(np.cumsum([0] + [len(s["drafts"]) for s in spec]))


@pytest.mark.parametrize("mode", ["full", "incremental"])
@pytest.mark.parametrize("seed", range(30))
def test_random_batches_match_reference(seed, mode):
    rng = random.Random(1000 + seed)
    decode_only = rng.random() < 0.4
    rows = []
    for i in range(rng.randint(1, 14)):
        r = random_row(rng, i, 16, kind="decode" if decode_only else None)
        r.sampling = rich_sampling(rng)
        if rng.random() < 0.4:
            r.sampling["bad_words_token_ids"] = bad_words_for(rng, r)
        rows.append(r)
    bufs = make_buffers(max_tokens=4096, max_seqs=32, width=32)
    sizes = [4, 8, 16, 32]
    args = make_args(bufs, graph_batch_sizes=sizes)
    pool = pool_of(rows)
    if decode_only:
        E.prepare_decode_v4(args, pool)
    else:
        E.prepare_prompt_v4(args, pool)
    si = E.prepare_sampler_inputs(args, pool, E.SamplerInputs(penalty_counts=mode))
    tables = PenaltyTables()
    layout = reference_layout(rows, block_size=16, width=32, graph_sizes=sizes, pad=decode_only)
    check(si, rows, layout, tables)
    # Second step on the same SamplerInputs (cached penalty counts / tables updated incrementally).
    for r in rows:
        if not r.is_prompt:
            r.tokens.append(rng.randrange(1000))
            r.start += 1
            r.block_table.append(rng.randrange(10_000))
    pool = pool_of(rows)
    E.prepare_prompt_v4(args, pool)
    E.prepare_sampler_inputs(args, pool, si)
    check(si, rows, reference_layout(rows, block_size=16, width=32), tables)


def test_seeded_row_identical_in_any_batch():
    rng = random.Random(5)
    target = RefRow(42, "seeded", list(range(30)), 20, 29, 1, [1, 2], sampling=dict(seed=1234, temperature=0.8))
    seen = set()
    for trial in range(5):
        others = [random_row(rng, 100 + j, 16, kind="decode") for j in range(rng.randint(0, 8))]
        rows = others[: trial] + [target] + others[trial:]
        bufs = make_buffers(max_tokens=1024, max_seqs=16, width=32)
        args = make_args(bufs, graph_batch_sizes=[16])
        pool = pool_of(rows)
        E.prepare_decode_v4(args, pool)
        si = E.prepare_sampler_inputs(args, pool, E.SamplerInputs())
        r = si.driver.seq_ids.tolist().index(42)
        seen.add((int(si.kernel.seeds[r]), int(si.kernel.offsets[r]), int(si.kernel.subsequences[r])))
    assert seen == {(1234, 10, 0)}
    # Unseeded requests: the derived seed depends only on (generator_seed, seq_id).
    a = E.SamplerInputs(7)
    unseeded = RefRow(9, "u", list(range(10)), 5, 9, 1, [3])
    for batch in ([unseeded], [random_row(rng, 1, 16, kind="decode"), unseeded]):
        bufs = make_buffers(max_tokens=256, max_seqs=4, width=32)
        args = make_args(bufs)
        pool = pool_of(batch)
        E.prepare_decode_v4(args, pool)
        E.prepare_sampler_inputs(args, pool, a)
        seen.add(int(a.kernel.seeds[len(batch) - 1]))
    assert len(seen) == 2


def test_views_survive_growth():
    rows = [RefRow(1, "a", [1, 2, 3], 2, 2, 1, [0], sampling=dict(repetition_penalty=1.1))]
    bufs = make_buffers(max_tokens=4096, max_seqs=32, width=32)
    args = make_args(bufs)
    si = E.SamplerInputs(penalty_counts="full")
    pool = pool_of(rows)
    E.prepare_decode_v4(args, pool)
    E.prepare_sampler_inputs(args, pool, si)
    old = si.transform.penalty_token_ids
    big = [RefRow(i, f"r{i}", list(range(i, i + 400)), 300, 399, 1, list(range(25)),
                  sampling=dict(frequency_penalty=0.5)) for i in range(20)]
    pool = pool_of(big)
    E.prepare_decode_v4(args, pool)
    E.prepare_sampler_inputs(args, pool, si)
    assert sorted(old.tolist()) == [1, 2, 3]
    assert si.transform.penalty_offsets[-1] == 20 * 400
    # Incremental mode: the update views too.
    si = E.SamplerInputs()
    pool = pool_of(rows)
    E.prepare_decode_v4(args, pool)
    E.prepare_sampler_inputs(args, pool, si)
    old_toks, old_offsets = si.transform.penalty_update_token_ids, si.transform.penalty_update_offsets
    pool = pool_of(big)
    E.prepare_decode_v4(args, pool)
    E.prepare_sampler_inputs(args, pool, si)
    assert old_toks.tolist() == [1, 2, 3] and old_offsets.tolist() == [0, 3]
    assert si.transform.num_penalty_updates == 20 and si.transform.penalty_update_offsets[-1] == 20 * 400


def test_stale_metadata_rejected():
    rows = [RefRow(1, "a", [1, 2, 3], 2, 2, 1, [0])]
    bufs = make_buffers(max_tokens=64, max_seqs=4, width=4)
    args = make_args(bufs)
    pool = pool_of(rows)
    E.prepare_decode_v4(args, pool)
    rows[0].add_to(pool)
    with pytest.raises(ValueError, match="metadata"):
        E.prepare_sampler_inputs(args, pool, E.SamplerInputs())
