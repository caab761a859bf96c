"""One call at a time per engine object: the native calls release the GIL, so a second thread that
mutates a Scheduler, SequenceMetadataPool, PrepareArgs or SamplerInputs while another thread's
call is inside it must get a RuntimeError, never corrupt memory (also run under ASan/UBSan).

The deterministic tests hold an object busy from inside a call — Scheduler.update reads its
token array through DLPack, which calls back into Python — and make the second call from
another thread there. The stress tests hammer one object from two threads: every call either
works or raises that RuntimeError, and the object is consistent afterwards.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from deepinfer_engine import _engine as E

BUSY = "is being used by another thread"


def _sched(**kw):
    cfg = dict(num_blocks=256, block_size=4, max_num_seqs=64, max_num_batched_tokens=4096, max_model_len=256,
               vocab_size=100, watermark=0.0)
    cfg.update(kw)
    return E.Scheduler(**cfg)


class CallsBackDuringUpdate:
    """Token ids handed to Scheduler.update through DLPack; while update reads them (the scheduler
    is busy) `during` runs in another thread and its outcome is recorded."""

    def __init__(self, tokens, during):
        self.tokens, self.during, self.outcome = np.asarray(tokens, np.int32), during, None

    def __dlpack__(self, **kw):
        def other():
            try:
                self.outcome = ("ok", self.during())
            except Exception as e:
                self.outcome = (type(e).__name__, str(e))
        t = threading.Thread(target=other)
        t.start()
        t.join()
        return self.tokens.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.tokens.__dlpack_device__()


@pytest.mark.parametrize("call", ["add_request", "abort_request", "schedule", "abandon_step", "stop_sequence",
                                  "reset_prefix_cache", "build_request_outputs", "get_finished_seqs_info",
                                  "clone_and_zero_states_and_blocks", "pool.build", "update"])
def test_a_second_thread_gets_runtime_error_while_the_scheduler_is_inside_update(call):
    s = _sched()
    s.add_request("a", [5, 6, 7], E.SamplingParams(max_tokens=4))
    s.add_request("b", [5, 6, 8], E.SamplingParams(max_tokens=4))
    out = s.schedule()
    s.update(np.full(out.num_sample_rows, 9, np.int32))
    s.schedule()
    calls = {
        "add_request": lambda: s.add_request("c", [1, 2]),
        "abort_request": lambda: s.abort_request("a"),
        "schedule": s.schedule,
        "abandon_step": s.abandon_step,
        "stop_sequence": lambda: s.stop_sequence(0, "x", 0),
        "reset_prefix_cache": s.reset_prefix_cache,
        "build_request_outputs": lambda: E.build_request_outputs(s, E.RequestOutputPool()),
        "get_finished_seqs_info": lambda: E.get_finished_seqs_info(s),
        "clone_and_zero_states_and_blocks": lambda: E.clone_and_zero_states_and_blocks(s, 0, 1),
        "pool.build": lambda: E.SequenceMetadataPool().build(s),
        "update": lambda: s.update(np.array([3, 3], np.int32)),
    }
    hook = CallsBackDuringUpdate([9, 9], calls[call])
    s.update(hook)
    kind, msg = hook.outcome
    assert kind == "RuntimeError" and msg.startswith("Scheduler " + BUSY), hook.outcome
    # the first call completed normally and nothing of the refused one happened
    assert [q.output_token_ids.tolist() for q in (s.get_sequences("a")[0], s.get_sequences("b")[0])] == [[9, 9]] * 2
    assert s.check_invariants() == "" and not s.step_in_flight
    assert s.num_unfinished_requests == 2
    # and the scheduler is usable again once the call returned
    out = s.schedule()
    E.SequenceMetadataPool().build(s)
    s.update(np.full(out.num_sample_rows, 9, np.int32))
    assert s.check_invariants() == ""


def _buffers(T=8192, S=256, W=64):
    return dict(input_ids=np.zeros(T, np.int32), positions=np.zeros(T, np.int32),
                slot_mapping=np.zeros(T, np.int64), query_start_loc=np.zeros(S + 1, np.int32),
                seq_lens=np.zeros(S, np.int32), block_tables=np.zeros((S, W), np.int32),
                logits_indices=np.zeros(T, np.int32))


def _hammer(fns, seconds=0.4):
    """Runs each fn in its own thread in a loop; returns the messages of the RuntimeErrors seen."""
    stop, errors, other = threading.Event(), [], []

    def loop(fn):
        while not stop.is_set():
            try:
                fn()
            except RuntimeError as e:
                errors.append(str(e))
            except Exception as e:
                other.append(repr(e))
    threads = [threading.Thread(target=loop, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    stop.wait(seconds)
    stop.set()
    for t in threads:
        t.join()
    assert not other, other[:3]
    assert all(BUSY in m for m in errors), errors[:3]
    return errors


def test_builders_on_shared_args_pool_and_sampler_inputs_from_two_threads():
    s = _sched(num_blocks=2048, max_num_seqs=256)
    for i in range(200):
        s.add_request(f"r{i}", list(range(5, 25)), E.SamplingParams(max_tokens=50, ignore_eos=True, presence_penalty=0.5))
    out = s.schedule()
    s.update(np.full(out.num_sample_rows, 9, np.int32))
    assert s.schedule().num_decodes == 200
    pool, si = E.SequenceMetadataPool(), E.SamplerInputs()
    pool.build(s)
    bufs = _buffers()
    args = E.PrepareArgs(block_size=4, max_model_len=256, **bufs)

    def build():
        E.prepare_decode_v4(args, pool)
        E.prepare_sampler_inputs(args, pool, si)
    _hammer([build, build, lambda: pool.build(s)])
    build()   # consistent afterwards: the layout of the step
    assert args.num_seqs == 200
    assert bufs["positions"][:200].tolist() == [20] * 200
    assert si.driver.seq_ids[:200].tolist() == list(range(200))


def test_scheduler_hammered_from_two_threads_stays_consistent():
    s = _sched()
    counter = iter(range(10**9))

    def add():
        s.add_request(f"r{next(counter)}", list(range(5, 40)), E.SamplingParams(max_tokens=3, ignore_eos=True))

    def step():
        if s.step_in_flight:
            return
        out = s.schedule()
        s.update(np.full(out.num_sample_rows, 9, np.int32))

    _hammer([add, step])
    while s.has_unfinished_requests():
        step()
    assert s.check_invariants() == ""
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks
