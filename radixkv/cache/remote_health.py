"""The up/down state of the remote KV tier's shards (:mod:`radixkv.cache.remote_conn`).

:class:`ShardHealth` is a mixin of :class:`~radixkv.cache.remote_store.RemoteStore`, which owns
the state it reads: ``_shards`` (None in simulation), ``_down`` (shard -> (backoff, time of the
next probe)), ``_recent``, ``_lock``, ``counters``, ``retry_min``, ``retry_max`` and ``url``.

Invariants: a shard is in ``_down`` from the failure that turned it down (``went_down`` + 1, one
warning) until a probe's ``PING`` is answered (``came_back`` + 1, one warning, ``_recent``
forgotten: a restarted server is empty) or the cluster's topology no longer has it; its backoff
stays within ``[retry_min, retry_max]``, doubling after each failed probe. Nothing here runs on
the engine thread except :attr:`ShardHealth.available` and the bookkeeping of a failure.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

from radixkv.cache.allocator import IntegrityError
from radixkv.cache.remote_conn import Shards, redact_url

__all__ = ["ShardHealth"]

logger = logging.getLogger("radixkv.cache.remote_store")


class ShardHealth:
    """Which shards are down, the probes that bring them back, and the warnings."""

    _shards: Shards | None
    _down: dict[str, tuple[float, float]]
    _recent: OrderedDict[bytes, float]
    _lock: threading.Lock
    counters: dict[str, int]
    retry_min: float
    retry_max: float
    url: str | None

    # ------------------------------------------------------------------ up / down
    @property
    def available(self) -> bool:
        """True while at least one shard is believed up (no network call)."""
        if self._shards is None:
            return True
        return any(name not in self._down for name in self._shards.names())

    def _is_down(self, shard: str | None) -> bool:
        return shard is None or shard in self._down

    def skipped_down(self, n: int) -> None:
        """Count ``n`` pages not sent because the store is down."""
        with self._lock:
            self.counters["writes_skipped_down"] += n

    def _where(self, shard: str) -> str:
        """How logs name ``shard``: the (redacted) URL, and the shard of a cluster."""
        url = redact_url(self.url)
        return url if self._shards is None or shard == url else f"{url}: shard {shard}"

    def _went_down(self, shard: str, exc: BaseException) -> None:
        with self._lock:
            if shard in self._down:
                return
            self._down[shard] = (self.retry_min, time.monotonic() + self.retry_min)
            self.counters["went_down"] += 1
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
        shards = self._shards
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
                self.counters["came_back"] += 1
                self._recent.clear()  # a restarted server is empty: send pages again
            logger.warning(
                "remote KV cache %s answers again; %s",
                self._where(shard),
                "its pages are back" if len(names) > 1 else "the remote tier is back on",
            )
        shards.maintain()
        return self.available

    # ------------------------------------------------------------------ introspection
    def _health_stats(self) -> dict[str, Any]:
        """``shards`` known, ``shards_down`` and their names (``down_shards``); {} simulated."""
        if self._shards is None:
            return {}
        with self._lock:
            down = sorted(self._down)
        return {"shards": len(self._shards.names()), "shards_down": len(down), "down_shards": down}

    def _check_health(self) -> None:
        """No more ``came_back`` than ``went_down``, no more shards down than went down and did
        not come back, every down shard's backoff within ``[retry_min, retry_max]``. Raises
        :class:`IntegrityError`."""
        with self._lock:
            went, back = self.counters["went_down"], self.counters["came_back"]
            down = dict(self._down)
        if back > went:
            raise IntegrityError("remote: came back more often than it went down")
        if len(down) > went - back:
            raise IntegrityError("remote: more shards down than went down and not back")
        for shard, (backoff, _) in down.items():
            if not self.retry_min <= backoff <= self.retry_max:
                raise IntegrityError(f"remote: shard {shard} backoff {backoff} out of bounds")
