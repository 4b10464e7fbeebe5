"""A ring buffer of cache samples: the time series behind the dashboard's charts.

:class:`StatsHistory` keeps the last ``capacity`` samples (one a second by default) of cumulative
counters and gauges. :func:`collect_sample` builds one from the engine (it must run on the engine
thread: the server passes it to ``EngineLoop.call``) and the server's per-request counters; rates
over an interval are differences of two samples, so a client that missed a poll loses nothing.

Sample schema (``version`` 1 of the dashboard API; keys are only ever added)::

    {
      "seq": int,                # 1, 2, ... (strictly increasing; ask for those after a seq)
      "t": float,                # unix time, seconds
      "prompt_tokens": int,      # cumulative, requests that reached their first output
      "cached_tokens": int,      # cumulative, of those prompt tokens served from the cache
      "cached_by_tier": {"device": int, "host": int, "disk": int, "remote": int},
      "requests": int,           # cumulative requests counted above
      "requests_hit": int,       # cumulative requests with at least one cached token
      "generated_tokens": int,   # cumulative tokens generated
      "running": int, "waiting": int,
      "tiers": {                 # occupancy in tokens; a tier that is off is absent
        "device": {"used": int, "cached": int, "evictable": int, "capacity": int},
        "host": {"used": int, "capacity": int},
        "disk": {"used_bytes": int, "capacity_bytes": int, "files": int},
        "remote": {...}          # the remote store's own counters, when there is one
      },
      "evicted_tokens": {"device": int, "host": int},      # cumulative
      "loads": {"host": int, "disk": int, "remote": int},  # cumulative admissions that loaded
      "load_pages": {"host": int, "disk": int, "remote": int}
    }
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from .metrics import ServerMetrics

if TYPE_CHECKING:
    from radixkv.engine.api import EngineAPI

logger = logging.getLogger(__name__)

__all__ = ["StatsHistory", "collect_sample"]

TIERS = ("device", "host", "disk", "remote")


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def collect_sample(engine: EngineAPI, metrics: ServerMetrics) -> dict[str, Any]:
    """One sample (without ``seq``) of ``engine`` (read on the engine thread) and ``metrics``."""
    stats = engine.stats()
    page = _int(stats.get("page_size")) or 1
    tiers: dict[str, Any] = {
        "device": {
            "used": _int(stats.get("pages_used")) * page,
            "cached": _int(stats.get("pages_cached")) * page,
            "evictable": _int(stats.get("pages_evictable")) * page,
            "capacity": _int(stats.get("pages_total")) * page,
            "kv_dtype": str(stats.get("kv_cache_dtype", "")),
            "bytes_per_token": _int(stats.get("kv_bytes_per_token")),
        }
    }
    t = stats.get("tiers") or {}
    if "host_pages_total" in t:
        tiers["host"] = {
            "used": _int(t.get("host_pages_used")) * page,
            "capacity": _int(t.get("host_pages_total")) * page,
        }
    if "disk_capacity_bytes" in t:
        tiers["disk"] = {
            "used_bytes": _int(t.get("disk_bytes")),
            "capacity_bytes": _int(t.get("disk_capacity_bytes")),
            "files": _int(t.get("disk_files")),
        }
    remote = t.get("remote")
    if isinstance(remote, dict):
        tiers["remote"] = {k: v for k, v in remote.items() if isinstance(v, int | float | bool)}
    tree = engine.tree
    return {
        "t": time.time(),
        "prompt_tokens": metrics.prompt_tokens_seen,
        "cached_tokens": metrics.cached_tokens_seen,
        "cached_by_tier": {k: metrics.cached_by_tier_seen.get(k, 0) for k in TIERS},
        "requests": metrics.requests_seen,
        "requests_hit": metrics.requests_hit,
        "generated_tokens": metrics.generated_tokens_seen,
        "running": _int(stats.get("running")),
        "waiting": _int(stats.get("waiting")),
        "tiers": tiers,
        "evicted_tokens": {
            "device": _int(tree.num_evicted_tokens if tree is not None else 0),
            "host": _int(tree.num_host_evicted_tokens if tree is not None else 0),
        },
        "loads": {k: _int(t.get(f"{k}_loads")) for k in ("host", "disk", "remote")},
        "load_pages": {k: _int(t.get(f"{k}_load_pages")) for k in ("host", "disk", "remote")},
    }


class StatsHistory:
    """The last ``capacity`` samples, oldest first; :meth:`run` appends one every ``interval``
    seconds. Event-loop only (no locking): :meth:`add` and :meth:`since` run on the event loop.

    Invariant: ``seq`` of the samples is strictly increasing by 1 and ``len <= capacity``.
    """

    def __init__(self, capacity: int = 600, interval: float = 1.0) -> None:
        if capacity < 2:
            raise ValueError(f"capacity must be >= 2, got {capacity}")
        if interval <= 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        self.capacity = capacity
        self.interval = interval
        self._samples: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._seq = 0
        self._task: asyncio.Task[None] | None = None

    def add(self, sample: dict[str, Any]) -> dict[str, Any]:
        """Append ``sample`` (given the next ``seq``) and return it."""
        self._seq += 1
        sample = {"seq": self._seq, **sample}
        self._samples.append(sample)
        return sample

    def add_fresh(self, sample: dict[str, Any]) -> bool:
        """Append ``sample`` only when the last one is older than half the interval (a poll
        then sees what just happened without flooding the buffer). True when appended."""
        if self._samples and sample["t"] - self._samples[-1]["t"] < self.interval / 2:
            return False
        self.add(sample)
        return True

    def since(self, seq: int | None = None) -> list[dict[str, Any]]:
        """Samples with ``seq`` greater than ``seq`` (all when ``None``), oldest first."""
        if seq is None:
            return list(self._samples)
        return [s for s in self._samples if s["seq"] > seq]

    @property
    def last_seq(self) -> int:
        return self._seq

    def __len__(self) -> int:
        return len(self._samples)

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` when the samples are not consecutive or over capacity."""
        assert len(self._samples) <= self.capacity
        seqs = [s["seq"] for s in self._samples]
        assert seqs == list(range(self._seq - len(seqs) + 1, self._seq + 1)), seqs

    # ---------------------------------------------------------------- sampler

    def start(self, sample: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        """Start sampling on the running event loop: ``await sample()`` every ``interval``."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(sample))

    async def stop(self) -> None:
        """Stop the sampler (idempotent)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self, sample: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        while True:
            try:
                self.add(await sample())
            except asyncio.CancelledError:
                raise
            except Exception:  # a failed sample (engine stopping) skips one point
                logger.debug("stats sample failed", exc_info=True)
            await asyncio.sleep(self.interval)
