"""Checks that run on every HTTP request before routing, parsing or auth: the ``Host`` header and
the size of the body.

:class:`RequestGuard` is a pure ASGI middleware:

* **Host** (against DNS rebinding: a web page whose name resolves to 127.0.0.1 would otherwise
  read ``/cache/tree`` or ``POST /flush_cache`` of a keyless server): when ``allowed_hosts`` is
  given, a request whose ``Host`` name (port dropped) is not in it is answered 421 at once. A
  server without API keys allows the loopback names only (:data:`LOOPBACK_HOSTS`) plus what
  ``--allowed-host`` adds; ``"*"`` allows any.
* **Origin** (against cross-site requests: a page on another site can POST to a loopback server
  without reading the answer, e.g. ``/flush_cache``): with ``allowed_hosts`` given (a keyless
  server or router), a request that can change state (any method but GET, HEAD, OPTIONS) and
  carries an ``Origin`` header (browsers send one on every cross-site and same-site POST) whose
  host is not an allowed name, or ``Origin: null``, is answered 403. Clients that are not
  browsers send no ``Origin``; the dashboard's own requests come from an allowed origin.
* **Body size**: a ``Content-Length`` over ``max_body_bytes`` is answered 413 before a byte of the
  body is read; a body without one (chunked) is read up to the limit and refused past it, so
  no request makes the server buffer or parse more than ``max_body_bytes``.

After a 413 the client is usually still sending. Closing a socket with unread data makes the
kernel send a reset, which can reach the client before it has read the 413, so it sees
"connection reset" instead of the error. A declared body of up to :data:`DRAIN_FACTOR` times the
limit is therefore drained: the connection stays open, and uvicorn reads the rest and throws it
away without buffering it, as nginx's lingering close does. A larger body, or a chunked one of
unknown length, is answered and the connection closed.

Both answer in the server's error shape (:func:`radixkv.server.protocol.error_body`).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

from .protocol import error_body

__all__ = ["DEFAULT_MAX_BODY_BYTES", "DRAIN_FACTOR", "LOOPBACK_HOSTS", "RequestGuard", "host_name"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 8 << 20
"""8 MiB: hundreds of times a full-context prompt as text or token ids."""

DRAIN_FACTOR = 8
"""An oversized body declared at most this many times the limit is read and discarded after the
413 (so the client sees the answer); a larger one closes the connection."""

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})

#: methods a cross-site page may send without changing anything
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


def host_name(host_header: str) -> str:
    """The name part of a ``Host`` header, lower case, without the port (``[::1]:80`` ->
    ``::1``)."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        return host.partition(":")[0]
    return host


class RequestGuard:
    """ASGI middleware: refuse a disallowed ``Host`` (421), a cross-site state-changing request
    (403) or an oversized body (413) before the app sees the request. ``allowed_hosts`` None:
    any host and origin."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES,
        allowed_hosts: Iterable[str] | None = None,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        hosts = None if allowed_hosts is None else {h.lower() for h in allowed_hosts}
        self.allowed_hosts = None if hosts is None or "*" in hosts else frozenset(hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.allowed_hosts is not None:
            name = host_name(headers.get("host", ""))
            if name not in self.allowed_hosts:
                await _refuse(
                    send,
                    421,
                    f"Host {name!r} is not served: a server without an API key answers only "
                    f"{sorted(self.allowed_hosts)} (DNS rebinding); start it with --api-key, or "
                    "--allowed-host NAME to add a name",
                    "host_not_allowed",
                )
                return
            origin = headers.get("origin")
            if origin is not None and scope.get("method") not in SAFE_METHODS:
                origin_host = urlsplit(origin.strip()).hostname if origin.strip() != "null" else ""
                if (origin_host or "").lower() not in self.allowed_hosts:
                    await _refuse(
                        send,
                        403,
                        f"a {scope.get('method')} from Origin {origin!r} is refused: a server "
                        "without an API key takes state-changing requests only from "
                        f"{sorted(self.allowed_hosts)} (cross-site requests); start it with "
                        "--api-key, or --allowed-host NAME to add a name",
                        "cross_origin",
                    )
                    return
        limit = self.max_body_bytes
        if limit is None or scope.get("method") in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit() or int(length) > limit:
                drain = length.isdigit() and int(length) <= DRAIN_FACTOR * limit
                await _refuse(send, 413, _too_large(limit), "body_too_large", close=not drain)
                return
            await self.app(scope, receive, send)  # the server reads exactly Content-Length
            return
        body, more = bytearray(), True
        while more:  # no Content-Length: read it here, up to the limit
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                await _refuse(send, 413, _too_large(limit), "body_too_large")
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)


def _too_large(limit: int) -> str:
    return f"The request body is larger than {limit} bytes (--max-body-bytes)"


async def _refuse(send: Send, status: int, message: str, code: str, *, close: bool = True) -> None:
    """Answer ``status``; ``close`` False keeps the connection, so the server reads and discards
    what the client is still sending instead of resetting it."""
    payload = json.dumps(error_body(message, code=code)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
