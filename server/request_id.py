"""``X-Request-Id``, as vLLM and most proxies use it: the id a client (or a proxy in front, such
as ``radixkv router``, which forwards it) sends is returned on the answer, streams included; a
request without one, or with one that is not a short token (1 to 128 of ``A-Za-z0-9._:-``), gets
a fresh id. The id is also in :data:`REQUEST_ID` while the request is served, for logs.
"""

from __future__ import annotations

import re
import uuid
from contextvars import ContextVar
from typing import Any

__all__ = ["REQUEST_ID", "RequestIdMiddleware"]

REQUEST_ID: ContextVar[str | None] = ContextVar("radixkv_request_id", default=None)
_VALID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class RequestIdMiddleware:
    """Pure ASGI middleware: honour and return ``X-Request-Id`` (see the module docstring)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k.lower() == b"x-request-id"), b"")
        text = given.decode("latin-1")
        rid = text if _VALID.fullmatch(text) else uuid.uuid4().hex
        token = REQUEST_ID.set(rid)

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    (k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"
                ]
                headers.append((b"x-request-id", rid.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)
