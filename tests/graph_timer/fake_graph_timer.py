"""A simulated backend ``graph_timer`` module for testing GraphTimer without a device.

A graph is a chain of ops (kernels with known durations, event-record nodes) on a
simulated clock. Replaying it advances the clock by each kernel's duration and by
RECORD_COST per executed event-record node, and stamps the event each record node records
*in the executable graph*. Re-recording an event overwrites its time, as on a GPU, so a
timer that did not swap events between replays would lose samples. Events complete only
when the simulated device is drained (``synchronize`` or ``DEVICE.drain()``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

RECORD_COST = 0.004  # ms per executed event-record node


class _Device:
    def __init__(self) -> None:
        self.now = 0.0
        self.in_flight: list[EventHandle] = []

    def drain(self) -> None:
        for ev in self.in_flight:
            ev.done = True
        self.in_flight.clear()


DEVICE = _Device()
_ids = itertools.count(1)


class EventHandle:
    def __init__(self, device: int = -1) -> None:
        self.device = 0 if device < 0 else device
        self.time: float | None = None
        self.done = False
        self.records = 0

    def record(self, stream: Any = 0) -> None:
        if isinstance(stream, Stream) and stream.capturing is not None:
            stream.capturing.ops.append(_Op(next(_ids), "event_record", event=self))
        else:
            self._stamp()

    def _stamp(self) -> None:
        self.time = DEVICE.now
        self.done = False
        self.records += 1
        DEVICE.in_flight.append(self)

    def elapsed_ms(self, end: EventHandle) -> float:
        if self.time is None or end.time is None:
            raise RuntimeError("event never recorded")
        if not (self.done and end.done):
            raise RuntimeError("not ready")
        return end.time - self.time

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        DEVICE.drain()


@dataclass
class _Op:
    id: int
    kind: str  # "kernel" or "event_record"
    event: EventHandle | None = None
    durations: Iterator[float] | None = None


class Stream:
    def __init__(self) -> None:
        self.capturing: FakeGraph | None = None


@dataclass
class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph(keep_graph=True): ops + the executable graph."""

    ops: list[_Op] = field(default_factory=list)
    exec_ops: list[_Op] | None = None
    exec_events: dict[int, EventHandle] = field(default_factory=dict)
    replays: int = 0

    def kernel(self, *durations: float) -> None:
        """Append a kernel; replay i runs durations[i % len] ms."""
        self.ops.append(_Op(next(_ids), "kernel", durations=itertools.cycle(durations)))

    def instantiate(self) -> None:
        self.exec_ops = list(self.ops)
        self.exec_events = {op.id: op.event for op in self.ops if op.event is not None}

    def replay(self) -> None:
        if self.exec_ops is None:
            self.instantiate()
        assert self.exec_ops is not None
        for op in self.exec_ops:
            if op.kind == "kernel":
                DEVICE.now += next(op.durations)
            else:
                self.exec_events[op.id]._stamp()
                DEVICE.now += RECORD_COST
        self.replays += 1


class EventRecordNodeHandle:
    def __init__(self, handle: GraphHandle, op: _Op) -> None:
        self._handle, self._op = handle, op
        self.graph_event = op.event
        self.captured = True

    @property
    def node(self) -> int:
        return self._op.id if self._handle.timing_enabled else 0

    @property
    def event(self) -> EventHandle:
        return self._handle.graph.exec_events[self._op.id]

    def set_event(self, event: EventHandle) -> EventHandle:
        g = self._handle.graph
        if self._handle.modified or g.exec_ops is None:
            raise RuntimeError("instantiate first")
        if self._op not in g.exec_ops:
            raise RuntimeError("node not in the executable graph")
        previous = g.exec_events[self._op.id]
        g.exec_events[self._op.id] = event
        return previous


class GraphHandle:
    def __init__(self, graph: FakeGraph, exec: int = 0, device: int = -1) -> None:
        if not isinstance(graph, FakeGraph):
            raise TypeError("graph must be a FakeGraph")
        self.graph = graph
        self.device = 0 if device < 0 else device
        self.modified = False
        self.timing_enabled = True
        self._timers: list[EventRecordNodeHandle] = []
        self._removed: list[tuple[int, _Op]] = []

    def nodes(self) -> list[int]:
        return [op.id for op in self.graph.ops]

    def node_type(self, node: int) -> str:
        return next(op.kind for op in self.graph.ops if op.id == node)

    def kernel_nodes(self) -> list[int]:
        return [op.id for op in self.graph.ops if op.kind == "kernel"]

    def find_event_record_node(self, event: EventHandle) -> EventRecordNodeHandle:
        for op in self.graph.ops:
            if op.event is event:
                handle = EventRecordNodeHandle(self, op)
                self._timers.append(handle)
                return handle
        raise ValueError("event is not recorded by any node of this graph")

    def _insert(self, index: int, event: EventHandle) -> EventRecordNodeHandle:
        op = _Op(next(_ids), "event_record", event=event)
        self.graph.ops.insert(index, op)
        self.modified = True
        handle = EventRecordNodeHandle(self, op)
        handle.captured = False
        self._timers.append(handle)
        return handle

    def _index(self, node: int) -> int:
        return next(i for i, op in enumerate(self.graph.ops) if op.id == node)

    def add_event_record_node(self, event: EventHandle, dependencies: list[int], dependents: list[int]):
        if dependents:
            return self._insert(self._index(dependents[0]), event)
        if dependencies:
            return self._insert(self._index(dependencies[-1]) + 1, event)
        return self._insert(0, event)

    def insert_timer_nodes(self, first: int, last: int, start: EventHandle, end: EventHandle):
        kernels = self.kernel_nodes()
        if not 0 <= first <= last < len(kernels):
            raise IndexError("kernel index out of range")
        s = self._insert(self._index(kernels[first]), start)
        e = self._insert(self._index(kernels[last]) + 1, end)
        return s, e

    def set_timing_enabled(self, enabled: bool) -> None:
        if enabled == self.timing_enabled:
            return
        timer_ops = {id(t._op) for t in self._timers}
        if not enabled:
            self._removed = [(i, op) for i, op in enumerate(self.graph.ops) if id(op) in timer_ops]
            self.graph.ops = [op for op in self.graph.ops if id(op) not in timer_ops]
        else:
            for i, op in self._removed:
                self.graph.ops.insert(i, op)
            self._removed = []
        self.timing_enabled = enabled
        self.modified = True

    def instantiate(self) -> None:
        self.graph.instantiate()
        self.modified = False

    def launch(self, stream: Any = 0) -> None:
        self.graph.replay()
