"""GraphTimer: named regions timed inside replayed device graphs.

Works on any backend's ``graph_timer`` handles (``EventHandle``, ``EventRecordNodeHandle``,
``GraphHandle``): by default the ones registered under the entry-point group
``deepinfer.graph_timer`` (the ``deepinfer`` package registers ``deepinfer._C.graph_timer``,
the selected backend's), looked up at first use. This wheel imports no package of ours by name.

How a sample is taken: every region is a pair of event-record nodes in the graph. After
each replay, ``step()`` keeps the events that replay records and swaps fresh events from a
pool into the executable graph, so back-to-back replays never overwrite each other's
samples; finished samples are read lazily (or when the pool runs dry). Each graph also
carries one empty region (two back-to-back records) whose median duration, the cost of
the timing itself, is subtracted from every region.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from deepinfer_graph_timer.stats import percentile, summarize

_CALIBRATION = "<empty region>"


def _default_stream() -> int:
    """torch's current stream on this process's accelerator (CUDA, or Ascend via torch_npu)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - depends on the environment
        raise RuntimeError("pass stream=... (torch is not installed to supply the current stream)") from None
    npu = getattr(torch, "npu", None)  # present once torch_npu is imported
    if npu is not None and npu.is_available() and not torch.cuda.is_available():
        return int(npu.current_stream().npu_stream)
    return int(torch.cuda.current_stream().cuda_stream)


def _stream_handle(stream: Any) -> Any:
    """None -> torch's current stream; a torch_npu stream -> its int handle; anything else is
    passed on as is (the backend's ``record`` takes ints and torch.cuda streams, and says
    what is wrong with anything else)."""
    if stream is None:
        return _default_stream()
    if hasattr(stream, "npu_stream"):
        return int(stream.npu_stream)
    return stream


@dataclass
class _Region:
    name: str
    start: Any  # EventRecordNodeHandle
    end: Any


@dataclass
class _Sample:
    events: list[Any]  # per node of the graph entry, in node order
    replay: int


@dataclass
class _GraphEntry:
    handle: Any  # GraphHandle
    owner: Any  # what the user passed (torch CUDAGraph or GraphHandle)
    index: int
    regions: list[_Region] = field(default_factory=list)  # regions[0] is the empty region
    current: list[Any] = field(default_factory=list)  # events the exec graph records now
    pending: list[_Sample] = field(default_factory=list)
    origin: Any = None  # start event of the first replay: the trace's time zero
    replays: int = 0

    def nodes(self) -> list[Any]:
        return [n for r in self.regions for n in (r.start, r.end)]


#: Entry-point group of the module that provides the selected backend's handles.
HANDLES_GROUP = "deepinfer.graph_timer"


def default_handles() -> ModuleType:
    """The graph_timer handles registered under the entry-point group ``deepinfer.graph_timer``
    (the ``deepinfer`` package's entry ``handles = "deepinfer._C.graph_timer"``: the backend its
    plugin registry selects). Found through package metadata, as backends are, so this wheel
    names no package of ours; ImportError says what to install when none is registered."""
    from importlib.metadata import entry_points

    found = sorted(entry_points(group=HANDLES_GROUP), key=lambda ep: ep.name)
    if not found:
        raise ImportError(
            f"no graph_timer handles are registered (entry-point group {HANDLES_GROUP!r}): install "
            '"deepinfer[cuda]" or "deepinfer[ascend]", or pass graph_timer=<a backend\'s graph_timer module>')
    module = found[0].load()
    if not isinstance(module, ModuleType):
        raise ImportError(f"entry point {found[0].name!r} of group {HANDLES_GROUP!r} is not a module: {found[0].value}")
    return module


class GraphTimer:
    """Time named regions inside replayed device graphs.

    graph_timer: the backend's graph_timer module (default: the one registered under the
    entry-point group ``deepinfer.graph_timer`` — ``deepinfer._C.graph_timer`` when the
    ``deepinfer`` package is installed — looked up at first use). device: the device index the graphs run on (-1: current).
    pool_size: how many replays of one graph may be in flight before ``step()`` waits for
    the oldest to finish. enabled: start with timing on (False keeps every timer node out
    of the executable graphs until :meth:`enable`).
    """

    def __init__(
        self,
        graph_timer: ModuleType | None = None,
        *,
        device: int = -1,
        pool_size: int = 64,
        enabled: bool = True,
    ) -> None:
        if pool_size < 1:
            raise ValueError(f"pool_size={pool_size} must be >= 1")
        self._module = graph_timer
        self._device = device
        self._pool_size = pool_size
        self._enabled = enabled
        self._pool: list[Any] = []
        self._capturing: list[tuple[str, Any, Any]] = []  # regions recorded, not attached yet
        self._entries: dict[int, _GraphEntry] = {}
        self._samples: dict[str, list[float]] = {}
        self._overhead: list[float] = []
        self._trace: list[dict[str, Any]] = []

    # -- backend -------------------------------------------------------------------------
    @property
    def graph_timer(self) -> ModuleType:
        """The backend module providing EventHandle / GraphHandle."""
        if self._module is None:
            self._module = default_handles()
        return self._module

    def _new_event(self) -> Any:
        return self.graph_timer.EventHandle(self._device)

    def _take_event(self, entry: _GraphEntry) -> Any:
        if not self._pool:
            if self._outstanding_events() >= self._pool_size * max(1, len(entry.current)):
                self._harvest(entry, wait=True, keep=len(entry.pending) - 1)
            if not self._pool:
                return self._new_event()
        return self._pool.pop()

    def _outstanding_events(self) -> int:
        return sum(len(s.events) for e in self._entries.values() for s in e.pending)

    # -- registering regions ---------------------------------------------------------------
    @contextlib.contextmanager
    def region(self, name: str, stream: Any = None) -> Iterator[None]:
        """Time the work enqueued inside the ``with`` block while a graph is being captured.

        stream: the capturing stream (an int handle, or a torch.cuda.Stream / torch_npu stream;
        default: torch's current stream on this accelerator). Call :meth:`attach` with the graph after the capture ends.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"region name must be a non-empty str, got {name!r}")
        s = _stream_handle(stream)
        if not self._capturing:
            # The empty region, recorded first, measures what a region's two records cost.
            calib_start, calib_end = self._new_event(), self._new_event()
            calib_start.record(s)
            calib_end.record(s)
            self._capturing.append((_CALIBRATION, calib_start, calib_end))
        start, end = self._new_event(), self._new_event()
        start.record(s)
        yield
        end.record(s)
        self._capturing.append((name, start, end))

    def attach(self, graph: Any) -> Any:
        """Bind the regions recorded during the last capture to ``graph`` (a torch
        ``CUDAGraph(keep_graph=True)`` or a ``GraphHandle``) and return its GraphHandle."""
        entry = self._entry(graph)
        if self._capturing:
            if len(entry.regions) > 0:
                raise RuntimeError("this graph already has regions; attach() each capture's regions once")
            for name, start, end in self._capturing:
                entry.regions.append(
                    _Region(
                        name,
                        entry.handle.find_event_record_node(start),
                        entry.handle.find_event_record_node(end),
                    )
                )
            self._capturing = []
            entry.current = [n.graph_event for n in entry.nodes()]
            if not self._enabled:
                self._apply_enabled(entry)
        return entry.handle

    def add_kernel_region(self, graph: Any, name: str, first: int, last: int) -> None:
        """Time kernels ``first..last`` (indices into ``GraphHandle.kernel_nodes()``, inclusive)
        of an already captured ``graph`` by inserting timer nodes; the graph is re-instantiated
        before its next timed replay."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"region name must be a non-empty str, got {name!r}")
        if not self._enabled:
            raise RuntimeError("add regions while timing is enabled (call enable() first)")
        entry = self._entry(graph)
        handle = entry.handle
        if not entry.regions:
            kernels = handle.kernel_nodes()
            if not kernels:
                raise ValueError("the graph has no kernel nodes to time")
            calib_start = handle.add_event_record_node(self._new_event(), [], [])
            calib_end = handle.add_event_record_node(self._new_event(), [calib_start.node], [kernels[0]])
            entry.regions.append(_Region(_CALIBRATION, calib_start, calib_end))
        start, end = handle.insert_timer_nodes(first, last, self._new_event(), self._new_event())
        entry.regions.append(_Region(name, start, end))
        entry.current = [n.graph_event for n in entry.nodes()]

    def _entry(self, graph: Any) -> _GraphEntry:
        key = id(graph)
        entry = self._entries.get(key)
        if entry is None:
            gt = self.graph_timer
            handle = graph if isinstance(graph, gt.GraphHandle) else gt.GraphHandle(graph, device=self._device)
            entry = _GraphEntry(handle=handle, owner=graph, index=len(self._entries))
            self._entries[key] = entry
        return entry

    # -- replays ---------------------------------------------------------------------------
    def _instantiate(self, entry: _GraphEntry) -> None:
        entry.handle.instantiate()
        # A new executable graph records each node's graph event: re-apply the rotation.
        if entry.handle.timing_enabled:
            changed = [(n, e) for n, e in zip(entry.nodes(), entry.current, strict=True) if e is not n.graph_event]
            if changed:
                self._swap(entry, [n for n, _ in changed], [e for _, e in changed])

    @staticmethod
    def _swap(entry: _GraphEntry, nodes: list[Any], events: list[Any]) -> None:
        batch = getattr(entry.handle, "set_events", None)  # optional, one call for all nodes
        if batch is not None:
            batch(nodes, events)
        else:
            for node, event in zip(nodes, events, strict=True):
                node.set_event(event)

    def replay(self, graph: Any, stream: Any = None) -> None:
        """Replay ``graph`` (torch ``CUDAGraph.replay()``, or ``GraphHandle.launch(stream)``)
        and take its sample with :meth:`step`."""
        entry = self._entry(graph)
        if entry.handle.modified:
            self._instantiate(entry)
        if entry.owner is entry.handle:
            entry.handle.launch(0 if stream is None else stream)
        else:
            entry.owner.replay()
        self.step(graph)

    def step(self, graph: Any = None) -> None:
        """Call right after each replay of ``graph`` (may be omitted with one graph): keeps that
        replay's events and swaps fresh ones in for the next replay. No-op while disabled."""
        if not self._enabled:
            return
        entry = self._only_entry() if graph is None else self._entry(graph)
        if not entry.regions:
            return
        if entry.handle.modified:
            raise RuntimeError("the graph changed since its last instantiation; replay it with GraphTimer.replay()")
        nodes = entry.nodes()
        entry.pending.append(_Sample(events=list(entry.current), replay=entry.replays))
        entry.replays += 1
        fresh = [self._take_event(entry) for _ in nodes]
        self._swap(entry, nodes, fresh)
        entry.current = fresh
        self._harvest(entry, wait=False, keep=0)

    def _only_entry(self) -> _GraphEntry:
        if len(self._entries) != 1:
            raise ValueError(f"step() needs graph=... when {len(self._entries)} graphs are attached")
        return next(iter(self._entries.values()))

    def _harvest(self, entry: _GraphEntry, *, wait: bool, keep: int) -> None:
        while len(entry.pending) > keep:
            sample = entry.pending[0]
            if wait:
                for event in sample.events:
                    event.synchronize()
            elif not all(event.query() for event in sample.events):
                return
            entry.pending.pop(0)
            self._read(entry, sample)

    def _read(self, entry: _GraphEntry, sample: _Sample) -> None:
        events = sample.events
        if entry.origin is None:
            entry.origin = events[0]  # kept out of the pool: time zero of the trace
        else:
            self._pool.append(events[0])
        overhead = events[0].elapsed_ms(events[1])
        self._overhead.append(overhead)
        for i, region in enumerate(entry.regions[1:], start=1):
            start, end = events[2 * i], events[2 * i + 1]
            duration = start.elapsed_ms(end)
            self._samples.setdefault(region.name, []).append(duration)
            self._trace.append(
                {
                    "name": region.name,
                    "ph": "X",
                    "pid": 0,
                    "tid": entry.index,
                    "ts": entry.origin.elapsed_ms(start) * 1000.0,
                    "dur": duration * 1000.0,
                    "args": {"replay": sample.replay},
                }
            )
        self._pool.extend(events[1:])

    def synchronize(self) -> None:
        """Wait for every replay taken so far and read its samples."""
        for entry in self._entries.values():
            self._harvest(entry, wait=True, keep=0)

    # -- enable / disable ------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self._enabled

    def enable(self) -> None:
        """Put the timer nodes back into every graph (re-instantiated; no recapture)."""
        self._set_enabled(True)

    def disable(self) -> None:
        """Take the timer nodes out of every graph, so replays cost exactly what an untimed
        graph costs; pending samples are read first."""
        self._set_enabled(False)

    def _set_enabled(self, enabled: bool) -> None:
        if enabled == self._enabled:
            return
        self.synchronize()
        self._enabled = enabled
        for entry in self._entries.values():
            self._apply_enabled(entry)

    def _apply_enabled(self, entry: _GraphEntry) -> None:
        entry.handle.set_timing_enabled(self._enabled)
        self._instantiate(entry)

    # -- results ---------------------------------------------------------------------------
    def overhead_ms(self) -> float:
        """Median duration of the empty region: the cost subtracted from every region."""
        self.synchronize()
        return percentile(sorted(self._overhead), 50.0) if self._overhead else 0.0

    def to_dict(self) -> dict[str, dict[str, float]]:
        """``{region: {"count", "mean_ms", "p50_ms", "p99_ms", "min_ms", "max_ms"}}``, with the
        empty region's median cost subtracted (never below 0)."""
        overhead = self.overhead_ms()
        return {
            name: summarize([max(0.0, v - overhead) for v in values]) for name, values in self._samples.items()
        }

    def table(self) -> str:
        """The statistics as a fixed-width text table."""
        stats = self.to_dict()
        width = max([len("region")] + [len(n) for n in stats])
        lines = [
            f"{'region':<{width}}  {'count':>7}  {'mean ms':>10}  {'p50 ms':>10}  {'p99 ms':>10}",
        ]
        for name, s in stats.items():
            lines.append(
                f"{name:<{width}}  {s['count']:>7d}  {s['mean_ms']:>10.4f}  {s['p50_ms']:>10.4f}  {s['p99_ms']:>10.4f}"
            )
        lines.append(f"(empty-region cost subtracted: {self.overhead_ms() * 1000.0:.2f} us)")
        return "\n".join(lines)

    def chrome_trace(self, path: str | None = None) -> dict[str, Any]:
        """Every sample as a Chrome-trace event (``chrome://tracing``, Perfetto): ``ts``/``dur``
        in microseconds from the first replay's start, one ``tid`` per graph. Written to
        ``path`` as JSON when given; returned as a dict."""
        self.synchronize()
        trace = {"traceEvents": list(self._trace), "displayTimeUnit": "ms"}
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(trace, f)
        return trace

    def reset(self) -> None:
        """Forget every sample taken so far (regions and graphs stay registered)."""
        self.synchronize()
        self._samples.clear()
        self._overhead.clear()
        self._trace.clear()


CUDAGraphTimer = GraphTimer
