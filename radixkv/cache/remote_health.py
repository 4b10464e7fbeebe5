"""The up/down state of the remote KV tier's shards (:mod:`radixkv.cache.remote_conn`).

:class:`ShardHealth` is owned by a :class:`~radixkv.cache.remote_store.RemoteStore` (its
``health``). It owns the down set (shard -> (backoff, time of the next probe)) and is handed, at
construction, what it shares with its store: the store's lock (every change to the down set is
under it), the store's counters (it counts ``went_down`` / ``came_back`` there) and
``on_back``, called under the lock when a shard answers again (the store forgets the keys it
wrote lately: a restarted server is empty). ``shards`` is None in simulation (always up) and
set by the store once its connections are open.

Invariants: a shard is in the down set from the failure that turned it down (``went_down`` + 1,
one warning) until a probe's ``PING`` is answered (``came_back`` + 1, one warning, ``on_back``)
or the cluster's topology no longer has it; its backoff stays within ``[retry_min,
retry_max]``, doubling after each failed probe. Nothing here runs on the engine thread except
:attr:`ShardHealth.available`, :meth:`ShardHealth.is_down` and the bookkeeping of a failure.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from radixkv.cache.allocator import IntegrityError
from radixkv.cache.remote_conn import Shards, redact_url

__all__ = ["ShardHealth"]

logger = logging.getLogger("radixkv.cache.remote_store")


class ShardHealth:
    """Which shards are down, the probes that bring them back, and the warnings.

    Args:
        url: the store's URL (named, redacted, in the warnings); None in simulation.
        retry_min, retry_max: backoff bounds (seconds) of the probes while a shard is down.
        lock: the store's lock, held for every change here.
        counters: the store's counters, which must hold ``went_down`` and ``came_back``.
        on_back: called under ``lock`` when a down shard answers again.
    """

    def __init__(
        self,
        url: str | None,
        retry_min: float,
        retry_max: float,
        lock: threading.Lock,
        counters: dict[str, int],
        on_back: Callable[[], None],
    ) -> None:
        self.url = url
        self.retry_min = retry_min
        self.retry_max = retry_max
        self.shards: Shards | None = None
        self._lock = lock
        self._counters = counters
        self._on_back = on_back
        self._down: dict[str, tuple[float, float]] = {}  # shard -> (backoff, next probe)

    # ------------------------------------------------------------------ up / down
    @property
    def available(self) -> bool:
        """True while at least one shard is believed up (no network call)."""
        if self.shards is None:
            return True
        return any(name not in self._down for name in self.shards.names())

    @property
    def num_down(self) -> int:
        """Shards down now."""
        return len(self._down)

    def is_down(self, shard: str | None) -> bool:
        """Whether ``shard`` is down (``None``, no shard for the key, counts as down)."""
        return shard is None or shard in self._down

    def _where(self, shard: str) -> str:
        """How logs name ``shard``: the (redacted) URL, and the shard of a cluster."""
        url = redact_url(self.url)
        return url if self.shards is None or shard == url else f"{url}: shard {shard}"

    def went_down(self, shard: str, exc: BaseException) -> None:
        """``shard`` failed with ``exc``: it is down (once; a shard already down is left as is)."""
        with self._lock:
            if shard in self._down:
                return
            self._down[shard] = (self.retry_min, time.monotonic() + self.retry_min)
            self._counters["went_down"] += 1
        logger.warning(
            "remote KV cache %s is unreachable (%s: %s); %s until it answers again",
            self._where(shard),
            type(exc).__name__,
            exc,
            "the remote tier is off" if not self.available else "its pages miss",
        )

    def probe(self, force: bool = False) -> bool:
        """``PING`` every down shard whose backoff has passed (every one with ``force``); one
        that answers is up again. A shard the cluster's topology no longer has is forgotten.
        Then the shards' upkeep (a stale cluster topology is asked again). Returns
        :attr:`available`."""
        shards = self.shards
        if shards is None:
            return True
        with self._lock:
            down = list(self._down.items())
        names = set(shards.names())
        for shard, (backoff, next_probe) in down:
            if shard not in names:
                with self._lock:  # left the cluster's slot map: nothing to wait for
                    self._down.pop(shard, None)
                continue
            if not force and time.monotonic() < next_probe:
                continue
            try:
                shards.ping(shard)
            except shards.errors:
                backoff = min(self.retry_max, backoff * 2)
                with self._lock:
                    if shard in self._down:
                        self._down[shard] = (backoff, time.monotonic() + backoff)
                continue
            with self._lock:
                self._down.pop(shard, None)
                self._counters["came_back"] += 1
                self._on_back()  # a restarted server is empty: send pages again
            logger.warning(
                "remote KV cache %s answers again; %s",
                self._where(shard),
                "its pages are back" if len(names) > 1 else "the remote tier is back on",
            )
        shards.maintain()
        return self.available

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, Any]:
        """``shards`` known, ``shards_down`` and their names (``down_shards``); {} simulated."""
        if self.shards is None:
            return {}
        with self._lock:
            down = sorted(self._down)
        return {"shards": len(self.shards.names()), "shards_down": len(down), "down_shards": down}

    def check_integrity(self) -> None:
        """No more ``came_back`` than ``went_down``, no more shards down than went down and did
        not come back, every down shard's backoff within ``[retry_min, retry_max]``. Raises
        :class:`IntegrityError`."""
        with self._lock:
            went, back = self._counters["went_down"], self._counters["came_back"]
            down = dict(self._down)
        if back > went:
            raise IntegrityError("remote: came back more often than it went down")
        if len(down) > went - back:
            raise IntegrityError("remote: more shards down than went down and not back")
        for shard, (backoff, _) in down.items():
            if not self.retry_min <= backoff <= self.retry_max:
                raise IntegrityError(f"remote: shard {shard} backoff {backoff} out of bounds")
