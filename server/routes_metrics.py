"""``GET /metrics``: the Prometheus scrape (gauges refreshed from ``engine.stats()`` first)."""

from __future__ import annotations

import logging

from fastapi import APIRouter
from fastapi.responses import Response

from .context import ServerContext

logger = logging.getLogger(__name__)


def metrics_routes(ctx: ServerContext, public: bool = False) -> APIRouter:
    """The Prometheus route of one app: behind the admin key (``ctx.admin``) unless ``public``
    (server-wide counts only: no prompt text, no per-key figure)."""
    engine_loop = ctx.engine_loop
    metrics = ctx.metrics
    router = APIRouter()

    @router.get("/metrics", dependencies=[] if public else ctx.admin)
    async def prometheus_metrics() -> Response:
        try:
            stats = await engine_loop.call(lambda e: e.stats())
            metrics.update_from_stats(stats)
        except Exception:  # stale gauges beat a failed scrape
            logger.exception("engine.stats() failed during a metrics scrape")
        return Response(metrics.render(), media_type=metrics.content_type)

    return router
