"""What every request passes before a route sees it, and what catches whatever a route lets out.

``RequestGuard`` is a plain ASGI middleware (inside the access log, outside CORS and the routes):

- **Host.** A ``Host`` header that names neither an IP address nor an allowed name gets a 403:
  a web page whose name an attacker re-points at this machine (DNS rebinding) sends its own
  name as Host, so it can neither send requests to the server nor read its answers.
- **Origin.** A request whose ``Origin`` is neither the server's own nor an allowed one
  (``--allowed-origins``) gets a 403, simple requests (a ``text/plain`` POST sent by a page
  without a preflight) included: a browser would stop the page from reading the answer, but
  not the request from running.
- **Catch-all.** An exception a route lets out becomes an OpenAI-shaped 500 naming an id, logged
  once with that id (never a bare text/plain 500). A request cut off at the end of
  ``--shutdown-timeout`` (uvicorn cancels its task) gets an OpenAI-shaped 503; a stream that
  was cut off ends with an error event and ``[DONE]`` (``event_stream.event_stream``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import socket
import uuid
from collections.abc import Iterable
from typing import Any

from deepinfer.serve.access_log import escape_path
from deepinfer.serve.protocol import APIError

log = logging.getLogger("deepinfer.serve")

SHUTDOWN_MESSAGE = "the server is shutting down: the request was cut off at the end of --shutdown-timeout"
_WILDCARD_BINDS = {"", "0.0.0.0", "::"}
_LOOPBACK_NAMES = {"localhost"}
_VERDICTS_KEPT = 256


def split_host(value: str) -> str:
    """The host part of a Host header or an origin's netloc, lowercase, without a port, the
    brackets of an IPv6 address or a trailing dot."""
    value = value.strip().lower()
    if value.startswith("["):  # [v6]:port
        end = value.find("]")
        return value[1:end] if end != -1 else value
    if value.count(":") == 1:  # name:port or v4:port (a bare v6 address has several colons)
        value = value.split(":", 1)[0]
    return value.rstrip(".")


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class HostPolicy:
    """Which Host headers the server answers.

    Always: any IP address (DNS rebinding needs a name the attacker controls; a page whose
    address is an IP literal is that address's own) and ``localhost``. Also: the ``--host``
    name, when it is a name; with a wildcard bind (``0.0.0.0``, ``::``) the machine's host name;
    and every ``--allowed-hosts`` entry: a name, ``.example.com`` for that domain and its
    subdomains, or ``*`` for any Host (no check).
    """

    def __init__(self, bind_host: str, allowed_hosts: Iterable[str] = ()) -> None:
        entries = [split_host(h) if h.strip() != "*" else "*" for h in allowed_hosts if h.strip()]
        self.any = "*" in entries
        self.suffixes = tuple(e for e in entries if e.startswith("."))
        self.names = set(_LOOPBACK_NAMES) | {e for e in entries if e != "*" and not e.startswith(".")}
        self._verdicts: dict[str, bool] = {}  # Host header -> allowed, the first _VERDICTS_KEPT seen
        bind = split_host(bind_host)
        if bind in _WILDCARD_BINDS:
            self.names.add(split_host(socket.gethostname()))
        elif not is_ip(bind):
            self.names.add(bind)

    def allows(self, host_header: str | None) -> bool:
        if self.any or host_header is None:  # (HTTP/1.0 may send none; a browser always does)
            return True
        verdict = self._verdicts.get(host_header)
        if verdict is None:  # (a client sends one Host over and over: parsing it cost ~2.5 us)
            verdict = self._allows(host_header)
            if len(self._verdicts) < _VERDICTS_KEPT:  # (bounded: a client may send any Host)
                self._verdicts[host_header] = verdict
        return verdict

    def _allows(self, host_header: str) -> bool:
        host = split_host(host_header)
        if host in self.names or is_ip(host):
            return True
        return any(host == s[1:] or host.endswith(s) for s in self.suffixes)


class RequestGuard:
    """Host and Origin checks, and the catch-all (see the module's docstring)."""

    def __init__(self, app: Any, hosts: HostPolicy, allowed_origins: Iterable[str]) -> None:
        self.app = app
        self.hosts = hosts
        self.origins = set(allowed_origins)

    def _refusal(self, headers: dict[str, str]) -> APIError | None:
        host = headers.get("host")
        if not self.hosts.allows(host):
            return APIError(403, f"the Host header {host!r} is not one this server answers to (it checks Host "
                                 "against DNS rebinding): use its address, or start it with --allowed-hosts "
                                 "naming this host", code="host_not_allowed")
        origin = headers.get("origin")
        if origin is None or "*" in self.origins or origin in self.origins:
            return None
        if host is not None and "://" in origin and origin.split("://", 1)[1].lower() == host.strip().lower():
            return None  # the server's own origin (its Host was checked above)
        return APIError(403, f"cross-origin requests from {origin!r} are not allowed (start the server with "
                             "--allowed-origins to allow them)", code="origin_not_allowed")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        record = scope.get("state", {}).get("access")
        refusal = self._refusal(headers)
        if refusal is not None:
            if record is not None:
                record.note = str(refusal.code)
            await send_error(send, refusal)
            return
        started = False

        async def watch(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except asyncio.CancelledError:
            # uvicorn cancels what still runs at the end of --shutdown-timeout; nothing else
            # cancels a request's task out to here (a client that leaves is noticed by the routes:
            # a stream's SSE loop cancels its own wait for the next chunk and takes that back)
            if record is not None:
                record.note = "cut off at shutdown"
            if started:
                raise
            await send_error(send, APIError(503, SHUTDOWN_MESSAGE))
        except Exception as exc:  # the catch-all: an OpenAI-shaped 500, logged once
            error_id = f"err-{uuid.uuid4().hex[:16]}"
            log.exception("unhandled error %s in %s %s", error_id, scope.get("method"), escape_path(scope))
            if record is not None:
                record.note = f"error 500 {error_id}"
            if not started:
                await send_error(send, internal_error(error_id, exc))


def internal_error(error_id: str, exc: BaseException) -> APIError:
    return APIError(500, f"internal server error {error_id} ({type(exc).__name__}); the server log has "
                         "its details under this id", code="internal_error")


async def send_error(send: Any, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
