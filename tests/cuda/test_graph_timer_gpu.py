"""graph_timer handles and GraphTimer on a real GPU, against torch.cuda.Event timings."""

from __future__ import annotations

import pytest
from cuda_test_support import load_backend, requires_gpu

pytestmark = requires_gpu

# Region timings inside a replayed graph must match eager torch.cuda.Event timings of the
# same sleep kernels within 10 % or 20 us, whichever is larger.
REL_TOL = 0.10
ABS_TOL_MS = 0.020


@pytest.fixture(scope="module")
def gt():
    return load_backend().graph_timer


@pytest.fixture(scope="module")
def cycles_per_ms():
    import torch

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def eager_ms(cycles: int, repeats: int = 5) -> float:
    """Median eager duration of torch.cuda._sleep(cycles) by torch.cuda.Event."""
    import torch

    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def close(measured: float, expected: float) -> bool:
    return abs(measured - expected) <= max(REL_TOL * expected, ABS_TOL_MS)


def capture(fn):
    import torch

    g = torch.cuda.CUDAGraph(keep_graph=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        fn()
    return g


def test_event_handle_matches_torch_events(gt, cycles_per_ms):
    import torch

    cycles = int(0.5 * cycles_per_ms)
    expected = eager_ms(cycles)
    stream = torch.cuda.current_stream()
    start, end = gt.EventHandle(0), gt.EventHandle(0)
    start.record(stream.cuda_stream)
    torch.cuda._sleep(cycles)
    end.record(stream)  # a torch.cuda.Stream is accepted too
    end.synchronize()
    assert end.query()
    assert close(start.elapsed_ms(end), expected), (start.elapsed_ms(end), expected)


def test_captured_regions_match_eager_timings(gt, cycles_per_ms):
    import torch
    from deepinfer_graph_timer import GraphTimer

    c1, c2 = int(0.3 * cycles_per_ms), int(0.8 * cycles_per_ms)
    e1, e2 = eager_ms(c1), eager_ms(c2)
    timer = GraphTimer(gt, device=0)
    capturing = {"on": False}

    def body():
        if capturing["on"]:
            with timer.region("short"):
                torch.cuda._sleep(c1)
            with timer.region("long"):
                torch.cuda._sleep(c2)
        else:
            torch.cuda._sleep(c1)
            torch.cuda._sleep(c2)

    g = torch.cuda.CUDAGraph(keep_graph=True)
    torch.cuda.synchronize()
    capturing["on"] = True
    with torch.cuda.graph(g):
        body()
    handle = timer.attach(g)
    assert len(handle.kernel_nodes()) == 2
    types = [handle.node_type(n) for n in handle.nodes()]
    assert types.count("event_record") == 6  # empty region + 2 regions, 2 nodes each
    handle.instantiate()
    for _ in range(30):
        timer.replay(g)  # back to back, no synchronisation in between
    stats = timer.to_dict()
    assert stats["short"]["count"] == 30 and stats["long"]["count"] == 30
    assert close(stats["short"]["p50_ms"], e1), (stats["short"], e1)
    assert close(stats["long"]["p50_ms"], e2), (stats["long"], e2)
    assert 0.0 <= timer.overhead_ms() < 0.05
    table = timer.table()
    assert "short" in table and "long" in table


def test_back_to_back_replays_keep_separate_samples(gt, cycles_per_ms):
    import torch
    from deepinfer_graph_timer import GraphTimer

    cycles = int(0.2 * cycles_per_ms)
    timer = GraphTimer(gt, device=0, pool_size=4)  # small pool: step() must recycle events
    g = torch.cuda.CUDAGraph(keep_graph=True)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        with timer.region("sleep"):
            torch.cuda._sleep(cycles)
    timer.attach(g)
    for _ in range(25):
        timer.replay(g)
    trace = timer.chrome_trace()["traceEvents"]
    assert [e["args"]["replay"] for e in trace] == list(range(25))
    starts = [e["ts"] for e in trace]
    # Each replay's region starts after the previous one ended: distinct samples.
    for prev, nxt, ev in zip(starts, starts[1:], trace, strict=False):
        assert nxt - prev >= ev["dur"] * 0.9


def test_kernel_regions_inserted_after_capture(gt, cycles_per_ms):
    import torch
    from deepinfer_graph_timer import GraphTimer

    fractions = [0.1, 0.4, 0.2, 0.6, 0.3]
    cycles = [int(f * cycles_per_ms) for f in fractions]
    expected = [eager_ms(c) for c in cycles]
    g = capture(lambda: [torch.cuda._sleep(c) for c in cycles])
    handle = gt.GraphHandle(g, device=0)
    kernels = handle.kernel_nodes()
    assert len(kernels) == 5
    assert all(handle.node_type(k) == "kernel" for k in kernels)
    names = handle.kernel_names()
    assert len(names) == 5 and all("spin" in n or n == "" for n in names)
    timer = GraphTimer(gt, device=0)
    timer.add_kernel_region(handle, "k1..k2", 1, 2)
    timer.add_kernel_region(handle, "k4", 4, 4)
    assert handle.modified
    for _ in range(20):
        timer.replay(handle, torch.cuda.current_stream().cuda_stream)
    stats = timer.to_dict()
    assert close(stats["k1..k2"]["p50_ms"], expected[1] + expected[2]), stats
    assert close(stats["k4"]["p50_ms"], expected[4]), stats


def test_event_swapping_on_the_exec_graph(gt):
    import torch

    x = torch.zeros(1, device="cuda")
    g = capture(lambda: x.add_(1))
    handle = gt.GraphHandle(g, device=0)
    a, b = gt.EventHandle(0), gt.EventHandle(0)
    start, end = handle.insert_timer_nodes(0, 0, a, b)
    handle.instantiate()
    assert start.event.handle == a.handle and end.graph_event.handle == b.handle
    c = gt.EventHandle(0)
    previous = start.set_event(c)
    assert previous.handle == a.handle and start.event.handle == c.handle
    assert start.graph_event.handle == a.handle
    handle.launch(torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert c.query()
    assert c.elapsed_ms(b) >= 0.0  # c was recorded by the replay in a's place
    with pytest.raises(RuntimeError):
        a.elapsed_ms(b)  # a was never recorded
    handle.instantiate()  # a new exec graph records the graph's own events again
    assert start.event.handle == a.handle


def test_disable_removes_timer_nodes_and_keeps_results(gt):
    import torch
    from deepinfer_graph_timer import GraphTimer

    x = torch.ones(1024, device="cuda")
    out = torch.empty_like(x)
    timer = GraphTimer(gt, device=0)
    g = torch.cuda.CUDAGraph(keep_graph=True)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        with timer.region("double"):
            y = x * 2
        with timer.region("plus"):
            out.copy_(y + 3)
    handle = timer.attach(g)
    n_kernels = len(handle.kernel_nodes())
    timer.replay(g)
    timer.disable()
    assert not handle.timing_enabled
    assert all(handle.node_type(n) != "event_record" for n in handle.nodes())
    assert len(handle.kernel_nodes()) == n_kernels
    out.zero_()
    x.fill_(5)
    for _ in range(5):
        timer.replay(g)
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(x, 13.0))  # order kept without the timer nodes
    assert timer.to_dict()["double"]["count"] == 1
    timer.enable()
    assert sum(handle.node_type(n) == "event_record" for n in handle.nodes()) == 6
    x.fill_(1)
    for _ in range(3):
        timer.replay(g)
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(x, 5.0))
    assert timer.to_dict()["double"]["count"] == 4


def test_bad_input_raises_clear_errors(gt):
    import torch

    with pytest.raises(ValueError, match="not a visible CUDA device"):
        gt.EventHandle(64)
    ev = gt.EventHandle(0)
    with pytest.raises(TypeError, match="stream"):
        ev.record("not a stream")
    with pytest.raises(TypeError, match="CUDAGraph"):
        gt.GraphHandle("not a graph")
    with pytest.raises(ValueError):
        gt.GraphHandle(0)
    plain = torch.cuda.CUDAGraph()  # keep_graph=False: no raw graph to wrap
    with pytest.raises(ValueError, match="keep_graph"):
        gt.GraphHandle(plain)

    x = torch.zeros(4, device="cuda")
    g = capture(lambda: x.add_(1))
    other = capture(lambda: x.mul_(2))
    handle = gt.GraphHandle(g, device=0)
    foreign = gt.GraphHandle(other, device=0).kernel_nodes()[0]
    with pytest.raises(ValueError, match="not a node of this graph"):
        handle.node_type(foreign)
    with pytest.raises(ValueError, match="not recorded by any node"):
        handle.find_event_record_node(ev)
    with pytest.raises(IndexError, match="out of range"):
        handle.insert_timer_nodes(5, 5, gt.EventHandle(0), gt.EventHandle(0))
    start, _ = handle.insert_timer_nodes(0, 0, gt.EventHandle(0), gt.EventHandle(0))
    with pytest.raises(RuntimeError, match="instantiate"):
        start.set_event(gt.EventHandle(0))  # graph modified, not re-instantiated yet
    with pytest.raises(RuntimeError):
        gt.EventHandle(0).elapsed_ms(gt.EventHandle(0))  # never recorded

    g.reset()  # the torch graph is destroyed
    with pytest.raises(RuntimeError, match="no longer holds a captured graph"):
        handle.kernel_nodes()
    h2 = gt.GraphHandle(other, device=0)
    h2.close()
    with pytest.raises(RuntimeError, match="closed"):
        h2.kernel_nodes()
