"""Incremental penalty counts in the runtime: PenaltyTables (per-slot device tables fed by the
engine's updates) over many steps with preemption, aborts, n > 1 and slot reuse, against "full"
mode and the numpy reference; and the serving loop giving the same tokens in both modes."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch
from deepinfer.runtime.sampling.sampler import apply_logits_processing, sample
from deepinfer.runtime.sampling.sampler_inputs import PenaltyTables, sampling_batch_from_engine
from deepinfer.runtime.sampling_params import SamplingParams
from engine_helpers import make_loop, run_all
from numpy_reference import process_row

E = pytest.importorskip("deepinfer_engine._engine", reason="the C++ engine (deepinfer-engine) is not built/installed")
CPU = torch.device("cpu")


def buffers(max_tokens, max_seqs, width):
    return dict(input_ids=np.zeros(max_tokens, np.int32), positions=np.zeros(max_tokens, np.int32),
                slot_mapping=np.zeros(max_tokens, np.int64), query_start_loc=np.zeros(max_seqs + 1, np.int32),
                seq_lens=np.zeros(max_seqs, np.int32), block_tables=np.zeros((max_seqs, width), np.int32),
                logits_indices=np.zeros(max_tokens, np.int32))


@pytest.mark.parametrize("seed", range(4))
def test_tables_equal_full_mode_and_numpy_over_many_steps(seed):
    rng = random.Random(seed)
    V = 300
    sched = E.Scheduler(num_blocks=20, block_size=8, max_num_seqs=6, max_num_batched_tokens=64,
                        max_model_len=128, vocab_size=V)  # 20 blocks: preemption
    params = {}
    for i in range(16):
        p = dict(presence_penalty=rng.choice([0.0, 0.6]), frequency_penalty=rng.choice([0.0, 0.4]),
                 repetition_penalty=rng.choice([1.0, 1.3]))
        params[f"q{i}"] = p
        sched.add_request(f"q{i}", [rng.randrange(40) for _ in range(rng.randint(2, 50))],
                          E.SamplingParams(n=rng.choice([1, 1, 2]), max_tokens=rng.randint(1, 40),
                                           temperature=rng.choice([0.0, 1.0]), seed=i, **p))
    args = E.PrepareArgs(block_size=8, max_model_len=128, **buffers(128, 8, 16))
    pool = E.SequenceMetadataPool()
    si_inc, si_full = E.SamplerInputs(), E.SamplerInputs(penalty_counts="full")
    tables = PenaltyTables(CPU)
    g = np.random.default_rng(seed)
    checked = preempted = aborted = 0
    seqs_with_slots = set()
    while sched.has_unfinished_requests():
        out = sched.schedule()
        preempted += len(out.preempted_seq_ids)
        if out.is_empty:
            continue
        pool.build(sched)
        (E.prepare_decode_v4 if out.num_decodes == len(out) else E.prepare_prompt_v4)(args, pool)
        E.prepare_sampler_inputs(args, pool, si_full)
        E.prepare_sampler_inputs(args, pool, si_inc)
        rows, b_inc = sampling_batch_from_engine(si_inc, CPU, tables)
        _, b_full = sampling_batch_from_engine(si_full, CPU)
        logits = torch.from_numpy(g.normal(0, 3, (args.num_logits, V)).astype(np.float32))
        x_inc = apply_logits_processing(logits[rows], b_inc)
        assert torch.equal(x_inc, apply_logits_processing(logits[rows], b_full))
        for r, sid in enumerate(si_inc.driver.seq_ids.tolist()[: si_inc.driver.num_real_rows]):
            if sid < 0:
                continue
            seq = sched.get_sequence(sid)
            p = params[seq.request_id]
            toks = seq.token_ids.tolist()
            outs = toks[seq.num_prompt_tokens:]
            if p["presence_penalty"] or p["frequency_penalty"] or p["repetition_penalty"] != 1.0:
                seqs_with_slots.add(sid)
            ref = process_row(logits[rows[r]].numpy(), seen=set(toks), counts=Counter(outs),
                              repetition=p["repetition_penalty"], frequency=p["frequency_penalty"],
                              presence=p["presence_penalty"])
            np.testing.assert_allclose(x_inc[r].numpy(), ref, rtol=1e-5, atol=1e-5)
            checked += 1
        tokens = sample(logits[rows], b_inc).tokens[: si_inc.driver.num_real_rows]
        sched.update(tokens.to(torch.int32).numpy())
        if rng.random() < 0.05:
            try:  # finished requests are unknown: ValueError
                aborted += sched.abort_request(f"q{rng.randrange(16)}")
            except ValueError:
                pass
    assert checked > 100 and preempted > 0
    # Slots were freed and reused: far fewer slots than penalized sequences.
    assert si_inc.transform.num_penalty_slots < len(seqs_with_slots)
    assert tables.counts.shape[0] >= si_inc.transform.num_penalty_slots


def test_a_missed_call_is_detected_and_reset_recovers():
    sched = E.Scheduler(num_blocks=32, block_size=8, max_num_seqs=4, max_num_batched_tokens=64,
                        max_model_len=128, vocab_size=100)
    sched.add_request("a", [5, 6, 5], E.SamplingParams(max_tokens=8, temperature=0.0, frequency_penalty=0.5))
    args = E.PrepareArgs(block_size=8, max_model_len=128, **buffers(64, 4, 16))
    pool, si, tables = E.SequenceMetadataPool(), E.SamplerInputs(), PenaltyTables(CPU)

    def prepare():
        out = sched.schedule()
        pool.build(sched)
        (E.prepare_decode_v4 if out.num_decodes == len(out) else E.prepare_prompt_v4)(args, pool)
        E.prepare_sampler_inputs(args, pool, si)

    prepare()
    with pytest.raises(ValueError, match="tables: .*incremental"):  # the tables it feeds are required
        sampling_batch_from_engine(si, CPU)
    sampling_batch_from_engine(si, CPU, tables)
    sampling_batch_from_engine(si, CPU, tables)  # the same call twice: applied once
    assert tables.counts[0, 5].item() == 0 and bool(tables.seen[0, 5]) and not bool(tables.seen[0, 7])
    sched.update(np.array([7], np.int32))
    prepare()
    sched.update(np.array([7], np.int32))
    prepare()  # the previous call's updates were never applied
    with pytest.raises(RuntimeError, match="reset_penalty_tables"):
        sampling_batch_from_engine(si, CPU, tables)
    si.reset_penalty_tables()
    tables.reset()
    sched.update(np.array([5], np.int32))
    prepare()
    _, b = sampling_batch_from_engine(si, CPU, tables)
    assert b.penalty_rows.tolist() == [0]
    assert b.penalty_counts[0, 7].item() == 2 and b.penalty_counts[0, 5].item() == 1
    assert b.penalty_counts.sum().item() == 3 and b.penalty_seen[0].nonzero().flatten().tolist() == [5, 6, 7]


def test_serving_loop_gives_the_same_tokens_in_both_modes(loaded_default, tokenizer):
    """Greedy and seeded requests with penalties, few blocks (preemption likely), n > 1: the loop's
    incremental tables and full mode sample the same tokens."""
    prompts = [tokenizer(t).input_ids for t in ["the cat and the dog and the cat", "one two one two one",
                                                "Paris is", "a b a b a b a"]]
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.4),
              SamplingParams(temperature=1.0, seed=3, max_tokens=25, ignore_eos=True, frequency_penalty=0.8,
                             presence_penalty=0.5, n=2),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=35, ignore_eos=True, presence_penalty=1.5)]
    results = {}
    for mode in ("incremental", "full"):
        loop = make_loop(loaded_default, tokenizer, num_blocks=12, block_size=16, max_model_len=128,
                         max_num_seqs=8, max_num_batched_tokens=64)
        assert loop.executor.sampler_inputs.penalty_counts == "incremental"
        if mode == "full":
            loop.executor.sampler_inputs = E.SamplerInputs(loop.cfg.seed, penalty_counts="full")
        outs, _ = run_all(loop, prompts, params)
        results[mode] = [[list(c.token_ids) for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]
    assert results["incremental"] == results["full"]
    # The penalties acted: the greedy penalized request differs from the unpenalized greedy run.
    loop = make_loop(loaded_default, tokenizer)
    (plain,), _ = run_all(loop, prompts[:1], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    assert list(plain.outputs[0].token_ids) != results["incremental"][0][0]
