"""Cache administration and liveness: ``GET /health`` (never needs auth), ``GET /cache/stats``,
``POST /flush_cache`` (also vLLM's ``POST /reset_prefix_cache``), ``POST /cache/pin``,
``POST /cache/unpin``, ``GET /cache/integrity``.

Who may call what (:class:`~radixkv.server.tenancy.KeyRing`): flush, pin, unpin and integrity
need the admin key. ``GET /cache/stats`` answers the admin ``engine.stats()``; with
``?history=true`` it adds ``"history"``, the dashboard's samples (schema in
:mod:`.stats_history`), those after ``since`` (a ``seq``) when given; a sample is taken on the
spot when the last one is older than half the interval. Any other key gets its own usage only
(``{"scope": "key", "usage": {...}}``).

Pins are bounded (:class:`PinPolicy`): a ttl of at most ``max_ttl`` (a pin without one gets
it), and pinned tokens of at most ``share`` of the device pool in all and ``namespace_share``
of it in one namespace (salt: a tenant); past a budget the pin is refused with 409 and nothing
changes. ``POST /flush_cache`` keeps pinned prefixes unless ``{"drop_pins": true}``."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Body, Query
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, Response

from radixkv.cache.pins import PinBudgetError

from .context import ServerContext
from .engine_loop import EngineRequestError
from .intake import check_prompt_not_empty, make_sampling_params, new_id, prompt_token_ids
from .protocol import APIError, PinRequest, UnpinRequest, error_body
from .tenancy import REQUEST_CALLER, effective_salt

if TYPE_CHECKING:
    from radixkv.engine.api import EngineAPI

DEFAULT_MAX_PIN_TTL = 86400.0


@dataclass(frozen=True)
class PinPolicy:
    """Bounds on pins: ``max_ttl`` seconds (None: pins may last until unpinned), pinned tokens
    at most ``share`` of the device pool over all namespaces and ``namespace_share`` of it in
    one namespace (a tenant's, with ``--salt-from-api-key``)."""

    max_ttl: float | None = DEFAULT_MAX_PIN_TTL
    share: float = 0.25
    namespace_share: float = 0.125

    def __post_init__(self) -> None:
        if self.max_ttl is not None and self.max_ttl <= 0:
            raise ValueError(f"max_ttl must be > 0 seconds or None, got {self.max_ttl}")
        for name in ("share", "namespace_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {getattr(self, name)}")

    def ttl(self, asked: float | None) -> float | None:
        """The ttl a pin gets: ``asked`` within ``max_ttl`` (a 400 past it), else ``max_ttl``."""
        if asked is None:
            return self.max_ttl
        if self.max_ttl is not None and asked > self.max_ttl:
            raise APIError(
                400,
                f"ttl {asked:g} s is over this server's maximum pin ttl of {self.max_ttl:g} s",
                param="ttl",
            )
        return asked

    def budgets(self, stats: dict[str, Any]) -> tuple[int, int]:
        """(all pins, one namespace) in tokens, from ``engine.stats()``'s pool size."""
        pool = int(stats.get("pages_total", 0)) * int(stats.get("page_size", 1))
        return int(pool * self.share), int(pool * self.namespace_share)


def admin_routes(ctx: ServerContext, pins: PinPolicy | None = None) -> APIRouter:
    """The cache administration routes and ``/health`` of one app."""
    engine = ctx.engine
    engine_loop = ctx.engine_loop
    metrics = ctx.metrics
    auth = ctx.auth
    admin = ctx.admin
    submit = ctx.submit
    policy = pins or PinPolicy()
    router = APIRouter()

    async def prompt_ids_of(body: UnpinRequest) -> list[int]:
        """The token ids of a pin or unpin body's ``text`` or ``input_ids`` (400 when empty)."""
        param = "text" if body.text is not None else "input_ids"
        prompt = body.text if body.text is not None else list(body.input_ids or [])
        ids = await prompt_token_ids(engine, prompt, param)
        check_prompt_not_empty(ids, param)
        return ids

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
        caller = REQUEST_CALLER.get()
        if caller is not None and not caller.admin:  # a tenant: its own usage, nothing global
            if history:
                raise APIError(
                    403,
                    "the cache history is server-wide: it needs the admin key",
                    type="permission_error",
                    code="admin_key_required",
                )
            usage = await engine_loop.call(lambda _: engine_loop.usage(caller.key_id))
            return {"scope": "key", "usage": usage}
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

    @router.post("/flush_cache", dependencies=admin)
    async def flush_cache(
        body: dict[str, Any] | None = Body(None, examples=[{"drop_pins": True}]),
    ) -> Response:
        drop_pins = (body or {}).get("drop_pins", False)
        if not isinstance(drop_pins, bool):
            raise APIError(400, "drop_pins must be true or false", param="drop_pins")

        def do_flush(e: EngineAPI) -> tuple[bool, int]:
            ok = bool(e.flush_cache(drop_pins=drop_pins))
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

    # vLLM's name for the same
    router.add_api_route("/reset_prefix_cache", flush_cache, methods=["POST"], dependencies=admin)

    @router.post("/cache/pin", dependencies=admin)
    async def pin(body: PinRequest) -> dict[str, Any]:
        arrival = time.monotonic()
        ttl = policy.ttl(body.ttl)
        ids = await prompt_ids_of(body)
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

        def do_pin(e: EngineAPI) -> int:
            everything, one = policy.budgets(e.stats())
            # never let pin_prefix step the engine inside a command while others run (it would
            # hold the engine thread and their outputs): busy, pin what the warm-up cached
            computes = not e.has_unfinished()
            return int(
                e.pin_prefix(
                    ids, salt, ttl, budget=everything, namespace_budget=one, compute=computes
                )
            )

        try:
            pinned = await engine_loop.call(do_pin)
        except PinBudgetError as exc:
            raise APIError(409, str(exc), code="pin_budget_exceeded") from exc
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        return {"pinned_tokens": pinned, "prompt_tokens": len(ids), "ttl": ttl}

    @router.post("/cache/unpin", dependencies=admin)
    async def unpin(body: UnpinRequest) -> dict[str, Any]:
        ids = await prompt_ids_of(body)
        salt = effective_salt(body.salt)
        removed = await engine_loop.call(lambda e: int(e.unpin_prefix(ids, salt=salt)))
        return {"unpinned": removed}

    @router.get("/cache/integrity", dependencies=admin)
    async def cache_integrity() -> dict[str, Any]:
        """``engine.check_integrity()`` and the pages nobody owns, checked on the engine thread
        between two steps (``engine.integrity_report()``)."""
        return await engine_loop.call(lambda e: e.integrity_report())

    return router


def _in_flight(engine: EngineAPI) -> int:
    """Running + waiting requests according to ``engine.stats()`` (best effort)."""
    try:
        stats = engine.stats()
        return int(stats.get("running", 0)) + int(stats.get("waiting", 0))
    except Exception:  # pragma: no cover - defensive
        return -1
