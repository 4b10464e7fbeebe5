"""The periodic stats line of a serving process, like vLLM's: every ``interval`` seconds while
anything happens, one log line with prompt and generation throughput, running and waiting
requests, KV pool use and the prefix-cache hit rate over the interval.

:class:`StatsLine` watches the dashboard's samples (:mod:`.stats_history`: one a second) and
logs the difference between the last logged one and now; an idle server logs nothing.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["StatsLine", "format_stats_line"]

logger = logging.getLogger("radixkv.server.stats")


def format_stats_line(old: dict[str, Any], new: dict[str, Any]) -> str:
    """The stats line for the interval between two samples."""
    dt = max(new["t"] - old["t"], 1e-9)
    prompt = new["prompt_tokens"] - old["prompt_tokens"]
    cached = new["cached_tokens"] - old["cached_tokens"]
    generated = new.get("generated_tokens", 0) - old.get("generated_tokens", 0)
    device = new.get("tiers", {}).get("device", {})
    capacity = device.get("capacity", 0) or 0
    # vLLM's meaning: cached pages nothing running holds are free (eviction hands them out)
    busy = max(0, device.get("used", 0) - device.get("evictable", 0))
    used = busy / capacity if capacity else 0.0
    held = device.get("cached", 0) / capacity if capacity else 0.0
    hit = f"{cached / prompt:.1%}" if prompt else "-"
    return (
        f"prompt {prompt / dt:.1f} tok/s, generation {generated / dt:.1f} tok/s, "
        f"running {new['running']}, waiting {new['waiting']}, KV pool {used:.1%} used "
        f"({held:.1%} cached prefixes), prefix-cache hit rate {hit} (last {dt:.0f} s)"
    )


class StatsLine:
    """Log :func:`format_stats_line` every ``interval`` seconds of samples while the server is
    busy (requests running or waiting, or tokens counted since the last line)."""

    def __init__(self, interval: float = 10.0) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval}")
        self.interval = interval
        self._last: dict[str, Any] | None = None

    def observe(self, sample: dict[str, Any]) -> str | None:
        """Take a sample; returns (and logs) the line when one is due."""
        last = self._last
        if last is None:
            self._last = sample
            return None
        if sample["t"] - last["t"] < self.interval:
            return None
        self._last = sample
        busy = sample["running"] or sample["waiting"]
        moved = any(
            sample.get(k, 0) != last.get(k, 0) for k in ("prompt_tokens", "generated_tokens")
        )
        if not (busy or moved):
            return None
        line = format_stats_line(last, sample)
        logger.info("%s", line)
        return line
