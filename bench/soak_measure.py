"""What the soaks read at the end of a run: a server's idle stats and latency percentiles."""

from __future__ import annotations

import time
from typing import Any

import httpx

__all__ = ["percentile", "wait_idle"]


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (nearest rank; NaN when empty)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def wait_idle(url: str, timeout: float = 120.0) -> dict[str, Any]:
    """Poll ``/cache/stats`` until nothing runs or waits (at most ``timeout`` s); the last
    stats."""
    deadline, stats = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        stats = httpx.get(f"{url}/cache/stats", timeout=30).json()
        if stats.get("running") == 0 and stats.get("waiting") == 0:
            break
        time.sleep(0.2)
    return stats
