"""GraphTimer (deepinfer-graph-timer) timing regions of an aclmdlRI graph on the Ascend handles."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

try:
    from deepinfer_graph_timer import GraphTimer
except ImportError:  # the sibling package's source, when the wheel is not installed
    sys.path.insert(
        0, str(Path(__file__).resolve().parents[2] / "packages" / "deepinfer-graph-timer" / "src")
    )
    from deepinfer_graph_timer import GraphTimer


def test_regions_of_replayed_graph(native, fake, stream):
    gt = native.graph_timer
    timer = GraphTimer(gt, device=0)
    g = gt.GraphHandle(device=0)
    g.capture_begin(stream)
    with timer.region("short", stream):
        fake.deepinfer_fake_acl_launch_kernel(stream, 5_000)
    with timer.region("long", stream):
        fake.deepinfer_fake_acl_launch_kernel(stream, 15_000)
    g.capture_end()
    timer.attach(g)
    for _ in range(4):
        timer.replay(g, stream)
    timer.synchronize()
    stats = timer.to_dict()
    assert set(stats) == {"short", "long"}
    # Four separate samples per region: event swapping kept every replay apart.
    assert stats["short"]["count"] == stats["long"]["count"] == 4
    assert 5.0 * 0.9 <= stats["short"]["min_ms"] and stats["short"]["max_ms"] < 5.0 * 10
    assert 15.0 * 0.9 <= stats["long"]["min_ms"] and stats["long"]["max_ms"] < 15.0 * 10
    assert stats["long"]["mean_ms"] > stats["short"]["mean_ms"]


def test_kernel_regions_after_capture_are_refused(native, fake, stream):
    gt = native.graph_timer
    timer = GraphTimer(gt, device=0)
    g = gt.GraphHandle(device=0)
    g.capture_begin(stream)
    fake.deepinfer_fake_acl_launch_kernel(stream, 1)
    g.capture_end()
    with pytest.raises(NotImplementedError, match="ACL cannot add tasks"):
        timer.add_kernel_region(g, "k", 0, 0)
