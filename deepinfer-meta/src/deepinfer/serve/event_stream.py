"""Server-sent events of one response (``EventStream``, ``event_stream``) and the watch for a client
that goes away (``unless_disconnected`` for a response that is not streamed)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from deepinfer.serve.access_log import BODY_SEND, AccessRecord
from deepinfer.serve.guard import SHUTDOWN_MESSAGE, internal_error
from deepinfer.serve.protocol import APIError
from deepinfer.serve.responses import sse_events as _sse

log = logging.getLogger("deepinfer.serve")


class ClientGone(Exception):
    """The client disconnected before its response was complete."""


async def disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled (the shutdown timeout): the work ends too, its requests aborted
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientGone


async def event_stream(request: Request, chunks: AsyncIterator[Any], record: AccessRecord,
                        close: Callable[[], None]) -> AsyncIterator[bytes]:
    """SSE framing of ``chunks``; ends as soon as the client goes away, whether or not a chunk is
    due. An error, a failure of the server's own (its id logged once) or the cut-off at the end
    of --shutdown-timeout (uvicorn cancels the task) becomes an error event, then ``[DONE]``.
    ``close`` (synchronous: cleanup must not await) aborts the requests on every way out.

    The next chunk is awaited in this task; a disconnect while it waits cancels the task (and is
    told from uvicorn's cancel by ``gone``). (A task and an ``asyncio.wait`` per chunk, racing the
    chunk against the disconnect, cost ~2.5x the CPU of the whole hand-over per chunk.)"""
    task = asyncio.current_task()
    state = {"waiting": False, "gone": False}

    def on_disconnect(fut: asyncio.Future[None]) -> None:
        if fut.cancelled():
            return
        fut.exception()  # (a receive that failed counts as gone, as before; retrieved here)
        state["gone"] = True
        if state["waiting"] and task is not None:
            task.cancel()  # wakes the wait for the next chunk (told from a cut-off by "gone")

    watcher = asyncio.ensure_future(disconnected(request))
    watcher.add_done_callback(on_disconnect)
    try:
        while True:
            if state["gone"]:  # (gone while a chunk was written)
                record.note = "client disconnected"
                return
            state["waiting"] = True
            try:
                chunk = await chunks.__anext__()
            except asyncio.CancelledError:
                if state["gone"]:
                    uncancel = getattr(task, "uncancel", None)  # (Python >= 3.11 counts cancels)
                    if uncancel is not None:
                        uncancel()
                    record.note = "client disconnected"
                    return
                record.note = "cut off at shutdown"
                yield _sse(APIError(503, SHUTDOWN_MESSAGE).body())
                break
            except StopAsyncIteration:
                break
            except APIError as exc:
                record.note = f"error {exc.status}"
                yield _sse(exc.body())
                break
            except Exception as exc:  # an error event, never a stream that just stops
                error_id = f"err-{uuid.uuid4().hex[:16]}"
                log.exception("unhandled error %s in the stream of %s", error_id, record.request_id)
                record.note = f"error 500 {error_id}"
                yield _sse(internal_error(error_id, exc).body())
                break
            finally:
                state["waiting"] = False
            yield _sse(chunk)
        yield b"data: [DONE]\n\n"
    finally:
        state["waiting"] = False
        watcher.remove_done_callback(on_disconnect)
        watcher.cancel()
        close()


class EventStream(Response):
    """A ``text/event-stream`` response sent straight from ``events``.

    Not Starlette's StreamingResponse: under an ASGI 2.3 server that one runs the body in an
    anyio task group whose cancel scope cancels every later await once uvicorn cancels the
    request at the end of --shutdown-timeout, so the stream could not send its closing error
    event. Disconnects are ``event_stream``'s business (it watches ``receive`` itself)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_start: Callable[[Any], None] | None = None) -> None:
        self.events = events
        self.on_start = on_start  # called with the server's ``receive`` once the response started
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache"})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        if self.on_start is not None:
            self.on_start(receive)
        body_send = scope.get(BODY_SEND, send)
        try:
            async for chunk in self.events:
                await body_send({"type": "http.response.body", "body": chunk, "more_body": True})
            await body_send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away while a chunk was sent
            pass
        finally:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
