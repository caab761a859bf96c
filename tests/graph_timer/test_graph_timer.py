"""GraphTimer against a simulated backend (fake_graph_timer): exact expectations, no device.

The simulation gives every kernel a known duration per replay and every executed
event-record node a known cost, so each region's samples are known exactly.
"""

from __future__ import annotations

import json
import math
import sys
import types

import fake_graph_timer as fake
import pytest
from deepinfer_graph_timer import CUDAGraphTimer, GraphTimer, percentile, summarize


def capture(timer: GraphTimer, regions: list[tuple[str, tuple[float, ...]]]) -> fake.FakeGraph:
    """A graph with one kernel per region, each kernel inside timer.region(name)."""
    g, s = fake.FakeGraph(), fake.Stream()
    s.capturing = g
    for name, durations in regions:
        with timer.region(name, stream=s):
            g.kernel(*durations)
    s.capturing = None
    timer.attach(g)
    return g


def test_alias():
    assert CUDAGraphTimer is GraphTimer


def test_capture_regions_subtract_the_empty_region_cost():
    timer = GraphTimer(fake)
    g = capture(timer, [("a", (0.5,)), ("b", (0.25,))])
    for _ in range(10):
        timer.replay(g)
    stats = timer.to_dict()
    # Raw region = one record's cost + the kernel; the empty region costs one record.
    assert timer.overhead_ms() == pytest.approx(fake.RECORD_COST)
    assert stats["a"]["count"] == 10 and stats["b"]["count"] == 10
    assert stats["a"]["mean_ms"] == pytest.approx(0.5)
    assert stats["b"]["p99_ms"] == pytest.approx(0.25)


def test_back_to_back_replays_keep_separate_samples():
    durations = tuple(0.01 * (i + 1) for i in range(20))
    timer = GraphTimer(fake, pool_size=3)  # forces recycling and waiting on old samples
    g = capture(timer, [("k", durations)])
    for _ in range(20):
        timer.replay(g)  # the fake device completes nothing until drained
    samples = sorted(timer.to_dict()["k"][key] for key in ("min_ms", "max_ms"))
    stats = timer.to_dict()["k"]
    assert stats["count"] == 20
    assert samples == pytest.approx([0.01, 0.20])
    assert stats["mean_ms"] == pytest.approx(sum(durations) / 20)
    trace = timer.chrome_trace()["traceEvents"]
    assert sorted(e["dur"] for e in trace) == pytest.approx([d * 1000 + fake.RECORD_COST * 1000 for d in durations])
    assert sorted(e["args"]["replay"] for e in trace) == list(range(20))


def test_without_event_swapping_samples_would_be_lost():
    """The property the pool protects: re-recording one event overwrites the older sample."""
    ev0, ev1 = fake.EventHandle(), fake.EventHandle()
    g, s = fake.FakeGraph(), fake.Stream()
    s.capturing = g
    ev0.record(s)
    g.kernel(0.1, 0.3)
    ev1.record(s)
    s.capturing = None
    g.replay()
    g.replay()
    fake.DEVICE.drain()
    assert ev0.elapsed_ms(ev1) == pytest.approx(0.3 + fake.RECORD_COST)  # replay 0's 0.1 is gone


def test_kernel_regions_inserted_after_capture():
    g = fake.FakeGraph()
    for d in (0.1, 0.2, 0.3, 0.4, 0.5):
        g.kernel(d)
    timer = GraphTimer(fake)
    timer.add_kernel_region(g, "k1..k2", 1, 2)
    timer.add_kernel_region(g, "k4", 4, 4)
    for _ in range(5):
        timer.replay(g)
    stats = timer.to_dict()
    assert stats["k1..k2"]["mean_ms"] == pytest.approx(0.2 + 0.3)
    assert stats["k4"]["mean_ms"] == pytest.approx(0.5)
    assert stats["k4"]["count"] == 5


def test_disable_costs_nothing_and_enable_resumes():
    timer = GraphTimer(fake)
    g = capture(timer, [("a", (0.5,)), ("b", (0.25,))])
    timer.replay(g)
    timer.disable()
    before = fake.DEVICE.now
    for _ in range(4):
        timer.replay(g)
    assert fake.DEVICE.now - before == pytest.approx(4 * 0.75)  # no record node executed
    assert timer.to_dict()["a"]["count"] == 1
    timer.enable()
    for _ in range(3):
        timer.replay(g)
    assert timer.to_dict()["a"]["count"] == 4
    assert timer.to_dict()["a"]["mean_ms"] == pytest.approx(0.5)


def test_capture_while_disabled_starts_with_nodes_out():
    timer = GraphTimer(fake, enabled=False)
    g = capture(timer, [("a", (0.5,))])
    before = fake.DEVICE.now
    timer.replay(g)
    assert fake.DEVICE.now - before == pytest.approx(0.5)
    timer.enable()
    timer.replay(g)
    assert timer.to_dict()["a"]["count"] == 1


def test_reports(tmp_path):
    timer = GraphTimer(fake)
    g = capture(timer, [("attention", (0.3,)), ("mlp", (0.6,))])
    for _ in range(3):
        timer.replay(g)
    table = timer.table().splitlines()
    assert table[0].split() == ["region", "count", "mean", "ms", "p50", "ms", "p99", "ms"]
    assert table[1].split()[:2] == ["attention", "3"]
    assert float(table[2].split()[2]) == pytest.approx(0.6, abs=1e-4)
    path = tmp_path / "trace.json"
    timer.chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    assert {e["name"] for e in events} == {"attention", "mlp"}
    first = sorted(events, key=lambda e: e["ts"])[:2]
    assert [e["name"] for e in first] == ["attention", "mlp"]
    assert first[1]["ts"] >= first[0]["ts"] + first[0]["dur"]
    timer.reset()
    assert timer.to_dict() == {}


def test_two_graphs_need_an_explicit_step_target():
    timer = GraphTimer(fake)
    g1 = capture(timer, [("x", (0.1,))])
    g2 = capture(timer, [("y", (0.2,))])
    g1.replay()
    with pytest.raises(ValueError, match="graph="):
        timer.step()
    timer.step(g1)
    timer.replay(g2)
    stats = timer.to_dict()
    assert stats["x"]["mean_ms"] == pytest.approx(0.1) and stats["y"]["mean_ms"] == pytest.approx(0.2)


def test_bad_input():
    with pytest.raises(ValueError, match="pool_size"):
        GraphTimer(fake, pool_size=0)
    timer = GraphTimer(fake)
    with pytest.raises(ValueError, match="region name"):
        with timer.region("", stream=fake.Stream()):
            pass
    g = fake.FakeGraph()
    g.kernel(0.1)
    with pytest.raises(IndexError):
        timer.add_kernel_region(g, "bad", 0, 3)
    with pytest.raises(ValueError, match="no kernel nodes"):
        timer.add_kernel_region(fake.FakeGraph(), "empty", 0, 0)


def test_default_backend_is_looked_up_at_run_time_through_the_entry_point(monkeypatch):
    # The graph-timer wheel names no package of ours: the default handles are the module the
    # entry-point group deepinfer.graph_timer registers (the deepinfer package's _C.graph_timer).
    from importlib.metadata import EntryPoint

    import deepinfer_graph_timer.timer as timer_module

    module = types.ModuleType("fake_handles_for_test")
    module.__dict__.update({k: getattr(fake, k) for k in ("EventHandle", "EventRecordNodeHandle", "GraphHandle")})
    monkeypatch.setitem(sys.modules, "fake_handles_for_test", module)
    ep = EntryPoint(name="handles", value="fake_handles_for_test", group=timer_module.HANDLES_GROUP)
    monkeypatch.setattr("importlib.metadata.entry_points",
                        lambda group=None: [ep] if group == timer_module.HANDLES_GROUP else [])
    timer = GraphTimer()
    assert timer.graph_timer is module


def test_without_a_registered_handles_module_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group=None: [])
    with pytest.raises(ImportError, match=r"deepinfer\[cuda\].*graph_timer="):
        _ = GraphTimer().graph_timer


def test_the_installed_deepinfer_package_registers_its_handles():
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        eps = distribution("deepinfer").entry_points
    except PackageNotFoundError:
        pytest.skip("the deepinfer wheel is not installed here (a source-tree run)")
    assert [(e.name, e.value) for e in eps if e.group == "deepinfer.graph_timer"] == \
        [("handles", "deepinfer._C.graph_timer")]


def test_percentile_matches_the_linear_definition():
    values = sorted([3.0, 1.0, 4.0, 1.5, 9.0, 2.6])
    # numpy's default ('linear') percentile, computed by hand for these six values.
    assert percentile(values, 50) == pytest.approx((2.6 + 3.0) / 2)
    assert percentile(values, 99) == pytest.approx(4.0 + (9.0 - 4.0) * 0.95)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 9.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(values, 101)
    s = summarize([2.0, 4.0])
    assert (s["count"], s["mean_ms"], s["min_ms"], s["max_ms"]) == (2, 3.0, 2.0, 4.0)


def test_deepinfer_timer_reexports():
    timer_module = pytest.importorskip("deepinfer.timer")
    assert timer_module.CUDAGraphTimer is GraphTimer and timer_module.GraphTimer is GraphTimer


def test_deepinfer_timer_without_the_wheel_says_what_to_install():
    pytest.importorskip("deepinfer")
    import subprocess

    code = (
        "import sys; sys.modules['deepinfer_graph_timer'] = None\n"
        "try:\n    import deepinfer.timer\nexcept ImportError as exc:\n    print(exc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert 'pip install "deepinfer[cuda]"' in proc.stdout


def test_torch_npu_stream_objects_are_passed_as_their_int_handle():
    seen = []

    class RecordingEvent(fake.EventHandle):
        def record(self, stream=0):
            seen.append(stream)
            super().record(stream)

    backend = types.SimpleNamespace(**{**vars(fake), "EventHandle": RecordingEvent})
    timer = GraphTimer(backend)
    npu_stream = types.SimpleNamespace(npu_stream=1234)  # what torch_npu's streams carry
    with timer.region("a", stream=npu_stream):
        pass
    assert seen and all(s == 1234 for s in seen)
