"""Events and aclmdlRI graphs against the fake ACL: flags, capture, inspection, timing, swaps."""

from __future__ import annotations

import gc

import pytest

ACL_EVENT_TIME_LINE = 0x8
ACL_EVENT_EXTERNAL = 0x20


def capture(native, fake, stream, body):
    g = native.graph_timer.GraphHandle()
    g.capture_begin(stream)
    body()
    g.capture_end()
    return g


def test_event_flags(native, acl_log):
    ev = native.graph_timer.EventHandle()
    (create,) = acl_log.of("aclrtCreateEventWithFlag")
    assert (
        int(create.args["flag"])
        == ACL_EVENT_TIME_LINE | ACL_EVENT_EXTERNAL
        == native.graph_timer.EventHandle.flags
    )
    assert int(create.args["event"], 16) == ev.raw
    del ev
    gc.collect()
    (destroy,) = acl_log.of("aclrtDestroyEvent")
    assert destroy.args["event"] == create.args["event"]


def test_event_device_is_checked(native):
    with pytest.raises(ValueError, match=r"device=5 is out of range"):
        native.graph_timer.EventHandle(5)
    assert native.graph_timer.EventHandle(device=1).device == 1


def test_capture_begin_end_replay_destroy_sequence(native, fake, stream, acl_log):
    gt = native.graph_timer
    start, end = gt.EventHandle(), gt.EventHandle()

    def body():
        start.record(stream)
        fake.deepinfer_fake_acl_launch_kernel(stream, 100)
        end.record(stream)

    g = capture(native, fake, stream, body)
    assert not g.is_capturing and g.raw_model != 0
    g.replay(stream)
    g.destroy()
    wanted = {
        "aclmdlRICaptureBegin",
        "aclrtRecordEvent",
        "aclmdlRICaptureEnd",
        "aclmdlRIExecuteAsync",
        "aclmdlRIDestroy",
    }
    names = [c.name for c in acl_log.calls() if c.name in wanted]
    assert names == [
        "aclmdlRICaptureBegin",
        "aclrtRecordEvent",
        "aclrtRecordEvent",
        "aclmdlRICaptureEnd",
        "aclmdlRIExecuteAsync",
        "aclmdlRIDestroy",
    ]
    (begin,) = acl_log.of("aclmdlRICaptureBegin")
    assert int(begin.args["stream"], 16) == stream and begin.args["mode"] == "0"  # global mode
    records = acl_log.of("aclrtRecordEvent")
    assert all(r.args["captured"] == "1" and r.args["external"] == "1" for r in records)
    assert int(acl_log.of("aclmdlRIDestroy")[0].args["model"], 16) == g.raw_model
    assert g.is_destroyed


def test_inspection_lists_tasks_in_order(native, fake, stream):
    gt = native.graph_timer
    a, b = gt.EventHandle(), gt.EventHandle()

    def body():
        fake.deepinfer_fake_acl_launch_kernel(stream, 10)
        a.record(stream)
        fake.deepinfer_fake_acl_launch_kernel(stream, 10)
        fake.deepinfer_fake_acl_launch_kernel(stream, 10)
        b.record(stream)

    g = capture(native, fake, stream, body)
    types = [t for _, t in g.nodes()]
    assert types == ["kernel", "event_record", "kernel", "kernel", "event_record"]
    tasks = [task for task, _ in g.nodes()]
    assert g.kernel_nodes() == [tasks[0], tasks[2], tasks[3]]
    nodes = g.event_record_nodes()
    assert [n.event.raw for n in nodes] == [a.raw, b.raw]
    assert [n.task for n in nodes] == [tasks[1], tasks[4]]


def test_region_timing_in_replay(native, fake, stream):
    gt = native.graph_timer
    start, end = gt.EventHandle(), gt.EventHandle()

    def body():
        start.record(stream)
        fake.deepinfer_fake_acl_launch_kernel(stream, 30_000)  # 30 ms on every replay
        end.record(stream)

    g = capture(native, fake, stream, body)
    with pytest.raises(RuntimeError, match="aclrtEventElapsedTime failed"):
        start.elapsed_ms(end)  # capture alone stamps nothing
    g.replay(stream)
    end.synchronize()
    assert 30.0 * 0.95 <= start.elapsed_ms(end) < 30.0 * 20


def test_event_swap_keeps_samples_of_successive_replays(native, fake, stream, acl_log):
    gt = native.graph_timer
    start, end1 = gt.EventHandle(), gt.EventHandle()

    def body():
        start.record(stream)
        fake.deepinfer_fake_acl_launch_kernel(stream, 20_000)
        gt.EventRecordNodeHandle(end1, stream)  # the capture-time node

    g = capture(native, fake, stream, body)
    g.replay(stream)
    first = start.elapsed_ms(end1)
    end_node = g.event_record_nodes()[1]
    assert end_node.event.raw == end1.raw
    end2 = gt.EventHandle()
    end_node.set_event(end2)
    assert end_node.event.raw == end2.raw
    set_params = acl_log.of("aclmdlRITaskSetParams")
    assert [c.args["event"] for c in set_params] == [hex(end2.raw)]
    assert acl_log.names()[-1] == "aclmdlRIUpdate"
    g.replay(stream)
    # end1 still holds replay 1's stamp, end2 holds replay 2's: two separate samples.
    assert end1.elapsed_ms(end2) >= 20.0 * 0.95
    assert first >= 20.0 * 0.95 and start.elapsed_ms(end2) >= 20.0 * 0.95


def test_capture_time_node_swaps_without_listing(native, fake, stream):
    gt = native.graph_timer
    ev, fresh = gt.EventHandle(), gt.EventHandle()
    g = gt.GraphHandle()
    g.capture_begin(stream)
    node = gt.EventRecordNodeHandle(ev, stream)
    with pytest.raises(RuntimeError, match="still being captured"):
        node.set_event(fresh)
    g.capture_end()
    node.set_event(fresh)  # resolves its task by the event it recorded
    assert [n.event.raw for n in g.event_record_nodes()] == [fresh.raw]
    g.replay(stream)
    assert fresh.query()


def test_node_outside_capture_is_refused(native, stream):
    gt = native.graph_timer
    with pytest.raises(
        RuntimeError, match="stream is not being captured; ACL can only create event-record tasks"
    ):
        gt.EventRecordNodeHandle(gt.EventHandle(), stream)


def test_insertion_after_capture_names_the_acl_limit(native, fake, stream):
    gt = native.graph_timer
    g = capture(native, fake, stream, lambda: fake.deepinfer_fake_acl_launch_kernel(stream, 1))
    for method in (g.insert_event_record_node, g.insert_timer_nodes):
        with pytest.raises(
            NotImplementedError, match="ACL cannot add tasks to an aclmdlRI model after capture"
        ):
            method(g.kernel_nodes()[0], gt.EventHandle())


def test_graph_misuse(native, fake, stream):
    gt = native.graph_timer
    g = gt.GraphHandle()
    with pytest.raises(ValueError, match="stream=0: ACL cannot capture the default stream"):
        g.capture_begin(0)
    with pytest.raises(RuntimeError, match="nothing has been captured"):
        g.replay(stream)
    with pytest.raises(RuntimeError, match="no capture in progress"):
        g.capture_end()
    g.capture_begin(stream)
    with pytest.raises(RuntimeError, match="already in progress"):
        g.capture_begin(stream)
    with pytest.raises(RuntimeError, match="still being captured"):
        g.kernel_nodes()
    g.capture_end()
    g.destroy()
    with pytest.raises(ValueError, match="destroyed"):
        g.replay(stream)


def test_node_keeps_graph_alive(native, fake, stream, acl_log):
    gt = native.graph_timer
    ev = gt.EventHandle()
    g = capture(native, fake, stream, lambda: ev.record(stream))
    (node,) = g.event_record_nodes()
    del g
    gc.collect()
    assert acl_log.of("aclmdlRIDestroy") == []
    node.set_event(gt.EventHandle())
    del node
    gc.collect()
    assert len(acl_log.of("aclmdlRIDestroy")) == 1


def test_wrapped_model_is_not_destroyed(native, fake, stream, acl_log):
    gt = native.graph_timer
    owner = capture(native, fake, stream, lambda: fake.deepinfer_fake_acl_launch_kernel(stream, 1))
    view = gt.GraphHandle(owner.raw_model)
    assert view.kernel_nodes() == owner.kernel_nodes()
    view.replay(stream)
    del view
    gc.collect()
    assert acl_log.of("aclmdlRIDestroy") == []


def test_graph_keeps_events_recorded_during_capture_alive(native, fake, stream, acl_log):
    gt = native.graph_timer
    g = capture(native, fake, stream, lambda: [gt.EventHandle().record(stream) for _ in range(2)])
    gc.collect()
    assert acl_log.of("aclrtDestroyEvent") == []  # the model still records them
    g.replay(stream)
    g.destroy()
    del g
    gc.collect()
    names = acl_log.names()
    assert names.count("aclrtDestroyEvent") == 2
    assert names.index("aclmdlRIDestroy") < names.index("aclrtDestroyEvent")


def test_find_event_record_node_and_batched_swap(native, fake, stream, acl_log):
    gt = native.graph_timer
    a, b, c = gt.EventHandle(), gt.EventHandle(), gt.EventHandle()

    def body():
        a.record(stream)
        b.record(stream)

    g = capture(native, fake, stream, body)
    na, nb = g.find_event_record_node(a), g.find_event_record_node(b)
    assert (na.graph_event.raw, nb.graph_event.raw) == (a.raw, b.raw)
    assert na.node == na.task != nb.task
    with pytest.raises(ValueError, match="not recorded by any task"):
        g.find_event_record_node(c)
    fresh = [gt.EventHandle(), gt.EventHandle()]
    acl_log.clear()
    g.set_events([na, nb], fresh)
    assert acl_log.names().count("aclmdlRITaskSetParams") == 2
    assert acl_log.names().count("aclmdlRIUpdate") == 1
    assert [n.event.raw for n in g.event_record_nodes()] == [e.raw for e in fresh]
    with pytest.raises(ValueError, match="2 nodes but 1 events"):
        g.set_events([na, nb], fresh[:1])


def test_graph_timer_protocol_members(native, fake, stream):
    gt = native.graph_timer
    g = capture(native, fake, stream, lambda: gt.EventHandle().record(stream))
    assert g.modified is False and g.timing_enabled is True
    g.instantiate()
    g.launch(stream)
    g.set_timing_enabled(True)
    with pytest.raises(
        NotImplementedError, match="ACL cannot remove or skip the event-record tasks"
    ):
        g.set_timing_enabled(False)
    assert gt.EventHandle(-1).device in (0, 1)
