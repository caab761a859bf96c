"""A stream's plumbing in a front end, without a model (issue 25): the per-request delta sink, a
lone delta's merge, and the SSE loop's ends — a client gone while its next chunk is awaited, the
cut-off at shutdown, an error — each closing the request once."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")

from deepinfer.serve.access_log import AccessRecord
from deepinfer.serve.engine_run import DeltaSink, merge_deltas
from deepinfer.serve.engine_thread import RequestDelta, SampleDelta
from deepinfer.serve.event_stream import event_stream
from deepinfer.serve.guard import SHUTDOWN_MESSAGE
from deepinfer.serve.protocol import APIError


def test_the_delta_sink_is_a_fifo_whose_get_waits_and_survives_a_cancelled_get():
    async def main() -> None:
        sink = DeltaSink()
        assert sink.empty() and sink.qsize() == 0 and not sink.full()
        with pytest.raises(asyncio.QueueEmpty):
            sink.get_nowait()
        sink.put_nowait(1)
        sink.put_nowait(2)
        assert sink.qsize() == 2 and await sink.get() == 1 and sink.get_nowait() == 2
        waiting = asyncio.ensure_future(sink.get())
        await asyncio.sleep(0)
        assert not waiting.done()
        sink.put_nowait(3)
        assert await waiting == 3
        cancelled = asyncio.ensure_future(sink.get())
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        sink.put_nowait(4)  # (no waiter left behind to wake)
        await sink.put(5)
        assert [await sink.get(), await sink.get()] == [4, 5] and sink.empty()

    asyncio.run(main())


def test_a_lone_delta_is_returned_as_it_is_and_several_merge_as_before():
    d = RequestDelta(0, [SampleDelta(0, [5], "a", None, None, None)], False)
    assert merge_deltas([d]) == [d] and merge_deltas([d])[0] is d
    e = RequestDelta(0, [SampleDelta(0, [6], "b", None, "length", None)], True)
    (m,) = merge_deltas([d, e])
    assert m.samples[0].token_ids == [5, 6] and m.samples[0].text == "ab" and m.finished
    assert d.samples[0].token_ids == [5]  # (merging copies)


class FakeRequest:
    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}


async def _collect(stream: Any, out: list[bytes]) -> None:
    async for chunk in stream:
        out.append(chunk)


def test_a_client_gone_while_its_next_chunk_is_awaited_ends_the_stream_and_closes_once():
    async def main() -> None:
        sink = DeltaSink()
        closed: list[int] = []

        async def chunks() -> Any:
            while True:
                yield {"n": await sink.get()}

        request, record = FakeRequest(), AccessRecord()
        out: list[bytes] = []
        task = asyncio.ensure_future(
            _collect(event_stream(request, chunks(), record, lambda: closed.append(1)), out)
        )
        sink.put_nowait(1)
        for _ in range(5):
            await asyncio.sleep(0)
        assert out == [b'data: {"n":1}\n\n']
        request.gone.set()  # the handler waits for its next chunk: it ends now, not at the next one
        await asyncio.wait_for(task, 5)
        assert record.note == "client disconnected" and closed == [1]
        assert out == [b'data: {"n":1}\n\n'] and not task.cancelled()
        if hasattr(task, "cancelling"):  # (Python >= 3.11: the stream's own cancel was taken back)
            assert task.cancelling() == 0

    asyncio.run(main())


def test_the_shutdown_cut_off_and_an_error_become_an_error_event_then_done():
    async def cut_off() -> None:
        async def never() -> Any:
            await asyncio.Event().wait()
            yield {}

        request, record, closed, out = FakeRequest(), AccessRecord(), [], []
        task = asyncio.ensure_future(
            _collect(event_stream(request, never(), record, lambda: closed.append(1)), out)
        )
        for _ in range(5):
            await asyncio.sleep(0)
        task.cancel()  # what uvicorn does at the end of --shutdown-timeout
        await asyncio.wait_for(task, 5)
        assert record.note == "cut off at shutdown" and closed == [1]
        assert (
            json.loads(out[0][6:])["error"]["message"] == SHUTDOWN_MESSAGE
            and out[-1] == b"data: [DONE]\n\n"
        )

    async def failing() -> None:
        async def bad() -> Any:
            yield {"n": 1}
            raise APIError(400, "no")

        request, record, closed, out = FakeRequest(), AccessRecord(), [], []
        await _collect(event_stream(request, bad(), record, lambda: closed.append(1)), out)
        assert record.note == "error 400" and closed == [1]
        assert out[0] == b'data: {"n":1}\n\n' and out[-1] == b"data: [DONE]\n\n"

    asyncio.run(cut_off())
    asyncio.run(failing())
