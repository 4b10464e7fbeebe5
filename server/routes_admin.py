"""Cache administration and liveness: ``GET /health`` (never needs auth), ``GET /cache/stats``,
``POST /flush_cache``, ``POST /cache/pin``.

``GET /cache/stats`` answers ``engine.stats()``; with ``?history=true`` it adds ``"history"``, the
dashboard's samples (schema in :mod:`.stats_history`), those after ``since`` (a ``seq``) when
given; a sample is taken on the spot when the last one is older than half the interval."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Query
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, Response

from .context import ServerContext
from .engine_loop import EngineRequestError
from .intake import check_prompt_not_empty, make_sampling_params, new_id, prompt_token_ids
from .protocol import APIError, PinRequest, error_body
from .tenancy import effective_salt


def admin_routes(ctx: ServerContext) -> APIRouter:
    """The cache administration routes and ``/health`` of one app."""
    engine = ctx.engine
    engine_loop = ctx.engine_loop
    metrics = ctx.metrics
    auth = ctx.auth
    submit = ctx.submit
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        if not engine_loop.alive:
            return JSONResponse(
                error_body("the engine thread is not running", type="server_error"),
                status_code=503,
            )
        return JSONResponse({"status": "ok"})

    @router.get("/cache/stats", dependencies=auth)
    async def cache_stats(
        history: bool = Query(False, description="add the dashboard's samples ('history')"),
        since: int | None = Query(None, ge=0, description="with history: samples after seq"),
    ) -> dict[str, Any]:
        if not history or ctx.history is None:
            stats = await engine_loop.call(lambda e: e.stats())
            metrics.update_from_stats(stats)
            return jsonable_encoder(stats)
        from .stats_history import collect_sample

        stats, sample = await engine_loop.call(lambda e: (e.stats(), collect_sample(e, metrics)))
        metrics.update_from_stats(stats)
        ctx.history.add_fresh(sample)
        out = jsonable_encoder(stats)
        out["history"] = ctx.history.since(since)
        return out

    @router.post("/flush_cache", dependencies=auth)
    async def flush_cache() -> Response:
        def do_flush(e: Any) -> tuple[bool, int]:
            ok = bool(e.flush_cache())
            return ok, 0 if ok else _in_flight(e)

        ok, in_flight = await engine_loop.call(do_flush)
        if not ok:
            raise APIError(
                409,
                f"Cannot flush the cache while requests are in flight ({in_flight} running or "
                "waiting); nothing was flushed. Retry when the server is idle.",
                code="requests_in_flight",
            )
        return JSONResponse({"success": True, "message": "cache flushed"})

    @router.post("/cache/pin", dependencies=auth)
    async def pin(body: PinRequest) -> dict[str, Any]:
        arrival = time.monotonic()
        prompt = body.text if body.text is not None else list(body.input_ids or [])
        ids = await prompt_token_ids(engine, prompt)
        check_prompt_not_empty(ids, "text" if body.text is not None else "input_ids")
        busy = await engine_loop.call(lambda e: bool(e.has_unfinished()))
        if busy:
            # engine.pin_prefix computes an uncached prompt by stepping the engine itself, which
            # would swallow the StepOutputs of the running requests. While busy, compute the
            # prompt as an ordinary 1-token request first, so pin_prefix finds it cached.
            warm = make_sampling_params({"max_tokens": 1, "temperature": 0.0})
            stream = await submit(new_id("pin"), ids, warm, body.salt, arrival)
            try:
                async for _ in stream.outputs():
                    pass
            except EngineRequestError as exc:
                raise APIError(exc.status_code, exc.message, type="server_error") from exc
            finally:
                engine_loop.release(stream.request_id)
        salt = effective_salt(body.salt)  # the tenant's namespace (submit applies it itself)

        def do_pin(e: Any) -> int:
            # never let pin_prefix step the engine inside a command while others run (it would
            # hold the engine thread and their outputs): busy, pin what the warm-up cached
            if e.has_unfinished() and e.config.enable_prefix_cache:
                return int(e.tree.pin(list(ids), salt=salt, ttl=body.ttl))
            return int(e.pin_prefix(ids, salt=salt, ttl=body.ttl))

        try:
            pinned = await engine_loop.call(do_pin)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        return {"pinned_tokens": pinned, "prompt_tokens": len(ids)}

    @router.get("/cache/integrity", dependencies=auth)
    async def cache_integrity() -> dict[str, Any]:
        """``engine.check_integrity()`` and the pages nobody owns, checked on the engine thread
        between two steps (:func:`radixkv.engine.integrity_report.integrity_report`)."""
        from radixkv.engine.integrity_report import integrity_report

        return await engine_loop.call(integrity_report)

    return router


def _in_flight(engine: Any) -> int:
    """Running + waiting requests according to ``engine.stats()`` (best effort)."""
    try:
        stats = engine.stats()
        return int(stats.get("running", 0)) + int(stats.get("waiting", 0))
    except Exception:  # pragma: no cover - defensive
        return -1
