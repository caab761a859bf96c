"""One access-log line per HTTP request: client, method, path, status, request id, tokens, latency.

A plain ASGI middleware: it sees the status a response starts with and logs once the app has
returned (for a stream: after its last chunk, or after the client went away). The path is the
one on the wire, its percent escapes kept and anything else unprintable escaped, so a request
can never write a second (forged) line.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("deepinfer.serve.access")


# the scope key of the send this middleware got: the send an event stream writes its chunks with
BODY_SEND = "deepinfer.body_send"


@dataclass
class AccessRecord:
    """Filled by the handlers (``request.state.access``) for the log line."""

    request_id: str = "-"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    note: str = ""


class AccessLogMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        record = AccessRecord()
        scope.setdefault("state", {})["access"] = record
        scope[BODY_SEND] = send  # (an event stream's chunks skip the wrappers below that watch only the start)
        status = [0]

        async def send_and_watch(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            client = scope.get("client") or ("-", 0)
            log.info('%s:%s "%s %s" %d id=%s prompt_tokens=%d completion_tokens=%d latency=%.3fs%s',
                     client[0], client[1], scope["method"], escape_path(scope), status[0] or 499,
                     record.request_id, record.prompt_tokens, record.completion_tokens,
                     time.perf_counter() - t0, f" ({record.note})" if record.note else "")


def escape_path(scope: Any) -> str:
    """The request's path as it came on the wire (``raw_path``: percent escapes kept), with
    every byte outside printable ASCII, backslash and double quote written as ``\\xNN``: one
    log line per request, whatever the path holds."""
    raw = scope.get("raw_path")
    if not isinstance(raw, bytes):
        raw = str(scope.get("path", "")).encode("utf-8", "backslashreplace")
    return "".join(chr(b) if 0x21 <= b <= 0x7E and b not in (0x22, 0x5C) else f"\\x{b:02x}" for b in raw)
