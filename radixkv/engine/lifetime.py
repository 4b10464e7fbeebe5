"""Engine lifetime: ``close()`` at interpreter exit for every engine still open.

One ``atexit`` hook (registered with the first engine) closes the engines in a
:class:`weakref.WeakSet`, so tracking an engine never keeps it alive: an engine dropped before exit
is simply gone (its disk writer still drains its queue at exit, see ``DiskStore``), one still
referenced is closed, which makes its disk tier durable (``TieredCache.shutdown``).
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Protocol

__all__ = ["Closable", "close_open_engines", "track", "untrack"]

logger = logging.getLogger(__name__)


class Closable(Protocol):
    """What this module needs of an engine: ``close()`` (idempotent)."""

    def close(self) -> object: ...


_open: weakref.WeakSet[Closable] = weakref.WeakSet()
_lock = threading.Lock()
_registered = False


def track(engine: Closable) -> None:
    """Close ``engine`` at interpreter exit unless it is closed (or collected) before."""
    global _registered
    with _lock:
        if not _registered:
            atexit.register(close_open_engines)
            _registered = True
        _open.add(engine)


def untrack(engine: Closable) -> None:
    """Forget ``engine`` (it was closed)."""
    with _lock:
        _open.discard(engine)


def close_open_engines() -> None:
    """Close every engine still open (the atexit hook); one failure does not stop the others."""
    with _lock:
        engines = list(_open)
    for engine in engines:
        try:
            engine.close()
        except Exception:  # pragma: no cover - exit path: log and go on
            logger.exception("closing an engine at exit failed")
