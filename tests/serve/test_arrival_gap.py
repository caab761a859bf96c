"""``--arrival-gap-ms`` (issue 25): an idle engine that receives a request keeps taking the requests
that follow within the gap, for at most ``ARRIVAL_WINDOW_GAPS`` gaps, before its first step; a busy
engine never waits. Runs ``EngineThread._take_commands`` on this thread over a fake engine, with a
thread that queues adds at set times (the margins are tens of milliseconds, the gaps hundreds)."""

from __future__ import annotations

import argparse
import os
import queue
import threading
import time
from typing import Any

import pytest
from deepinfer.runtime.sampling_params import SamplingParams
from deepinfer.serve import engine_thread as et


class FakeEngine:
    def __init__(self) -> None:
        self.added: list[str] = []

    def add_request(self, request_id: str, *args: Any, **kwargs: Any) -> None:
        self.added.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.added)


class FakeLLM:
    def __init__(self) -> None:
        self.engine = FakeEngine()


class NoMetrics:
    pass


def _thread(gap_s: float) -> et.EngineThread:
    return et.EngineThread(FakeLLM(), NoMetrics(), arrival_gap_s=gap_s)  # type: ignore[arg-type]


def _add(rid: str) -> tuple[Any, ...]:
    return ("add", rid, [1, 2, 3], SamplingParams(max_tokens=4), None, 0, time.monotonic(), None)


def _feed(thread: et.EngineThread, at: list[tuple[float, str]]) -> threading.Thread:
    """Queue ``add`` commands at the given offsets (seconds from now) from another thread."""
    t0 = time.monotonic()

    def run() -> None:
        for offset, rid in at:
            time.sleep(max(0.0, t0 + offset - time.monotonic()))
            thread._commands.put(_add(rid))

    feeder = threading.Thread(target=run, daemon=True)
    feeder.start()
    return feeder


def _taken(thread: et.EngineThread) -> list[str]:
    return list(thread._llm.engine.added)  # type: ignore[attr-defined]


def test_an_idle_engine_takes_a_burst_that_keeps_within_the_gap():
    th = _thread(0.25)
    feeder = _feed(th, [(0.0, "a"), (0.05, "b"), (0.10, "c"), (0.15, "d"), (1.2, "late")])
    t0 = time.monotonic()
    assert th._take_commands(block=True)
    took = time.monotonic() - t0
    assert _taken(th) == ["a", "b", "c", "d"]  # "late" came more than a gap after "d"
    assert 0.35 <= took < 1.2, took  # d at 0.15, then one quiet gap of 0.25
    feeder.join(5)


def test_the_wait_stops_after_ten_gaps_however_the_requests_keep_coming():
    th = _thread(0.05)
    feeder = _feed(th, [(i * 0.01, f"r{i}") for i in range(150)])  # every 10 ms for 1.5 s
    t0 = time.monotonic()
    assert th._take_commands(block=True)
    took = time.monotonic() - t0
    assert 0.45 <= took < 1.2, took  # 10 gaps of 50 ms from the first add (not the 1.5 s of arrivals)
    assert 20 <= len(_taken(th)) < 150
    feeder.join(5)


def test_no_gap_or_a_busy_engine_takes_only_what_is_queued():
    for gap, block in ((0.0, True), (0.5, False)):
        th = _thread(gap)
        th._commands.put(_add("a"))
        th._commands.put(_add("b"))
        feeder = _feed(th, [(0.1, "c")])
        t0 = time.monotonic()
        assert th._take_commands(block=block)
        assert _taken(th) == ["a", "b"] and time.monotonic() - t0 < 0.09
        feeder.join(5)


def test_only_aborts_do_not_wait():
    th = _thread(0.5)
    th._commands.put(("abort", "unknown"))
    t0 = time.monotonic()
    assert th._take_commands(block=True)
    assert time.monotonic() - t0 < 0.4 and _taken(th) == []


def test_a_stop_during_the_wait_ends_the_loop():
    th = _thread(0.5)
    th._commands.put(_add("a"))
    feeder = threading.Thread(target=lambda: (time.sleep(0.05), th._commands.put(("stop",))), daemon=True)
    feeder.start()
    assert th._take_commands(block=True) is False
    feeder.join(5)


def test_the_core_sockets_get_waits_at_most_its_timeout():
    zmq = pytest.importorskip("zmq", reason="pyzmq (the serve extra) is not installed")
    from deepinfer.serve.core import _Commands

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        sock.bind("inproc://arrival-gap-test")
        core = argparse.Namespace(stop_requested=False, frontends={})  # what the liveness check reads
        commands = _Commands(core, sock, parent_pid=os.getppid())  # type: ignore[arg-type]
        t0 = time.monotonic()
        with pytest.raises(queue.Empty):
            commands.get(timeout=0.05)
        assert 0.04 <= time.monotonic() - t0 < 0.5
    finally:
        sock.close(0)
        ctx.term()


@pytest.mark.parametrize("device,asked,expected", [("cpu", None, 0.003), ("cuda", None, 0.0), ("cuda", 2, 0.002),
                                                   ("cpu", 0, 0.0), ("cpu", 7.5, 0.0075)])
def test_the_default_gap_is_three_ms_on_cpu_and_none_elsewhere(device, asked, expected):
    assert et.arrival_gap_seconds(device, asked) == pytest.approx(expected)


@pytest.mark.parametrize("bad", [-1, float("nan"), "3", True])
def test_a_bad_gap_is_a_value_error_naming_the_flag(bad):
    with pytest.raises(ValueError, match="--arrival-gap-ms must be a number >= 0"):
        et.arrival_gap_seconds("cpu", bad)


def test_the_cli_refuses_a_negative_gap_before_loading_anything():
    from deepinfer.cli.serve import _check, add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert p.parse_args([]).arrival_gap_ms is None
    with pytest.raises(ValueError, match="--arrival-gap-ms must be >= 0, got -2.0"):
        _check(p.parse_args(["--arrival-gap-ms", "-2"]))
