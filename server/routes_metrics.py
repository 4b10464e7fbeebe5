"""``GET /metrics``: the Prometheus scrape (gauges refreshed from ``engine.stats()`` first)."""

from __future__ import annotations

import logging

from fastapi import APIRouter
from fastapi.responses import Response

from .context import ServerContext

logger = logging.getLogger(__name__)


def metrics_routes(ctx: ServerContext) -> APIRouter:
    """The Prometheus route of one app (behind ``ctx.auth``)."""
    engine_loop = ctx.engine_loop
    metrics = ctx.metrics
    auth = ctx.auth
    router = APIRouter()

    @router.get("/metrics", dependencies=auth)
    async def prometheus_metrics() -> Response:
        try:
            stats = await engine_loop.call(lambda e: e.stats())
            metrics.update_from_stats(stats)
        except Exception:  # stale gauges beat a failed scrape
            logger.exception("engine.stats() failed during a metrics scrape")
        return Response(metrics.render(), media_type=metrics.content_type)

    return router
