"""Sampling through the serving loop: seeds, n > 1, logprobs, penalties via the engine's SamplerInputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer.runtime.sampling.sampler import apply_logits_processing
from deepinfer.runtime.sampling.sampler_inputs import sampling_batch_from_engine
from deepinfer.runtime.sampling_params import SamplingParams
from engine_helpers import make_loop, run_all
from numpy_reference import log_softmax, process_row


@pytest.fixture(scope="module")
def loop(loaded_default, tokenizer):
    return make_loop(loaded_default, tokenizer)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [tokenizer(t).input_ids for t in ["Once upon a time", "The best way to learn is", "Paris is"]]


def test_seeded_request_alone_equals_in_mixed_batch(loop, prompt_ids):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone, _ = run_all(loop, [prompt_ids[0]], seeded)
    others = [SamplingParams(temperature=0.0, max_tokens=6), SamplingParams(temperature=1.5, max_tokens=12, seed=9)]
    mixed, _ = run_all(loop, [prompt_ids[1], prompt_ids[0], prompt_ids[2]], [others[0], seeded, others[1]])
    assert list(mixed[1].outputs[0].token_ids) == list(alone[0].outputs[0].token_ids)
    other_seed, _ = run_all(loop, [prompt_ids[0]],
                            SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=10, ignore_eos=True))
    assert list(other_seed[0].outputs[0].token_ids) != list(alone[0].outputs[0].token_ids)


def test_n_samples_are_distinct_and_share_the_prompt_blocks(loop, tokenizer):
    prompt = tokenizer("My favourite things in the whole world, in no particular order, are these: reading old "
                       "books, long walks by the sea at sunrise, the smell of fresh bread in a small bakery, the sound "
                       "of rain on a tin roof, and").input_ids
    assert len(prompt) > 2 * 16  # more than two full blocks of 16 tokens
    rid = loop.new_request_id()
    loop.add_request(rid, prompt, SamplingParams(n=4, temperature=1.5, seed=7, max_tokens=8, ignore_eos=True))
    shared_checked = False
    final = None
    while final is None:
        for ro in loop.step():
            if ro.request_id == rid and ro.finished:
                final = ro
        if not shared_checked and final is None:
            seqs = loop.scheduler.get_sequences(rid)
            if len(seqs) == 4:
                full = len(prompt) // 16
                tables = [list(s.block_table)[:full] for s in seqs]
                assert all(t == tables[0] for t in tables)  # full prompt blocks are shared
                shared_checked = True
    assert shared_checked
    samples = [tuple(c.token_ids) for c in final.outputs]
    assert len(samples) == 4 and len(set(samples)) == 4
    assert sorted(c.index for c in final.outputs) == [0, 1, 2, 3]


def test_logprobs_equal_log_softmax_of_reference_logits(loop, prompt_ids, hf_default):
    prompt = prompt_ids[2]
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    (out,), _ = run_all(loop, [prompt], params)
    c = out.outputs[0]
    toks = list(c.token_ids)
    with torch.no_grad():
        logits = hf_default(torch.tensor([prompt + toks])).logits[0].numpy()
    ref = log_softmax(logits)
    for i, (t, lp) in enumerate(zip(toks, c.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert lp[t] == pytest.approx(row[t], abs=2e-3)
        top = np.argsort(-row)[:3]
        for tid in top:
            assert int(tid) in lp and lp[int(tid)] == pytest.approx(row[tid], abs=2e-3)
    assert c.cumulative_logprob == pytest.approx(sum(ref[len(prompt) - 1 + i][t] for i, t in enumerate(toks)),
                                                 abs=1e-2)
    plp = out.prompt_logprobs
    assert plp[0] is None and len(plp) == len(prompt)
    for pos in range(1, len(prompt)):
        assert plp[pos][prompt[pos]] == pytest.approx(ref[pos - 1][prompt[pos]], abs=2e-3)


def test_engine_sampler_inputs_drive_penalties_bias_and_bans(loop, tokenizer):
    """The adapter turns the engine's CSR lists into the same processed logits as the numpy reference."""
    from deepinfer._C import engine as E

    prompt = tokenizer("the cat and the dog and the bird").input_ids
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=6, min_tokens=4, repetition_penalty=1.3,
                            frequency_penalty=0.4, presence_penalty=0.3, logit_bias={17: 2.5, 900: -1.0},
                            ignore_eos=False)
    rid = loop.new_request_id()
    loop.add_request(rid, prompt, params)
    outputs: list[int] = []
    checked = 0
    while True:
        out = loop.scheduler.schedule()
        ex = loop.executor
        ex.metadata.build(loop.scheduler)
        n = (E.prepare_decode_v4 if out.num_decodes == len(ex.metadata) else E.prepare_prompt_v4)(
            ex.args[0], ex.metadata)
        si = E.prepare_sampler_inputs(ex.args[0], ex.metadata, ex.sampler_inputs)
        _, batch = sampling_batch_from_engine(si, torch.device("cpu"), ex.penalty_tables)
        fake = torch.from_numpy(np.random.default_rng(len(outputs)).normal(0, 3, (1, loop.cfg.vocab_size))
                                .astype(np.float32))
        got = apply_logits_processing(fake, batch)[0].numpy()
        counts = {t: outputs.count(t) for t in set(outputs)}
        banned = [loop.cfg.eos_token_id] if len(outputs) < params.min_tokens else []
        ref = process_row(fake[0].numpy(), bias=params.logit_bias, banned=banned, seen=set(prompt) | set(outputs),
                          counts=counts, repetition=1.3, frequency=0.4, presence=0.3)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
        checked += 1
        tok = int(np.argmax(got))  # drive the sequence with the processed logits' argmax
        loop.scheduler.update(np.array([tok], dtype=np.int32))
        outputs.append(tok)
        loop._collect_outputs()
        del n
        if len(outputs) == params.max_tokens or rid not in loop.requests:
            break
    assert checked >= 4


def test_plain_greedy_steps_take_the_argmax_without_the_sampler(loop, prompt_ids, monkeypatch):
    # Plain-greedy steps skip SamplingBatch and sample(): the same tokens as the full sampler,
    # alone and batched with a request that does need it (then the whole step goes through it).
    from deepinfer.runtime.engine import executor as engine_executor

    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    penalized = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3)
    calls = []
    real_sample = engine_executor.sample
    monkeypatch.setattr(engine_executor, "sample", lambda *a, **k: calls.append(1) or real_sample(*a, **k))
    fast, _ = run_all(loop, prompt_ids, greedy)
    assert not calls  # every step of an all-greedy batch took the argmax path
    fast_mixed, _ = run_all(loop, prompt_ids, [greedy, penalized, greedy])
    assert calls  # the penalized request sends its steps through the sampler
    monkeypatch.setattr(engine_executor, "is_plain_greedy", lambda si: False)
    full, _ = run_all(loop, prompt_ids, greedy)
    full_mixed, _ = run_all(loop, prompt_ids, [greedy, penalized, greedy])
    for a, b in [(fast, full), (fast_mixed, full_mixed)]:
        assert [list(r.outputs[0].token_ids) for r in a] == [list(r.outputs[0].token_ids) for r in b]
