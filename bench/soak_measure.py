"""What the soaks share: reading one SSE stream, and at the end of a run a server's idle stats and
latency percentiles."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = ["StreamRead", "percentile", "read_stream", "wait_idle"]


@dataclass
class StreamRead:
    """How a stream ended: ``kind`` is ``ok`` (``[DONE]`` seen), ``http_error`` (``status`` and
    the body's ``text``), ``error_event`` (an ``{"error": ...}`` data line), ``dropped`` (this
    client closed it after ``drop_after`` chunks), ``connection`` (an httpx error) or
    ``without_done`` (the server ended it without ``[DONE]``)."""

    kind: str
    detail: str
    status: int = 200
    text: str = ""


async def read_stream(
    http: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    drop_after: int | None = None,
    pause: float = 0.0,
) -> StreamRead:
    """POST ``body`` to ``path`` and read its SSE lines (``pause`` seconds after each chunk, a
    slow reader); each soak files the outcome under its own names."""
    chunks = 0
    try:
        async with http.stream("POST", path, json=body, timeout=300.0) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                return StreamRead("http_error", f"{path}: {text}", r.status_code, text)
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: ") :]
                if payload == "[DONE]":
                    return StreamRead("ok", path)
                if payload.startswith('{"error"'):
                    return StreamRead("error_event", f"{path}: {payload}")
                chunks += 1
                if drop_after is not None and chunks >= drop_after:
                    return StreamRead("dropped", path)  # closing the connection mid-stream
                if pause:
                    await asyncio.sleep(pause)
    except httpx.HTTPError as exc:
        return StreamRead("connection", f"{path}: {type(exc).__name__}: {exc}")
    return StreamRead("without_done", f"{path} after {chunks} chunks")


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
