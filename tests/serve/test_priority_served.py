"""vLLM's ``priority`` request field: with ``--scheduling-policy priority`` the smaller priority is
scheduled first, through the engine-core process (the default) and the in-process engine thread;
with the default policy a priority is a 400 naming it (vLLM refuses it too).

One sequence runs at a time (``--max-num-seqs 1``): a long request holds the engine while two
more wait, the one sent first with the larger priority. The order in which the two finish is
the order the scheduler took them."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from conftest import MODEL_NAME, _llm, read_until_listening, start_serve_process, start_server


def _finish_order(url: str, model: str) -> list[int]:
    """Send a 300-token request, then priority 5 and priority -5 (in that order); the priorities
    in the order their responses finished."""
    import httpx

    done: list[int] = []
    errors: list[str] = []
    lock = threading.Lock()

    def one(priority: int, tokens: int) -> None:
        body = {"model": model, "prompt": "Count to ten:", "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True, "priority": priority}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        with lock:
            (done if r.status_code == 200 else errors).append(priority if r.status_code == 200 else r.text)

    first = threading.Thread(target=one, args=(0, 300))  # (seconds on a CPU: the others arrive while it runs)
    first.start()
    time.sleep(0.5)  # (the long request is running: every later one waits for the engine's one sequence)
    waiting = [threading.Thread(target=one, args=(p, 4)) for p in (5, -5)]
    for t in waiting:
        t.start()
        time.sleep(0.1)
    for t in (first, *waiting):
        t.join(300)
    assert not errors, errors
    return [p for p in done if p != 0]


def test_priority_orders_requests_through_the_engine_core_process():
    proc = start_serve_process("--scheduling-policy", "priority", "--max-num-seqs", "1")
    lines: list[str] = []
    try:
        url = read_until_listening(proc, lines, 180)
        assert _finish_order(url, "m") == [-5, 5]
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def fcfs_server() -> Any:
    with start_server(_llm(max_num_seqs=4)) as server:
        yield server


def test_priority_orders_requests_in_the_engine_thread():
    with start_server(_llm(max_num_seqs=1, scheduling_policy="priority")) as server:
        assert _finish_order(server.url, MODEL_NAME) == [-5, 5]


@pytest.mark.parametrize(("priority", "words"), [(3, "--scheduling-policy priority"), (2**40, "32-bit"),
                                                 (True, ""), (1.5, "")])
def test_a_priority_the_server_cannot_honour_is_a_400_naming_it(fcfs_server, priority, words):
    import httpx

    r = httpx.post(f"{fcfs_server.url}/v1/completions", timeout=60,
                   json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, "priority": priority})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "priority" and words in err["message"], err


def test_priority_zero_is_accepted_with_the_default_policy(fcfs_server):
    import httpx

    r = httpx.post(f"{fcfs_server.url}/v1/chat/completions", timeout=60,
                   json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                         "priority": 0})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_engine_thread_refuses_a_priority_its_policy_cannot_honour(policy):
    # where the front end does not know the policy (data-parallel replicas), the engine thread
    # checks: under fcfs a nonzero priority fails the request with a 400 naming the option, and
    # nothing is added; under priority the engine gets it
    import asyncio
    from types import SimpleNamespace

    from deepinfer.runtime.sampling_params import SamplingParams
    from deepinfer.serve.engine_thread import EngineThread

    added: list[dict[str, Any]] = []
    engine = SimpleNamespace(add_request=lambda *args, **kwargs: added.append(kwargs))
    llm = SimpleNamespace(engine=engine, engine_args=SimpleNamespace(scheduling_policy=policy))
    thread = EngineThread(llm, SimpleNamespace())  # type: ignore[arg-type]

    async def run() -> list[Any]:
        thread._loop = asyncio.get_running_loop()
        sink: asyncio.Queue[Any] = asyncio.Queue()
        thread._add("r", [1, 2, 3], SamplingParams(max_tokens=2), sink, 0, time.monotonic(), None, 3)
        await asyncio.sleep(0.05)
        return [sink.get_nowait() for _ in range(sink.qsize())]

    failed = asyncio.run(run())
    if policy == "fcfs":
        assert not added and len(failed) == 1
        assert failed[0].status == 400 and "--scheduling-policy priority" in failed[0].message
    else:
        assert not failed and [a["priority"] for a in added] == [3]
