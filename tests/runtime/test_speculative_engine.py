"""Speculative decoding through the engine loop on the default model (CPU): lossless against the
same loop without speculation, with the engine's MTP bookkeeping (drafts scheduled as extra
query tokens, SpeculativeSamplingInputs, process_MTPInfo)."""

from __future__ import annotations

import pytest
import torch
from deepinfer.runtime.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}

PASSAGE = ("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
           "    return total / len(values)\n")
PROMPTS = [
    f"Rewrite this code, renaming `total` to `acc`.\n{PASSAGE}\nRewritten:\n",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4,",
]


def make_loop(loaded, tokenizer, spec=None, *, num_blocks=256, max_num_seqs=8, overlap=False, retry=False,
              prefix_caching=True, max_num_batched_tokens=512, max_model_len=512):
    pytest.importorskip("deepinfer_engine", reason="the C++ engine (deepinfer-engine) is not built/installed")
    from deepinfer.runtime.engine.loop import EngineConfig, EngineLoop
    from deepinfer.runtime.worker.model_runner import ModelRunner

    runner = ModelRunner(loaded, num_blocks=num_blocks, block_size=16, device=torch.device("cpu"),
                         dtype=torch.float32)
    cfg = EngineConfig(block_size=16, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                       vocab_size=loaded.config.vocab_size, eos_token_id=loaded.config.eos_token_ids[0],
                       enable_prefix_caching=prefix_caching)
    return EngineLoop(runner, tokenizer, cfg, overlap_scheduling=overlap, retry_failed_steps=retry,
                      speculative_config=spec)


def run(loop, prompts, params):
    ids = []
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for p, sp in zip(prompts, plist, strict=True):
        rid = loop.new_request_id()
        loop.add_request(rid, p, sp)
        ids.append(rid)
    done = {}
    for _ in range(5000):
        for ro in loop.step():
            if ro.finished:
                done[ro.request_id] = ro
        if len(done) == len(ids):
            break
    return [done[r] for r in ids]


def tokens_of(outs):
    return [[list(c.token_ids) for c in ro.outputs] for ro in outs]


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def baseline(loaded_default, tokenizer, prompt_ids):
    loop = make_loop(loaded_default, tokenizer)
    return tokens_of(run(loop, prompt_ids, SamplingParams(temperature=0, max_tokens=40)))


def test_greedy_output_is_token_for_token_the_non_speculative_output(loaded_default, tokenizer, prompt_ids,
                                                                     baseline):
    loop = make_loop(loaded_default, tokenizer, NGRAM)
    got = tokens_of(run(loop, prompt_ids, SamplingParams(temperature=0, max_tokens=40)))
    assert got == baseline
    st = loop.speculator.stats
    # the drafts were really verified and most steps kept some (input-grounded prompts)
    assert st.num_draft_tokens > 20 and st.num_accepted_tokens > 10, st
    assert loop.num_steps < 3 * 40  # fewer steps than one token per request per step


def test_batch_one_each_and_k_variants(loaded_default, tokenizer, prompt_ids, baseline):
    for k in (1, 3, 7):
        spec = dict(NGRAM, num_speculative_tokens=k)
        for i, ids in enumerate(prompt_ids[:2]):
            loop = make_loop(loaded_default, tokenizer, spec)
            assert tokens_of(run(loop, [ids], SamplingParams(temperature=0, max_tokens=40))) == [baseline[i]]


def test_oracle_drafts_are_all_kept(loaded_default, tokenizer, prompt_ids, baseline):
    loop = make_loop(loaded_default, tokenizer, {"method": "oracle", "num_speculative_tokens": 4})
    for ids, out in zip(prompt_ids, baseline, strict=True):
        loop.speculator.record_oracle(ids, out[0])
    got = tokens_of(run(loop, prompt_ids, SamplingParams(temperature=0, max_tokens=40)))
    assert got == baseline
    st = loop.speculator.stats
    assert st.acceptance_rate > 0.95 and st.mean_accepted_length > 4.5, st.as_dict()


def test_oracle_mode_keeps_every_greedy_draft_even_where_the_target_disagrees(loaded_default, tokenizer,
                                                                              prompt_ids, baseline):
    """Oracle mode is forced acceptance: a recording the model would never produce (here a
    counting run) is kept whole, so acceptance is 1.0 and the output follows the recording
    except at each step's bonus token (the target's own token after k kept drafts). On the GPU the
    verify and decode forwards may break near-ties differently: acceptance must not hang on that."""
    k, n = 4, 21
    loop = make_loop(loaded_default, tokenizer, {"method": "oracle", "num_speculative_tokens": k})
    recorded = [list(range(1000 + 7 * i, 1000 + 7 * i + n)) for i in range(len(prompt_ids))]
    for ids, rec in zip(prompt_ids, recorded, strict=True):
        loop.speculator.record_oracle(ids, rec)
    got = tokens_of(run(loop, prompt_ids, SamplingParams(temperature=0, max_tokens=n)))
    st = loop.speculator.stats
    assert st.num_draft_tokens >= len(prompt_ids) * 4 * k and st.acceptance_rate == 1.0, st.as_dict()
    for (out,), rec, base in zip(got, recorded, baseline, strict=True):
        assert len(out) == n and out[0] == base[0][0]  # the first token is the prefill's own
        # token j (j >= 1) was a draft unless it is a step's bonus token (j = 5, 10, ... with k = 4)
        drafted = [j for j in range(1, n) if j % (k + 1) != 0]
        assert [out[j] for j in drafted] == [rec[j] for j in drafted]
        # and the recording is not what the model says: equality above is forced, not agreement
        assert out != base[0]


def test_max_tokens_and_stop_strings_hold(loaded_default, tokenizer, prompt_ids):
    base = make_loop(loaded_default, tokenizer)
    spec = make_loop(loaded_default, tokenizer, NGRAM)
    for mt in (1, 2, 5, 13):
        p = SamplingParams(temperature=0, max_tokens=mt)
        a, b = run(base, prompt_ids, p), run(spec, prompt_ids, p)
        assert tokens_of(a) == tokens_of(b)
        assert all(len(c.token_ids) == mt for ro in b for c in ro.outputs if c.finish_reason == "length")
    text = run(base, prompt_ids[:1], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0].text
    stop = text[10:14]
    p = SamplingParams(temperature=0, max_tokens=40, stop=[stop])
    a, b = run(base, prompt_ids[:1], p)[0].outputs[0], run(spec, prompt_ids[:1], p)[0].outputs[0]
    assert (b.text, list(b.token_ids), b.finish_reason, b.stop_reason) == \
        (a.text, list(a.token_ids), a.finish_reason, a.stop_reason)
    assert b.finish_reason == "stop" and stop not in b.text


def test_stop_token_inside_the_accepted_run_ends_there(loaded_default, tokenizer, prompt_ids, baseline):
    out = baseline[2][0]
    stop_tok = out[6]
    p = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_tok])
    a = run(make_loop(loaded_default, tokenizer), prompt_ids[2:], p)[0].outputs[0]
    b = run(make_loop(loaded_default, tokenizer, NGRAM), prompt_ids[2:], p)[0].outputs[0]
    assert list(b.token_ids) == list(a.token_ids) == out[:out.index(stop_tok) + 1]


def test_logprobs_of_accepted_tokens_match(loaded_default, tokenizer, prompt_ids):
    p = SamplingParams(temperature=0, max_tokens=24, logprobs=3)
    a = run(make_loop(loaded_default, tokenizer), prompt_ids, p)
    spec = make_loop(loaded_default, tokenizer, NGRAM)
    b = run(spec, prompt_ids, p)
    assert spec.speculator.stats.num_accepted_tokens > 0
    for ra, rb in zip(a, b, strict=True):
        ca, cb = ra.outputs[0], rb.outputs[0]
        assert list(ca.token_ids) == list(cb.token_ids)
        assert cb.cumulative_logprob == pytest.approx(ca.cumulative_logprob, abs=1e-3)
        for la, lb in zip(ca.logprobs, cb.logprobs, strict=True):
            assert list(la) == list(lb)  # the same top-k ids (and the token), in order
            for t in la:
                assert lb[t] == pytest.approx(la[t], abs=1e-3)


def test_penalties_bias_and_seeds_sample_as_without_speculation(loaded_default, tokenizer, prompt_ids):
    params = [SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=20, logit_bias={int(prompt_ids[1][3]): 5.0}),
              SamplingParams(temperature=0.8, max_tokens=20, seed=7, frequency_penalty=0.5)]
    a = run(make_loop(loaded_default, tokenizer), prompt_ids, params)
    b = run(make_loop(loaded_default, tokenizer, NGRAM), prompt_ids, params)
    assert tokens_of(a) == tokens_of(b)


def test_n_greater_than_one_prefix_caching_and_mixed_batches(loaded_default, tokenizer, prompt_ids, baseline):
    spec = make_loop(loaded_default, tokenizer, NGRAM)
    greedy = SamplingParams(temperature=0, max_tokens=40)
    # the same prompt again (it hits the prefix cache, its drafts too), with n = 2 greedy samples
    assert tokens_of(run(spec, [prompt_ids[0]], greedy)) == [[baseline[0][0]]]
    outs = run(spec, [prompt_ids[0], prompt_ids[1]], [SamplingParams(n=2, temperature=0, max_tokens=40), greedy])
    assert tokens_of(outs) == [[baseline[0][0], baseline[0][0]], [baseline[1][0]]]
    assert spec.scheduler.block_manager.prefix_cache_hit_rate > 0
    # n = 3 random samples: three completions of the right length
    outs = run(spec, prompt_ids[:1], SamplingParams(n=3, temperature=1.0, max_tokens=12))
    assert [len(c.token_ids) for c in outs[0].outputs if c.finish_reason == "length"] == \
        [12] * sum(c.finish_reason == "length" for c in outs[0].outputs)


def test_preemption_keeps_the_greedy_output(loaded_default, tokenizer, prompt_ids, baseline):
    # 10 blocks of 16 for three ~90-token sequences: someone is preempted and recomputed
    spec = make_loop(loaded_default, tokenizer, NGRAM, num_blocks=10, max_model_len=128)
    base = make_loop(loaded_default, tokenizer, num_blocks=10, max_model_len=128)
    p = SamplingParams(temperature=0, max_tokens=40)
    assert tokens_of(run(spec, prompt_ids, p)) == tokens_of(run(base, prompt_ids, p)) == baseline
    assert spec.scheduler.get_stats()["num_preemptions_total"] > 0


def test_overlap_loop_runs_verify_steps_synchronously(loaded_default, tokenizer, prompt_ids, baseline):
    # (a step launched ahead with drafts would raise in the executor; plain steps without drafts
    # do run ahead: test_speculative_overlap)
    loop = make_loop(loaded_default, tokenizer, NGRAM, overlap=True)
    assert tokens_of(run(loop, prompt_ids, SamplingParams(temperature=0, max_tokens=40))) == baseline
    assert loop.speculator.stats.num_accepted_tokens > 0


def test_a_failed_verify_step_is_recomputed(loaded_default, tokenizer, prompt_ids, baseline, monkeypatch):
    loop = make_loop(loaded_default, tokenizer, NGRAM, retry=True)
    calls = {"n": 0}

    def flaky(real):
        def call(*a, **kw):
            calls["n"] += 1
            if calls["n"] == 6:
                raise RuntimeError("injected verify failure")
            return real(*a, **kw)
        return call

    # (plain-greedy steps verify through verify_greedy, the others through verify)
    for name in ("verify", "verify_greedy"):
        monkeypatch.setattr(loop.speculator, name, flaky(getattr(loop.speculator, name)))
    assert tokens_of(run(loop, prompt_ids, SamplingParams(temperature=0, max_tokens=40))) == baseline
    assert calls["n"] > 6


def test_temperature_sampling_runs_and_is_plausible(loaded_default, tokenizer, prompt_ids):
    loop = make_loop(loaded_default, tokenizer, NGRAM)
    outs = run(loop, prompt_ids, SamplingParams(temperature=0.7, top_p=0.9, top_k=50, max_tokens=30))
    assert all(len(ro.outputs[0].token_ids) >= 1 for ro in outs)
    assert loop.speculator.stats.num_draft_tokens > 0


def test_the_speculative_sampling_inputs_name_the_bonus_row(loaded_default, tokenizer, prompt_ids):
    """The engine's SpeculativeSamplingInputs (what Speculator.verify reads): a row with d drafts
    has d target rows then its bonus row, which is the row the ordinary sampler reads."""
    loop = make_loop(loaded_default, tokenizer, NGRAM)
    seen = []
    real = loop.speculator.verify

    def spy(si, logits, rows, batch, res, drafted=None):
        S = si.speculative
        for s in range(int(S.num_seqs)):
            a, b = int(S.cu_num_drafts[s]), int(S.cu_num_drafts[s + 1])
            tr = list(S.target_logits_rows[a:b])
            assert tr == list(range(tr[0], tr[0] + b - a))
            assert int(S.bonus_logits_rows[s]) == tr[-1] + 1 == int(rows[int(S.sample_rows[s])])
            seen.append(b - a)
        return real(si, logits, rows, batch, res, drafted)

    loop.speculator.verify = spy
    # (logprobs: steps of plain-greedy rows verify through verify_greedy, which takes no rows)
    run(loop, prompt_ids, SamplingParams(temperature=0, max_tokens=20, logprobs=1))
    assert seen and max(seen) <= 4


def test_torch_path_without_native_kernels(loaded_default, tokenizer, prompt_ids):
    """Without the native CPU kernels every step (decode and verify) runs the torch forward."""
    p = SamplingParams(temperature=0, max_tokens=30)
    base, spec = make_loop(loaded_default, tokenizer), make_loop(loaded_default, tokenizer, NGRAM)
    base.runner.native_decode = spec.runner.native_decode = None
    assert tokens_of(run(spec, prompt_ids, p)) == tokens_of(run(base, prompt_ids, p))
    assert spec.speculator.stats.num_accepted_tokens > 0


def test_verify_steps_run_on_the_native_kernels_when_present(loaded_default, tokenizer, prompt_ids, monkeypatch):
    spec = make_loop(loaded_default, tokenizer, NGRAM)
    if spec.runner.native_decode is None:
        pytest.skip("the native CPU decode kernels are not built")
    assert spec.runner.native_verify_tokens == 5
    calls = []
    real = spec.runner.native_decode.step
    monkeypatch.setattr(spec.runner.native_decode, "step", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    run(spec, prompt_ids[:1], SamplingParams(temperature=0, max_tokens=30))
    assert calls and spec.speculator.stats.num_draft_tokens > 0


def test_abort_between_verify_steps_leaves_the_others_exact(loaded_default, tokenizer, prompt_ids, baseline):
    loop = make_loop(loaded_default, tokenizer, NGRAM)
    p = SamplingParams(temperature=0, max_tokens=40)
    ids = []
    for q in prompt_ids:
        rid = loop.new_request_id()
        loop.add_request(rid, q, p)
        ids.append(rid)
    done = {}
    for n in range(500):
        if n == 3:
            loop.abort(ids[1])
        for ro in loop.step():
            if ro.finished:
                done[ro.request_id] = ro
        if len(done) == 3:
            break
    assert done[ids[1]].outputs[0].finish_reason == "abort"
    assert [list(done[r].outputs[0].token_ids) for r in (ids[0], ids[2])] == [baseline[0][0], baseline[2][0]]
    loop.scheduler.check_invariants()
