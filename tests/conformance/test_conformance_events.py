"""EventHandle timing on a live stream, and errors of unrecorded events."""

from __future__ import annotations

import pytest


def test_record_synchronize_query(backend):
    ev = backend.graph_timer.EventHandle()
    ev.record(0)
    ev.synchronize()
    assert ev.query() is True


def test_elapsed_time_brackets_work(backend):
    gt = backend.graph_timer
    start, end = gt.EventHandle(), gt.EventHandle()
    stream = backend.adapter.new_stream()
    start.record(stream)
    lower_bound = backend.adapter.launch_work(stream, 20.0)
    end.record(stream)
    end.synchronize()
    ms = start.elapsed_ms(end)
    assert isinstance(ms, float)
    assert ms >= 0.0
    if lower_bound is not None:
        assert ms >= lower_bound * 0.95
    assert ms < 60_000


def test_elapsed_time_is_ordered(backend):
    gt = backend.graph_timer
    a, b, c = gt.EventHandle(), gt.EventHandle(), gt.EventHandle()
    stream = backend.adapter.new_stream()
    a.record(stream)
    backend.adapter.launch_work(stream, 2.0)
    b.record(stream)
    backend.adapter.launch_work(stream, 2.0)
    c.record(stream)
    c.synchronize()
    ab, bc, ac = a.elapsed_ms(b), b.elapsed_ms(c), a.elapsed_ms(c)
    assert ab >= 0 and bc >= 0
    assert ac == pytest.approx(ab + bc, rel=0.05, abs=0.05)


def test_elapsed_time_of_unrecorded_event_raises(backend):
    gt = backend.graph_timer
    recorded, never = gt.EventHandle(), gt.EventHandle()
    recorded.record(0)
    recorded.synchronize()
    with pytest.raises(RuntimeError):
        recorded.elapsed_ms(never)


def test_elapsed_ms_rejects_non_events(backend):
    ev = backend.graph_timer.EventHandle()
    with pytest.raises(TypeError):
        ev.elapsed_ms(3)


def test_graph_handle_rejects_non_int(backend):
    with pytest.raises(TypeError):
        backend.graph_timer.GraphHandle("not a graph")
