"""The draft-model method of speculative decoding through the engine loop (CPU): lossless against
the same loop without speculation, with the target itself as its draft (every draft kept) and
with a tiny random draft (few kept), over the n-gram method's cases: k variants, batches, n > 1,
prefix caching, preemption, stop strings, max_tokens, failed steps, the overlap loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer.runtime.sampling_params import SamplingParams
from test_speculative_engine import PROMPTS, make_loop, run, tokens_of


def spec(k):
    return {"method": "draft_model", "model": "(the loop takes the runner)", "num_speculative_tokens": k}


def draft_loop(loaded, tokenizer, draft, k=4, *, num_blocks=256, **kw):
    """An engine loop whose draft runner runs ``draft`` over a cache of the target's block count."""
    from deepinfer.runtime.engine.loop import EngineLoop
    from deepinfer.runtime.worker.model_runner import ModelRunner

    base = make_loop(loaded, tokenizer, None, num_blocks=num_blocks, **kw)  # the target's runner and config
    runner = ModelRunner(draft, num_blocks=num_blocks, block_size=16, device=torch.device("cpu"),
                         dtype=torch.float32)
    return EngineLoop(base.runner, tokenizer, base.cfg, overlap_scheduling=kw.get("overlap", False),
                      retry_failed_steps=kw.get("retry", False), speculative_config=spec(k), draft_runner=runner)


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory, loaded_default):
    """A tiny random Llama with the default model's vocabulary: a bad draft."""
    from deepinfer.runtime.loading.model_loader import load_model
    from tiny_models import save_tiny_model

    path = tmp_path_factory.mktemp("draft")
    save_tiny_model(path, "llama", seed=11, vocab=loaded_default.config.vocab_size)
    return load_model(str(path), device=torch.device("cpu"), dtype=torch.float32)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def baseline(loaded_default, tokenizer, prompt_ids):
    return tokens_of(run(make_loop(loaded_default, tokenizer), prompt_ids, SamplingParams(temperature=0,
                                                                                           max_tokens=40)))


def test_the_target_as_its_own_draft_keeps_every_draft(loaded_default, tokenizer, prompt_ids, baseline):
    loop = draft_loop(loaded_default, tokenizer, loaded_default, k=4)
    draft, q_lens = loop.speculator.draft, []
    real = draft._forward
    draft._forward = lambda ids, pos, tables, row_of, qsl, *a: q_lens.append(np.diff(qsl)) or real(
        ids, pos, tables, row_of, qsl, *a)
    assert tokens_of(run(loop, prompt_ids, SamplingParams(temperature=0, max_tokens=40))) == baseline
    # the draft catches up on a whole sequence once; after that on the bonus token and, when every
    # draft was kept, the last draft (the draft model fed the others itself)
    assert sum(int(q.max()) > 2 for q in q_lens) <= len(prompt_ids)
    st = loop.speculator.stats
    assert st.num_draft_tokens > 30 and st.acceptance_rate == 1.0, st.as_dict()
    assert st.per_position()[0] == 1.0  # (later positions: fewer drafts fit near max_tokens)
    assert loop.stats()["spec_decode_num_accepted_tokens"] == st.num_accepted_tokens  # reported as for n-gram


@pytest.mark.parametrize("k", [1, 3])
def test_a_random_draft_changes_nothing_but_acceptance(loaded_default, tokenizer, prompt_ids, baseline,
                                                       random_draft, k):
    loop = draft_loop(loaded_default, tokenizer, random_draft, k=k)
    assert tokens_of(run(loop, prompt_ids, SamplingParams(temperature=0, max_tokens=40))) == baseline
    st = loop.speculator.stats
    assert st.num_draft_tokens > 30 and st.acceptance_rate < 0.5, st.as_dict()


def test_max_tokens_and_stop_strings_hold(loaded_default, tokenizer, prompt_ids, random_draft):
    p = [SamplingParams(temperature=0, max_tokens=7), SamplingParams(temperature=0, max_tokens=40, stop=["fox"]),
         SamplingParams(temperature=0, max_tokens=13)]
    want = run(make_loop(loaded_default, tokenizer), prompt_ids, p)
    for draft in (loaded_default, random_draft):
        got = run(draft_loop(loaded_default, tokenizer, draft, k=4), prompt_ids, p)
        assert tokens_of(got) == tokens_of(want)
        assert [ro.outputs[0].text for ro in got] == [ro.outputs[0].text for ro in want]
        assert len(got[0].outputs[0].token_ids) == 7


def test_n_greater_than_one_and_prefix_caching(loaded_default, tokenizer, prompt_ids, baseline, monkeypatch):
    greedy = SamplingParams(temperature=0, max_tokens=40)
    loop = draft_loop(loaded_default, tokenizer, loaded_default, k=3)
    copies = {"target": [], "draft": []}  # block copies (the fork's partial block) reach both caches
    for name, runner in (("target", loop.runner), ("draft", loop.draft_runner)):
        real = runner.copy_blocks
        monkeypatch.setattr(runner, "copy_blocks", lambda s, d, real=real, name=name:
                            copies[name].append((list(s), list(d))) or real(s, d))
    assert tokens_of(run(loop, [prompt_ids[2]], greedy)) == [baseline[2]]
    # the same prompt again hits the prefix cache; n = 2 forks after the prompt
    outs = run(loop, [prompt_ids[2], prompt_ids[1]], [SamplingParams(n=2, temperature=0, max_tokens=40), greedy])
    assert tokens_of(outs) == [[baseline[2][0], baseline[2][0]], [baseline[1][0]]]
    assert loop.scheduler.block_manager.prefix_cache_hit_rate > 0
    assert copies["target"] and copies["draft"] == copies["target"]
    # every draft kept: the draft's KV of prefix-hit blocks and of the forked sample is right
    assert loop.speculator.stats.num_draft_tokens > 0 and loop.speculator.stats.acceptance_rate == 1.0


def test_preemption_keeps_the_greedy_output(loaded_default, tokenizer, prompt_ids, baseline):
    # 10 blocks of 16 for three ~90-token sequences: someone is preempted and recomputed (its
    # draft state starts over with the new blocks)
    loop = draft_loop(loaded_default, tokenizer, loaded_default, k=4, num_blocks=10, max_model_len=128)
    assert tokens_of(run(loop, prompt_ids, SamplingParams(temperature=0, max_tokens=40))) == baseline
    assert loop.scheduler.get_stats()["num_preemptions_total"] > 0
    assert loop.speculator.stats.acceptance_rate == 1.0  # the draft's KV after the recompute is right


def test_a_failed_step_is_recomputed_and_the_overlap_loop_runs_synchronously(loaded_default, tokenizer,
                                                                              prompt_ids, baseline, monkeypatch):
    loop = draft_loop(loaded_default, tokenizer, loaded_default, k=3, retry=True, overlap=True)
    draft = loop.speculator.draft
    real, calls = draft.propose, {"n": 0}

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("injected draft failure")
        return real(*a, **kw)

    monkeypatch.setattr(draft, "propose", flaky)
    assert tokens_of(run(loop, prompt_ids, SamplingParams(temperature=0, max_tokens=40))) == baseline
    assert calls["n"] > 5 and loop.overlap.num_ahead == 0
    assert loop.speculator.stats.acceptance_rate == 1.0


def test_sampled_requests_draft_from_q(loaded_default, tokenizer, prompt_ids, monkeypatch):
    """Temperature > 0: the draft samples and hands its distribution q to rejection sampling."""
    import deepinfer.runtime.speculative.speculator as sp

    seen = []
    real = sp.verify_drafts

    def spy(*a, **kw):
        seen.append(a[-1] if len(a) > 7 else kw.get("draft_probs"))
        return real(*a, **kw)

    monkeypatch.setattr(sp, "verify_drafts", spy)
    loop = draft_loop(loaded_default, tokenizer, loaded_default, k=3)
    outs = run(loop, prompt_ids, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20))
    assert all(len(ro.outputs[0].token_ids) == 20 or ro.outputs[0].finish_reason == "stop" for ro in outs)
    q = [x for x in seen if x is not None]
    assert q and all(torch.allclose(x.sum(-1), torch.ones(x.shape[0])) for x in q)
    # the target drafting for itself at the same temperature: q = p, so almost every draft is kept
    assert loop.speculator.stats.acceptance_rate > 0.9, loop.speculator.stats.as_dict()


def test_oracle_drafts_replace_a_draft_models_for_benchmarks(loaded_default, tokenizer, prompt_ids, baseline,
                                                              random_draft):
    """(bench) With recorded greedy runs, the random draft still runs every step but the oracle's
    drafts are verified: every draft kept, the output unchanged, the draft's time counted."""
    loop = draft_loop(loaded_default, tokenizer, random_draft, k=4)
    for p, b in zip(prompt_ids, baseline, strict=True):
        loop.speculator.record_oracle(p, b[0])
    assert tokens_of(run(loop, prompt_ids, SamplingParams(temperature=0, max_tokens=40))) == baseline
    draft = loop.speculator.draft
    assert loop.speculator.stats.acceptance_rate == 1.0
    assert draft.num_steps > 0 and draft.num_forwards >= draft.num_steps and draft.seconds > 0


def test_llm_with_a_gguf_draft_keeps_it_quantized_and_the_output(default_gguf):
    """``LLM`` on CPU with no dtype keeps GGUF projections quantized: the draft's too."""
    from deepinfer import LLM

    common = dict(max_model_len=256, cpu_kv_cache_bytes=32 << 20, device="cpu")
    p = SamplingParams(temperature=0, max_tokens=24)
    prompt = "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox"
    want = LLM(default_gguf, **common).generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(default_gguf, **common, speculative_config={"model": default_gguf, "num_speculative_tokens": 3})
    assert llm.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids == want
    assert llm.worker.draft_loaded.gguf is not None and llm.weight_format != "float32"  # both quantized
    assert llm.engine.speculator.stats.acceptance_rate > 0.9
