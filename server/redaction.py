"""What logs and answers may show of secrets: API keys on command lines and credentials in URLs.

:func:`redact_argv` replaces the value of every secret-bearing flag (``--api-key``, ``--admin-key``,
``--redis-password`` in both ``--flag VALUE`` and ``--flag=VALUE`` forms) by ``***`` and strips
credentials from URLs (:func:`radixkv.cache.remote_store.redact_url`), so a command line can be
logged whole. :func:`internal_error` is what a client sees of a server-side failure: a fixed
text and an id, the detail logged under that id.
"""

from __future__ import annotations

import logging
import re
import sys
import uuid
from collections.abc import Sequence

from radixkv.cache.remote_store import redact_url

__all__ = [
    "SECRET_FLAGS",
    "QueryKeyRedactor",
    "install_access_log_redactor",
    "internal_error",
    "redact_argv",
    "redact_query",
    "redact_url",
]

logger = logging.getLogger("radixkv.server")

SECRET_FLAGS = ("--api-key", "--admin-key", "--redis-password", "--requirepass")


def redact_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with secret flag values as ``***`` and URL credentials removed."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append("***")
            hide_next = False
            continue
        flag, eq, _ = arg.partition("=")
        if flag in SECRET_FLAGS:
            if eq:
                out.append(f"{flag}=***")
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(redact_url(arg) if "://" in arg else arg)
    return out


def internal_error(detail: str) -> str:
    """Log ``detail`` under a fresh id (with the traceback when called while an exception is
    being handled) and return the client's message, which names only the id (exception texts
    can carry prompt text, paths or configuration)."""
    error_id = uuid.uuid4().hex[:12]
    logger.error("internal error %s: %s", error_id, detail, exc_info=sys.exc_info()[0] is not None)
    return f"internal error (id {error_id}; the server log has the detail)"


#: query parameters whose values are secrets (``/dashboard?key=`` is refused, but the access log
#: line is written before any route runs)
_SECRET_QUERY = re.compile(r"(?i)([?&](?:key|api_key|token|access_token)=)[^&#\s]*")


def redact_query(path: str) -> str:
    """``path`` with the values of secret-looking query parameters (``key``, ``api_key``,
    ``token``, ``access_token``) replaced by ``***``."""
    return _SECRET_QUERY.sub(r"\1***", path)


class QueryKeyRedactor(logging.Filter):
    """A filter for uvicorn's access log: the request path's secret query values become ``***``
    (uvicorn's record args are ``(client, method, path, http_version, status)``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str):
            record.args = (*args[:2], redact_query(args[2]), *args[3:])
        return True


def install_access_log_redactor() -> None:
    """Put one :class:`QueryKeyRedactor` on the ``uvicorn.access`` logger (idempotent)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, QueryKeyRedactor) for f in access.filters):
        access.addFilter(QueryKeyRedactor())
