"""A common stream's chunks, made and written by the engine client's message handler (issue 25).

Most streams are one prompt, one choice, no logprobs, no echo, no tool-call parsing, their text
made in this front end. Such a stream needs no Python per token on its HTTP handler's side: when
a step's message comes, the engine client (``client.py``) hands the stream its new token ids;
``TokenStream`` detokenizes them, fills the chunk's template (every field but the text encoded
once, by the same ``ResponseBuilder`` that makes the general chunks) and writes the SSE event:

- **straight to the connection** when the server is uvicorn with its httptools protocol: the bytes
  go into the transport with chunked framing, exactly as uvicorn's own ``send`` writes a body part
  (``uvicorn/protocols/http/httptools_impl.py``), and the handler task is not woken;
- **into the request's sink as bytes** under any other server (uvicorn's h11 protocol, an ASGI
  test client): the handler then sends whatever bytes have gathered in one ``send``.

Streams coalesce: the engine client reads every message waiting on its socket before it writes
(``add``, then ``flush`` once the socket is empty), so when the front end has fallen behind the
engine, each stream's waiting tokens go out as one chunk (one detokenizer call, one write)
instead of one chunk per step; a front end that keeps up writes every step as it comes.

Per token and stream that is a dict lookup, the detokenizer's step, one ``orjson.dumps`` of the
text and one write, where the general path woke the handler task, merged a delta, built the
chunk's dicts and sent it through three ASGI ``send`` wrappers. The request's last delta (its
finish reason), a failure or a cut still go through the sink to the handler, which writes the
closing chunks after everything written here (the order on the wire is the order of events).

A reader that stalls: uvicorn pauses writing once its transport holds more than its high-water
mark. Each chunk written while paused counts one undelivered step; at ``--max-stream-buffer`` of
them the engine client cuts the stream (as it cuts a general stream whose sink holds that many).

The path is chosen per request (``app._respond``); everything else goes the general way.
Reaching into uvicorn's request cycle is a choice made for speed (23-32 us a token saved, guide
10); it is checked by module name and state, and anything unexpected takes the sink.
"""

from __future__ import annotations

from typing import Any

import orjson

#: the module of the uvicorn protocol whose request cycle this writes to directly
_UVICORN_HTTPTOOLS = "uvicorn.protocols.http.httptools_impl"


class TokenStream:
    """One stream's chunks between two engine messages and its HTTP handler.

    ``head`` + JSON string of the new text + ``tail`` is one SSE event; ``interval``: at least
    this many tokens a chunk (``--stream-interval``; the rest waits, then goes out with the last
    delta); ``choice``: the builder's record whose ``num_tokens`` counts the tokens written here
    (usage, the access log); ``sink``: the request's delta sink (the queued way out)."""

    __slots__ = ("_choice", "_direct", "_flow", "_head", "_held", "_held_tokens", "_interval", "_paused",
                 "_pending", "_sink", "_tail", "_transport", "text")

    def __init__(self, head: bytes, tail: bytes, interval: int, choice: Any, sink: Any) -> None:
        self._head, self._tail = head, tail
        self._interval = interval
        self._choice = choice
        self._sink = sink
        self.text: Any = None  # the request's RequestText (output_text.py), set by the engine client
        self._held = ""  # text waiting for --stream-interval tokens
        self._held_tokens = 0
        self._transport: Any = None  # uvicorn's transport and flow control, once known
        self._flow: Any = None
        self._direct = False
        self._paused = 0  # chunks written straight while uvicorn had paused writing (a stalled reader)
        self._pending: list[int] = []  # token ids of the engine messages being drained (add / flush)

    # ---- the engine client's side (client.py) ------------------------------------------------
    def add(self, ids: list[int]) -> bool:
        """Keep a message's new tokens until ``flush``: the engine client drains every message
        waiting on its socket before it writes, so a front end that fell behind sends all of a
        stream's waiting tokens as one chunk. Whether the stream had nothing pending before."""
        first = not self._pending
        self._pending += ids
        return first

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def flush(self) -> None:
        """Write what ``add`` kept (one chunk, or held for ``--stream-interval``)."""
        ids, self._pending = self._pending, []
        if ids:
            self.tokens(ids)

    def drop_pending(self) -> None:
        """Forget what ``add`` kept (the request was cut, aborted or failed)."""
        self._pending = []

    def tokens(self, ids: list[int]) -> None:
        """A step's new tokens of the request (not its last: that delta goes through the sink)."""
        text = self.text.step(ids)
        self._choice.num_tokens += len(ids)
        if self._interval > 1:
            self._held += text
            self._held_tokens += len(ids)
            if self._held_tokens < self._interval:
                return
            text, self._held, self._held_tokens = self._held, "", 0
        if not text:
            return  # an incomplete character: it comes with a later token
        event = self._head + orjson.dumps(text) + self._tail
        if not self._direct:
            self._sink.put_nowait(event)
            return
        transport = self._transport
        if transport.is_closing():
            return  # the client is gone: its disconnect ends the request
        transport.write(b"%x\r\n%b\r\n" % (len(event), event))  # uvicorn's chunked framing
        self._paused = self._paused + 1 if self._flow.write_paused else 0

    @property
    def direct(self) -> bool:
        """Whether chunks are written straight to the connection now."""
        return self._direct

    def backlog(self) -> int:
        """Undelivered steps: chunks waiting in the sink, or written while the transport was full."""
        return self._paused if self._direct else self._sink.qsize()

    # ---- the HTTP handler's side (app.py) ----------------------------------------------------
    def use_connection(self, receive: Any) -> None:
        """After the response started: remember uvicorn's transport when ``receive`` is the
        httptools request cycle's, its response chunked and under way."""
        cycle: Any = getattr(receive, "__self__", None)
        if type(cycle).__module__ != _UVICORN_HTTPTOOLS:
            return
        transport, flow = getattr(cycle, "transport", None), getattr(cycle, "flow", None)
        if (transport is None or flow is None or getattr(cycle, "chunked_encoding", None) is not True
                or not getattr(cycle, "response_started", False) or getattr(cycle, "response_complete", True)
                or cycle.scope.get("method") == "HEAD"):
            return
        self._transport, self._flow = transport, flow

    def go_direct(self) -> bool:
        """Write straight to the connection from now on, when it is known and nothing waits in the
        sink (what waits must go out first); whether chunks are written straight."""
        if not self._direct and self._transport is not None and self._sink.empty():
            self._direct = True
        return self._direct

    def take_held(self) -> str:
        """The text held back for ``--stream-interval`` (it goes before the last delta's text)."""
        text, self._held, self._held_tokens = self._held, "", 0
        return text
