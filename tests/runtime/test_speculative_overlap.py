"""Speculative decoding under the overlap loop (ZOS, ``overlap_scheduling``) on the default model
(CPU, where the overlap path runs synchronously but in the same order as on a GPU).

Verify steps (rows with drafts) still run synchronously; plain decode steps of a speculating loop
(no sequence drafts: n-gram lookups that miss, requests that may not draft) are launched ahead of
the step before them, and a step that no step runs ahead of stores the next drafts, so
speculation resumes. The cases follow vLLM's async-scheduling tests with speculation
(tests/v1/e2e/test_async_scheduling.py): the same output as the synchronous loop and as no
speculation, over penalties, seeds, stop strings, max_tokens, n > 1, prefix caching,
preemption, abort and failed steps, with the acceptance rate not lower than the synchronous one's
by more than a little."""

from __future__ import annotations

import pytest
from deepinfer.runtime.sampling_params import SamplingParams
from test_speculative_engine import NGRAM, PROMPTS, make_loop, run, tokens_of

# lookup 2-5 (the defaults): the free-text prompts' lookups miss, so plain steps run ahead there
SPEC = dict(NGRAM, prompt_lookup_min=2, prompt_lookup_max=5)
MIXED = PROMPTS + ["Tell me about the number 7: "]
GREEDY = SamplingParams(temperature=0, max_tokens=40)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [tokenizer.encode(p) for p in MIXED]


@pytest.fixture(scope="module")
def baseline(loaded_default, tokenizer, prompt_ids):
    return tokens_of(run(make_loop(loaded_default, tokenizer), prompt_ids, GREEDY))


def watch(loop, monkeypatch):
    """Log the loop's step launches and token reads in order: ("launch", step, the step it runs
    ahead of or None, drafts scheduled) and ("read", step)."""
    from deepinfer.runtime.engine.executor import LaunchedStep

    events: list[tuple] = []
    launch = loop.executor.launch

    def logged_launch(scheduled, prev=None, **kw):
        drafts = int(scheduled.num_decode_tokens) - int(scheduled.num_decodes)
        step = launch(scheduled, prev, **kw)
        step.watch_no = len(events)  # (not id(): ids of collected steps are reused)
        events.append(("launch", step.watch_no, None if prev is None else prev.watch_no, drafts))
        return step

    tokens = LaunchedStep.tokens

    def logged_tokens(self):
        events.append(("read", self.watch_no))
        return tokens(self)

    monkeypatch.setattr(loop.executor, "launch", logged_launch)
    monkeypatch.setattr(LaunchedStep, "tokens", logged_tokens)
    return events


def launched_before_read(events):
    """Steps launched before the tokens of the step they run ahead of were read."""
    read_at = {}
    for i, e in enumerate(events):
        if e[0] == "read":
            read_at.setdefault(e[1], i)
    return [i for i, e in enumerate(events)
            if e[0] == "launch" and e[2] is not None and i < read_at.get(e[2], len(events))]


def test_plain_steps_run_ahead_and_verify_steps_resume(loaded_default, tokenizer, prompt_ids, baseline,
                                                       monkeypatch):
    sync = make_loop(loaded_default, tokenizer, SPEC)
    assert tokens_of(run(sync, prompt_ids, GREEDY)) == baseline
    loop = make_loop(loaded_default, tokenizer, SPEC, overlap=True)
    events = watch(loop, monkeypatch)
    assert tokens_of(run(loop, prompt_ids, GREEDY)) == baseline
    ahead = launched_before_read(events)
    # step N+1 really launched before step N's tokens reached the host, many times
    assert len(ahead) >= 5 and loop.overlap.num_ahead == len(ahead)
    launches = [e for e in events if e[0] == "launch"]
    assert all(e[3] == 0 for e in launches if e[2] is not None)  # a step launched ahead has no drafts
    # speculation resumed after running ahead: verify steps follow steps that ran ahead
    first_ahead = next(i for i, e in enumerate(launches) if e[2] is not None)
    assert any(e[3] > 0 for e in launches[first_ahead:])
    s, o = sync.speculator.stats, loop.speculator.stats
    assert o.num_accepted_tokens > 10
    # (vLLM's check) acceptance no worse than the synchronous loop's, within a tolerance; drafting
    # resumes one step late after a stretch ahead, so a few drafts go unproposed
    assert o.acceptance_rate >= 0.9 * s.acceptance_rate and o.num_accepted_tokens >= 0.8 * s.num_accepted_tokens
    assert loop.num_steps <= sync.num_steps + 4
    loop.scheduler.check_invariants()


def test_the_watch_can_fail(loaded_default, tokenizer, prompt_ids, baseline, monkeypatch):
    """With no step scheduled ahead the same log shows no step launched before its predecessor's
    tokens were read (the check above is not vacuous)."""
    loop = make_loop(loaded_default, tokenizer, SPEC, overlap=True)
    monkeypatch.setattr(loop, "_ahead_without_drafts", lambda launched: False)
    events = watch(loop, monkeypatch)
    assert tokens_of(run(loop, prompt_ids[3:], GREEDY)) == baseline[3:]
    assert launched_before_read(events) == [] and loop.overlap.num_ahead == 0
    assert any(e[0] == "launch" for e in events)


def test_drafts_expected_keep_the_next_step_synchronous(loaded_default, tokenizer, prompt_ids, baseline):
    """An input-grounded prompt drafts nearly every step: its plain steps are applied before the
    next is scheduled (that one verifies drafts), the drafts the synchronous loop would verify."""
    sync = make_loop(loaded_default, tokenizer, SPEC)
    loop = make_loop(loaded_default, tokenizer, SPEC, overlap=True)
    assert tokens_of(run(loop, prompt_ids[2:3], GREEDY)) == tokens_of(run(sync, prompt_ids[2:3], GREEDY)) \
        == baseline[2:3]
    assert loop.speculator.stats.num_accepted_tokens >= 0.8 * sync.speculator.stats.num_accepted_tokens > 0


def test_requests_that_may_not_draft_run_ahead(loaded_default, tokenizer, prompt_ids):
    """Penalties, logit bias and seeds are never drafted: a batch of only such requests decodes
    under the overlap loop as without speculation (it ran synchronously before)."""
    params = [SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=20, logit_bias={int(prompt_ids[1][3]): 5.0}),
              SamplingParams(temperature=0.8, max_tokens=20, seed=7, frequency_penalty=0.5),
              SamplingParams(temperature=0.8, max_tokens=20, seed=3)]
    a = run(make_loop(loaded_default, tokenizer), prompt_ids, params)
    loop = make_loop(loaded_default, tokenizer, SPEC, overlap=True)
    b = run(loop, prompt_ids, params)
    assert tokens_of(a) == tokens_of(b)
    assert loop.overlap.num_ahead >= 10 and loop.speculator.stats.num_draft_tokens == 0
    # with greedy requests that draft now and then: steps switch between running ahead and
    # verifying while the penalized rows count their tokens (pending ones on the device)
    mixed = [params[0], GREEDY, params[2], GREEDY]
    a = run(make_loop(loaded_default, tokenizer), prompt_ids, mixed)
    loop = make_loop(loaded_default, tokenizer, SPEC, overlap=True)
    assert tokens_of(run(loop, prompt_ids, mixed)) == tokens_of(a)
    assert loop.overlap.num_ahead >= 5 and loop.speculator.stats.num_accepted_tokens > 0


def test_stop_strings_max_tokens_and_stop_tokens(loaded_default, tokenizer, prompt_ids, baseline):
    base = make_loop(loaded_default, tokenizer, overlap=True)
    spec = make_loop(loaded_default, tokenizer, SPEC, overlap=True)
    for mt in (1, 2, 5, 13):
        p = SamplingParams(temperature=0, max_tokens=mt)
        a, b = run(base, prompt_ids, p), run(spec, prompt_ids, p)
        assert tokens_of(a) == tokens_of(b)
        assert all(len(c.token_ids) == mt for ro in b for c in ro.outputs if c.finish_reason == "length")
    for i in (0, 3):  # a prompt that drafts, a prompt whose steps run ahead
        text = run(base, prompt_ids[i:i + 1], GREEDY)[0].outputs[0].text
        stop = text[10:14]
        p = SamplingParams(temperature=0, max_tokens=40, stop=[stop])
        a, b = run(base, prompt_ids[i:i + 1], p)[0].outputs[0], run(spec, prompt_ids[i:i + 1], p)[0].outputs[0]
        assert (b.text, list(b.token_ids), b.finish_reason, b.stop_reason) == \
            (a.text, list(a.token_ids), a.finish_reason, a.stop_reason)
        assert b.finish_reason == "stop" and stop not in b.text
    out = baseline[2][0]
    p = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[out[6]])
    b = run(spec, prompt_ids[2:3], p)[0].outputs[0]
    assert list(b.token_ids) == out[:out.index(out[6]) + 1]
    assert spec.overlap.num_ahead > 0


def test_n_greater_than_one_prefix_caching_and_preemption(loaded_default, tokenizer, prompt_ids, baseline):
    spec = make_loop(loaded_default, tokenizer, SPEC, overlap=True)
    assert tokens_of(run(spec, [prompt_ids[0]], GREEDY)) == [baseline[0]]
    outs = run(spec, [prompt_ids[0], prompt_ids[3]], [SamplingParams(n=2, temperature=0, max_tokens=40), GREEDY])
    assert tokens_of(outs) == [[baseline[0][0], baseline[0][0]], baseline[3]]
    assert spec.scheduler.block_manager.prefix_cache_hit_rate > 0
    outs = run(spec, prompt_ids[3:], SamplingParams(n=3, temperature=1.0, max_tokens=12))
    assert all(len(c.token_ids) == 12 for c in outs[0].outputs if c.finish_reason == "length")
    assert spec.overlap.num_ahead > 0
    # 10 blocks of 16 for four sequences: someone is preempted and recomputed
    small = make_loop(loaded_default, tokenizer, SPEC, overlap=True, num_blocks=10, max_model_len=128)
    assert tokens_of(run(small, prompt_ids, GREEDY)) == baseline
    assert small.scheduler.get_stats()["num_preemptions_total"] > 0
    small.scheduler.check_invariants()


def test_abort_while_a_step_runs_ahead(loaded_default, tokenizer, prompt_ids, baseline):
    loop = make_loop(loaded_default, tokenizer, SPEC, overlap=True)
    ids = []
    for q in prompt_ids:
        rid = loop.new_request_id()
        loop.add_request(rid, q, GREEDY)
        ids.append(rid)
    done, aborted = {}, False
    for _ in range(500):
        if not aborted and loop.overlap.in_flight is not None:  # a step runs ahead now
            loop.abort(ids[1])
            aborted = True
        for ro in loop.step():
            if ro.finished:
                done[ro.request_id] = ro
        if len(done) == len(ids):
            break
    assert aborted and done[ids[1]].outputs[0].finish_reason == "abort"
    assert [list(done[r].outputs[0].token_ids) for r in (ids[0], ids[2], ids[3])] == \
        [baseline[0][0], baseline[2][0], baseline[3][0]]
    loop.scheduler.check_invariants()


@pytest.mark.parametrize("kind", ["ahead", "verify"])
def test_a_failed_step_is_recomputed(loaded_default, tokenizer, prompt_ids, baseline, monkeypatch, kind):
    """A step launched ahead fails (both steps in flight are abandoned), or a verify step fails:
    with ``retry_failed_steps`` the requests are recomputed once and the output is unchanged."""
    loop = make_loop(loaded_default, tokenizer, SPEC, overlap=True, retry=True)
    launch, calls = loop.executor.launch, {"ahead": 0, "verify": 0}

    def flaky(scheduled, prev=None, **kw):
        which = "ahead" if prev is not None else \
            "verify" if int(scheduled.num_decode_tokens) > int(scheduled.num_decodes) else None
        if which is not None:
            calls[which] += 1
            if which == kind and calls[which] == 3:
                raise RuntimeError(f"injected failure of a {kind} step")
        return launch(scheduled, prev, **kw)

    monkeypatch.setattr(loop.executor, "launch", flaky)
    assert tokens_of(run(loop, prompt_ids, GREEDY)) == baseline
    assert calls["ahead"] > 3 and calls["verify"] > 3
    loop.scheduler.check_invariants()


def test_draft_model_requests_that_may_not_draft_run_ahead(loaded_default, tokenizer, prompt_ids, baseline):
    """With a draft model every request that may draft drafts each step (those steps verify
    synchronously); a batch of requests that may not runs ahead, and the draft model never runs."""
    from test_speculative_draft_model import draft_loop

    params = [SamplingParams(temperature=0, max_tokens=16, presence_penalty=0.5),
              SamplingParams(temperature=0.7, max_tokens=16, seed=5)]
    a = run(make_loop(loaded_default, tokenizer), prompt_ids[:2], params)
    loop = draft_loop(loaded_default, tokenizer, loaded_default, k=3, overlap=True)
    assert tokens_of(run(loop, prompt_ids[:2], params)) == tokens_of(a)
    assert loop.overlap.num_ahead >= 10 and loop.speculator.draft.num_steps == 0
    # mixed with greedy requests (the target drafting for itself keeps every draft): lossless
    mixed = [GREEDY, params[0], GREEDY]
    b = run(make_loop(loaded_default, tokenizer), prompt_ids[:3], mixed)
    assert tokens_of(run(loop, prompt_ids[:3], mixed)) == tokens_of(b)
    assert tokens_of(b)[0] == baseline[0] and tokens_of(b)[2] == baseline[2]
    st = loop.speculator.stats
    assert st.num_accepted_tokens > 20 and st.acceptance_rate == 1.0
    loop.scheduler.check_invariants()


def test_llm_with_overlap_scheduling_and_speculation(default_gguf, tokenizer):
    from deepinfer import LLM

    prompts = [MIXED[0], MIXED[3]]
    plain = LLM(default_gguf, device="cpu", dtype="float32", max_model_len=256)
    want = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(default_gguf, device="cpu", dtype="float32", max_model_len=256, overlap_scheduling=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want
    assert llm.engine.overlap is not None and llm.engine.overlap.num_ahead > 0
    assert llm.engine.speculator.stats.num_accepted_tokens > 0
