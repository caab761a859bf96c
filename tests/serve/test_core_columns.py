"""The engine core's plain deltas as columns (issue 25): a core that sends them as columns and one
that sends every output as a RequestDelta give each front end the same deltas, in the same order,
and the same metric updates (abort, n > 1, logprobs, core-made text, a refused add, two front ends
included). Runs ``CoreEngine`` on this thread with a fake ROUTER socket."""

from __future__ import annotations

import os
import queue
from collections import Counter, defaultdict
from typing import Any

import msgspec
import numpy as np
import pytest

pytest.importorskip("zmq", reason="pyzmq (the serve extra) is not installed")

from deepinfer.runtime.sampling_params import SamplingParams
from deepinfer.serve.client import Message, _split_columns
from deepinfer.serve.core import CoreEngine
from deepinfer.serve.engine_thread import RequestDelta, SampleDelta

FRONT_ENDS = (b"fe-a", b"fe-b")


class FakeRouter:
    def __init__(self) -> None:
        self.sent: list[tuple[bytes, bytes]] = []

    def send_multipart(self, parts: list[bytes], flags: int = 0) -> None:
        self.sent.append((parts[0], parts[1]))


class Script:
    """The adds at the first turn; each ``(turn, command)`` once the loop has waited that many turns."""

    def __init__(
        self, first: list[tuple[Any, ...]], later: list[tuple[int, tuple[Any, ...]]]
    ) -> None:
        self._ready = list(first)
        self._later = sorted(later, key=lambda x: x[0])
        self._turn = 0

    def get(self) -> tuple[Any, ...]:
        if self._ready:
            return self._ready.pop(0)
        if self._later:
            return self._later.pop(0)[1]
        return ("stop",)

    def get_nowait(self) -> tuple[Any, ...]:
        if self._ready:
            return self._ready.pop(0)
        self._turn += 1
        while self._later and self._later[0][0] <= self._turn:
            self._ready.append(self._later.pop(0)[1])
        if self._ready:
            return self._ready.pop(0)
        raise queue.Empty


def requests() -> list[tuple[str, bytes, list[int], SamplingParams]]:
    def sp(**kw: Any) -> SamplingParams:
        return SamplingParams(**{"temperature": 0.0, "ignore_eos": True, "detokenize": False, **kw})

    prompt = [504, 3458, 282, 1345, 314]
    return [
        ("plain-a", FRONT_ENDS[0], prompt, sp(max_tokens=6)),
        ("plain-b", FRONT_ENDS[1], prompt[:3], sp(max_tokens=8)),
        ("one-token", FRONT_ENDS[1], prompt, sp(max_tokens=1)),
        (
            "core-text",
            FRONT_ENDS[0],
            prompt,
            sp(max_tokens=5, detokenize=True, stop=["never in it"]),
        ),
        ("n2", FRONT_ENDS[0], prompt, sp(max_tokens=4, n=2)),
        ("logprobs", FRONT_ENDS[1], prompt, sp(max_tokens=4, logprobs=2)),
        ("aborted", FRONT_ENDS[0], prompt[1:], sp(max_tokens=12)),
        ("refused", FRONT_ENDS[1], [10**9], sp(max_tokens=4)),
    ]


def run(llm: Any, columnar: bool, defer: bool = True, later: Any = None,
        sock: Any = None) -> tuple[dict[str, list[Any]], list[Any], int]:
    """Each request's items as its front end rebuilds them (client.py), every metric event, and the
    rows that came as columns (``defer``: a step's outputs sent during the next step, the core's
    default; ``later``: the commands after the adds, by default an abort at the fourth turn)."""
    sock = FakeRouter() if sock is None else sock
    core = CoreEngine(llm, sock, {}, os.getppid())
    core.columnar = columnar
    core.defer_outputs = defer
    for ident in FRONT_ENDS:
        core.frontends[ident] = os.getpid()
    adds = [
        ("add", rid, prompt, params, (ident, rid), i, 0.0, None)
        for i, (rid, ident, prompt, params) in enumerate(requests())
    ]
    later = [(4, ("abort", "aborted"))] if later is None else later
    core._commands = Script(adds, later)  # type: ignore[assignment]
    core.run()
    assert core.error is None
    decoder = msgspec.msgpack.Decoder(Message)
    items: dict[str, list[Any]] = defaultdict(list)
    events: list[Any] = []
    rows = 0
    owner = {rid: ident for rid, ident, _, _ in requests()}
    for ident, raw in sock.sent:
        kind, payload, deltas, failures, columns = decoder.decode(raw)
        assert kind == "batch"
        if ident == FRONT_ENDS[0]:  # (every front end gets the same events)
            events += payload
        for rids, counts, tokens in columns:
            for rid, ids in zip(rids, _split_columns(rids, counts, tokens), strict=True):
                assert owner[rid] == ident
                items[rid].append(
                    RequestDelta(
                        0, [SampleDelta(0, ids, "", None, None, None)] if ids else [], False
                    )
                )
                rows += 1
        for rid, item in deltas + failures:
            assert owner[rid] == ident
            items[rid].append(item)
    return dict(items), events, rows


def metric_totals(events: list[Any]) -> tuple[Counter[Any], dict[Any, Any]]:
    """Counter increments summed, and per histogram its observations (values where they are not
    times, else how many)."""
    incs: Counter[Any] = Counter()
    observed: dict[Any, Any] = defaultdict(list)
    timed = {"ttft", "itl", "e2e", "queue_time", "inference_time", "prefill_time", "decode_time"}
    for e in events:
        if e[0] != "metric":
            continue
        _, name, key, op, value = e
        if op == "inc":
            incs[(name, key)] += value
        else:
            values = value if op == "observe_many" else [value]
            observed[(name, key)] += [None] * len(values) if name in timed else values
    return incs, {k: sorted(v, key=repr) for k, v in observed.items()}


def test_columns_give_each_front_end_the_deltas_and_metrics_of_request_deltas(reference_llm):
    objects, object_events, none = run(reference_llm, columnar=False)
    columns, column_events, rows = run(reference_llm, columnar=True)
    assert none == 0 and rows > 0
    # (tags: a column row carries none, its front end takes it from the request's route)
    for items in (objects, columns):
        for d in (d for ds in items.values() for d in ds):
            d.tag = 0
    assert columns == objects
    assert columns["refused"][0].status == 400
    # an aborted request's outputs stop (its front end dropped it already): no finished delta
    aborted = columns["aborted"]
    assert 0 < sum(len(d.samples[0].token_ids) for d in aborted if d.samples) < 12
    assert not any(d.finished for d in aborted)
    assert [len(d.samples[0].token_ids) for d in columns["plain-b"]] == [1] * 8
    assert metric_totals(column_events) == metric_totals(object_events)
    incs, _ = metric_totals(column_events)
    assert incs[("finished", "abort")] == 1
    assert incs[("generation_tokens", None)] == sum(
        len(s.token_ids)
        for ds in columns.values()
        for d in ds
        if isinstance(d, RequestDelta)
        for s in d.samples
    )


def test_columns_slot_is_checked_before_the_request_is_added(reference_llm):
    engine = reference_llm.engine
    ok = SamplingParams(max_tokens=2, detokenize=False)
    bad = [
        (dict(columns_slot=-1), ok, ValueError),
        (dict(columns_slot=2**31), ok, ValueError),
        (dict(columns_slot=True), ok, TypeError),
        (dict(columns_slot="1"), ok, TypeError),
        (
            dict(columns_slot=0),
            SamplingParams(max_tokens=2),
            ValueError,
        ),  # detokenize: text, not rows
        (dict(columns_slot=0, output_kind="cumulative"), ok, ValueError),
        (dict(columns_slot=0, collect="final"), ok, ValueError),
    ]
    for kw, params, error in bad:
        kw = {"output_kind": "delta", "collect": "all", **kw}
        with pytest.raises(error, match="columns_slot"):
            engine.add_request("col-bad", [504, 3458], params, **kw)
        assert "col-bad" not in engine.requests and engine.output_pool.num_columnar == 0
    engine.add_request(
        "col-ok",
        [504, 3458],
        SamplingParams(max_tokens=3, temperature=0.0, detokenize=False),
        output_kind="delta",
        collect="all",
        columns_slot=5,
    )
    assert engine.output_pool.num_columnar == 1
    engine.release("col-ok")  # released: unregistered, nothing left
    assert engine.output_pool.num_columnar == 0 and "col-ok" not in engine.requests
    assert engine.take_columns()[0].tolist() == []


class _ColumnsEngine:
    """One step's rows as ``EngineLoop.take_columns`` gives them: slots, offsets, token ids."""

    def __init__(self, slots: list[int], counts: list[int]) -> None:
        self.slots = np.array(slots, np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.tokens = np.arange(100, 100 + int(self.offsets[-1]), dtype=np.int64)

    def take_columns(self) -> tuple[Any, Any, Any]:
        return self.slots, self.offsets, self.tokens


@pytest.mark.parametrize("counts", [[1, 1, 1, 1, 1], [2, 0, 1, 3, 1], [1, 2, 1, 1, 0]])
def test_a_steps_rows_split_by_front_end_keep_each_rows_tokens(reference_llm, counts):
    """Rows of two front ends, interleaved, one token each (a plain decode) or several and none (a
    speculative step): each front end gets its own rows' ids, counts and tokens, in row order."""
    core = CoreEngine(reference_llm, FakeRouter(), {}, os.getppid())
    owners = [FRONT_ENDS[i % 2] for i in range(5)]
    slots = [core._new_slot((ident, f"r{i}"), f"r{i}") for i, ident in enumerate(owners)]
    engine = _ColumnsEngine(slots[::-1], counts)  # (rows in another order than the slots)
    itl: list[float] = []
    assert core._take_columns(engine, 1.0, itl) == sum(counts)
    rows = [(f"r{4 - j}", owners[4 - j]) for j in range(5)]
    start = np.concatenate([[0], np.cumsum(counts)])
    for ident in FRONT_ENDS:
        mine = [j for j, (_, owner) in enumerate(rows) if owner == ident]
        [(rids, raw_counts, raw_tokens)] = core._pending[ident][2]
        assert rids == [rows[j][0] for j in mine]
        assert np.frombuffer(raw_counts, "<i4").tolist() == [counts[j] for j in mine]
        assert np.frombuffer(raw_tokens, "<i4").tolist() == [100 + t for j in mine
                                                              for t in range(start[j], start[j + 1])]
    assert len(itl) == sum(1 for c in counts if c > 0)


def test_a_steps_outputs_go_while_the_next_step_runs_and_are_those_sent_after_it(reference_llm):
    """The core sends a step's outputs from the next step's ``after_launch`` (the device computes
    meanwhile), not after the step: every front end gets the same items and metric updates as
    from a core that sends after each step, and most messages leave while a launched step waits
    to be applied (none do without deferring)."""
    engine = reference_llm.engine
    trace: list[str] = []

    class TracedRouter(FakeRouter):
        def send_multipart(self, parts: list[bytes], flags: int = 0) -> None:
            trace.append("send")
            super().send_multipart(parts, flags)

    launch = engine.executor.launch

    def traced_launch(*args: Any, **kwargs: Any) -> Any:
        launched = launch(*args, **kwargs)
        apply = launched.apply

        def traced_apply(*a: Any, **k: Any) -> Any:
            trace.append("apply")
            return apply(*a, **k)

        launched.apply = traced_apply
        trace.append("launch")
        return launched

    engine.executor.launch = traced_launch  # type: ignore[method-assign]
    results, during = {}, {}
    try:
        for defer in (False, True):
            trace.clear()
            results[defer] = run(reference_llm, columnar=True, defer=defer, later=[], sock=TracedRouter())
            in_flight, sends, during[defer] = 0, 0, 0
            for e in trace:
                in_flight += {"launch": 1, "apply": -1}.get(e, 0)
                if e == "send":
                    sends += 1
                    during[defer] += in_flight > 0
            during[defer] = (during[defer], sends, trace.count("apply"))
    finally:
        engine.executor.launch = launch  # type: ignore[method-assign]
    (plain, plain_events, plain_rows), (deferred, deferred_events, deferred_rows) = results[False], results[True]
    assert deferred == plain and deferred_rows == plain_rows > 0
    assert metric_totals(deferred_events) == metric_totals(plain_events)
    assert during[False][0] == 0
    sent_during, sends, steps = during[True]
    # (outside a step: the refused add's failure before the first step, the last step's outputs
    # after it; each goes to every front end)
    assert steps > 5 and sent_during >= steps - 1 and sends - sent_during <= 2 * len(FRONT_ENDS), during


def test_a_core_that_fails_to_take_a_steps_outputs_dies_and_fails_every_open_request(reference_llm):
    """Taking the outputs runs inside the engine's next step (``after_launch``): its failure (a bug)
    must end the core as before, every open request failed with a 503 naming it, not be taken for
    a failed engine step that the loop would retry."""
    sock = FakeRouter()
    core = CoreEngine(reference_llm, sock, {}, os.getppid())
    for ident in FRONT_ENDS:
        core.frontends[ident] = os.getpid()
    plain = [r for r in requests() if r[0].startswith("plain")]
    core._commands = Script([("add", rid, prompt, params, (ident, rid), i, 0.0, None)  # type: ignore[assignment]
                             for i, (rid, ident, prompt, params) in enumerate(plain)], [])
    calls = 0
    take = core._take_columns

    def failing_take(*args: Any) -> int:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("a bug in taking the outputs")
        return take(*args)

    core._take_columns = failing_take  # type: ignore[method-assign]
    core.run()
    assert isinstance(core.error, RuntimeError) and "a bug in taking the outputs" in str(core.error)
    decoder = msgspec.msgpack.Decoder(Message)
    failed = {rid: f for _, raw in sock.sent for rid, f in decoder.decode(raw)[3]}
    assert set(failed) == {"plain-a", "plain-b"}
    assert all(f.status == 503 and "a bug in taking the outputs" in f.message for f in failed.values())
    assert calls == 3
    reference_llm.engine.release("plain-a")  # (the shared engine runs on for the other tests)
    reference_llm.engine.release("plain-b")
