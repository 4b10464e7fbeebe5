"""The FastAPI app: OpenAI-compatible and SGLang-style endpoints over one engine thread.

``create_app(engine, api_key=None, max_waiting=1024, model_name=None)`` returns the app (its
options are :class:`AppOptions`' fields); its lifespan starts the
:class:`~radixkv.server.engine_loop.EngineLoop` thread (and stops it).

Endpoints: ``POST /generate``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /health`` (never needs auth), ``GET /metrics``, ``GET /cache/stats``,
``POST /flush_cache``, ``POST /cache/pin``, ``POST /cache/unpin``, ``GET /cache/integrity``,
``GET /cache/tree``, ``GET /dashboard``; discovery and tokenizer routes (``/version``, ``/ping``,
``/tokenize``, ``/detokenize``, SGLang's ``/server_info`` and ``/model_info``) in
:mod:`.routes_info`; vLLM's ``POST /reset_prefix_cache`` beside ``/flush_cache``. Every error is
answered in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

The routes live by family in :mod:`.routes_openai` (:class:`~.routes_openai.OpenAIRoutes`),
:mod:`.routes_native` (``/generate``), :mod:`.routes_admin` (health and cache administration),
:mod:`.routes_metrics` and :mod:`.routes_dashboard` (the cache dashboard, fed by
:mod:`.stats_history`); they share the request path of
:class:`~radixkv.server.context.ServerContext`. This module keeps :class:`ServerApp` (the app's
state, its options :class:`AppOptions`, the error handlers (one error shape for all), API-key
auth (``auth``: any key; ``admin``: the admin key, see
:class:`~radixkv.server.tenancy.KeyRing`) and the :class:`~radixkv.server.guards.RequestGuard`
(``Host`` and body size, before anything else)) and the ``create_app`` factory over it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixkv import __version__

from .context import ServerContext
from .engine_loop import EngineLoop
from .guards import DEFAULT_MAX_BODY_BYTES, LOOPBACK_HOSTS, RequestGuard
from .intake import now
from .metrics import ServerMetrics
from .protocol import APIError, error_body
from .reasoning import REASONING_PARSERS
from .redaction import install_access_log_redactor, internal_error
from .request_id import RequestIdMiddleware
from .routes_admin import PinPolicy, admin_routes
from .routes_dashboard import DASHBOARD_TEXT, dashboard_routes
from .routes_info import info_routes
from .routes_metrics import metrics_routes
from .routes_native import native_routes
from .routes_openai import OpenAIRoutes
from .stats_history import StatsHistory, collect_sample
from .stats_log import StatsLine
from .streaming import ClientDisconnected
from .tenancy import REQUEST_CALLER, REQUEST_TENANT_SALT, KeyRing
from .tool_calls import TOOL_CALL_PARSERS

if TYPE_CHECKING:
    from radixkv.engine.api import EngineAPI
    from radixkv.model.prefault import Prefaulter

DEFAULT_MAX_WAITING = 1024


@dataclass(frozen=True)
class AppOptions:
    """How one server app serves its engine (``radixkv serve``'s flags); each default is the
    server's (see docs/design.md, "Engine step API" and docs/security.md for what each guard
    protects). A bad value (dashboard text or parser name) is a ``ValueError`` when made.

    ``api_key``: when set (one key or several), every endpoint but ``/health`` needs
    ``Authorization: Bearer KEY`` with one of them.
    ``admin_key``: the key of the admin routes (flush, pin/unpin, integrity, the tree, global
    stats, metrics); without it, one API key and no tenancy is admin, several keys or tenants
    leave them closed (:class:`~radixkv.server.tenancy.KeyRing`).
    ``salt_from_api_key``: each key is a tenant whose cache salt is derived from the key (see
    :mod:`.tenancy`): tenants never share a cached prefix (needs ``api_key``).
    ``max_waiting``: bound on requests accepted but not yet producing tokens (503 past it);
    ``max_waiting_per_key``: the same bound per API key (429 past it).
    ``model_name``: the name (or names: the first is the primary one) served in ``/v1/models``
    and accepted in requests, besides ``engine.model_name`` which is always accepted (defaults
    to ``engine.model_name``); a request without ``model`` gets the served model.
    ``dashboard_text``: ``"show"`` (``/cache/tree`` and ``/dashboard`` show decoded prompt text)
    or ``"hide"`` (token counts only).
    ``public_metrics``: ``/metrics`` needs no key (it shows server-wide counts, no prompt).
    ``allowed_hosts``: ``Host`` names served besides the loopback ones when the server has no
    key at all (``"*"``: any); with keys every name is served.
    ``max_body_bytes``: larger request bodies are refused (413) before parsing and auth.
    ``pins``: the pin budgets and maximum ttl (:class:`~radixkv.server.routes_admin.PinPolicy`).
    ``log_stats_interval``: seconds between stats lines in the log while busy (None: none;
    :mod:`.stats_log`).
    ``trust_request_chat_template``: chat requests may carry their own ``chat_template`` (Jinja
    rendered in a bounded child process, :mod:`radixkv.engine.template_sandbox`; off by
    default, as vLLM).
    ``prefault_kv``: commit the KV pool's memory in a background thread while the engine is
    idle (:class:`radixkv.model.prefault.Prefaulter`), so a burst's first writes do not fault
    (off by default: it holds the whole pool's memory, which several servers on one host may
    not have).
    ``log_requests``: one INFO line per finished request: id, finish reasons, token counts,
    TTFT and end to end time, the key's id (never the text; off by default, as vLLM).
    ``reasoning_parser``: ``qwen3`` or ``deepseek_r1`` (:mod:`.reasoning`): chat answers carry
    the model's ``<think>`` block as ``reasoning_content``, whole and streamed.
    ``tool_call_parser``: ``hermes``, ``llama3_json`` or ``mistral`` (:mod:`.tool_parsers`):
    ``tool_choice: "auto"`` answers with the calls the model writes as ``tool_calls`` (vLLM's
    ``--enable-auto-tool-choice --tool-call-parser``); None: "auto" is a 400.
    """

    api_key: str | Sequence[str] | None = None
    admin_key: str | None = None
    max_waiting: int | None = DEFAULT_MAX_WAITING
    max_waiting_per_key: int | None = None
    model_name: str | Sequence[str] | None = None
    salt_from_api_key: bool = False
    dashboard_text: str = "show"
    public_metrics: bool = False
    allowed_hosts: Sequence[str] | None = None
    max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES
    pins: PinPolicy | None = None
    log_stats_interval: float | None = 10.0
    trust_request_chat_template: bool = False
    prefault_kv: bool = False
    log_requests: bool = False
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.dashboard_text not in DASHBOARD_TEXT:
            raise ValueError(
                f"dashboard_text must be one of {DASHBOARD_TEXT}, got {self.dashboard_text!r}"
            )
        parser = self.tool_call_parser
        if parser is not None and parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown tool-call parser {parser!r}: {', '.join(TOOL_CALL_PARSERS)}")
        parser = self.reasoning_parser
        if parser is not None and parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}: {', '.join(REASONING_PARSERS)}")


class ServerApp:
    """The server around one engine: its state is fields (``options``, ``keys``, the served
    names, ``metrics``, ``engine_loop``, ``history``, the route families' shared ``ctx``), its
    error handlers and auth dependencies are methods, and :meth:`build_app` registers them
    with every route family on a FastAPI app. The engine thread (and the dashboard's sampler,
    the template sandbox, the prefaulter) run while that app runs (:meth:`lifespan`).

    Invariants: ``served_names[0]`` is the primary name, and ``accepted_names`` holds every
    served name and ``engine.model_name``; ``ctx.auth`` and ``ctx.admin`` are the dependencies
    :meth:`require_auth` and :meth:`require_admin`. Raises ``ValueError`` on a bad key set.
    """

    def __init__(self, engine: EngineAPI, options: AppOptions | None = None) -> None:
        opts = self.options = options or AppOptions()
        self.engine = engine
        key = opts.api_key
        api_keys = [key] if isinstance(key, str) else list(key or [])
        self.keys = KeyRing(api_keys, opts.admin_key, tenants=opts.salt_from_api_key)
        name = opts.model_name
        names = [name] if isinstance(name, str) else list(name or [])
        own_name = str(engine.model_name or "default")
        self.served_names = list(dict.fromkeys(names or [own_name]))
        self.served_name = self.served_names[0]
        self.accepted_names = {*self.served_names, own_name}
        self.metrics = ServerMetrics(self.served_name, engine.max_model_len)
        self.engine_loop = EngineLoop(
            engine,
            metrics=self.metrics,
            max_waiting=opts.max_waiting,
            max_waiting_per_owner=opts.max_waiting_per_key,
            log_requests=opts.log_requests,
        )
        self.created = now()
        self.history = StatsHistory()
        interval = opts.log_stats_interval
        self.stats_line = StatsLine(interval) if interval else None
        self.prefaulter: Prefaulter | None = None
        if opts.prefault_kv:  # imported here: it needs torch, which the app itself does not
            from radixkv.model.prefault import Prefaulter, pool_tensors

            loop = self.engine_loop
            self.prefaulter = Prefaulter(pool_tensors(engine), lambda: loop.idle)
        self.ctx = ServerContext(
            engine=engine,
            engine_loop=self.engine_loop,
            metrics=self.metrics,
            served_name=self.served_name,
            accepted_names=self.accepted_names,
            served_names=self.served_names,
            created=self.created,
            auth=[Depends(self.require_auth)],
            admin=[Depends(self.require_admin)],
            history=self.history,
            keyed=not self.keys.open,
            trust_request_chat_template=opts.trust_request_chat_template,
            reasoning=REASONING_PARSERS.get(opts.reasoning_parser or ""),
            tool_parser=opts.tool_call_parser,
        )

    def build_app(self) -> FastAPI:
        """The FastAPI app: the guards, the error handlers, then every route family."""
        opts, ctx = self.options, self.ctx
        app = FastAPI(title="radixkv", version=__version__, lifespan=self.lifespan)
        app.state.engine = self.engine
        app.state.engine_loop = self.engine_loop
        app.state.prefaulter = self.prefaulter
        app.state.metrics = self.metrics
        app.state.model_name = self.served_name
        hosts = None
        if self.keys.open:
            hosts = [*LOOPBACK_HOSTS, *(opts.allowed_hosts or ())]
        app.add_middleware(RequestGuard, max_body_bytes=opts.max_body_bytes, allowed_hosts=hosts)
        app.add_middleware(RequestIdMiddleware)  # outermost: guard refusals carry the id too
        install_access_log_redactor()  # a key typed into a query string never reaches the log
        app.exception_handler(APIError)(self.api_error)
        app.exception_handler(RequestValidationError)(self.validation_error)
        app.exception_handler(StarletteHTTPException)(self.http_error)
        app.exception_handler(ClientDisconnected)(self.client_gone)
        app.exception_handler(Exception)(self.unexpected)
        for router in (
            native_routes(ctx),
            OpenAIRoutes(ctx).router(),
            metrics_routes(ctx, public=opts.public_metrics),
            info_routes(ctx),
            admin_routes(ctx, opts.pins or PinPolicy()),
            dashboard_routes(ctx, text=opts.dashboard_text),
        ):
            app.include_router(router)
        return app

    # ---------------------------------------------------------------- lifespan

    async def sample(self) -> dict[str, Any]:
        """One dashboard sample, taken on the engine thread (and fed to the stats line)."""
        metrics = self.metrics
        got = await self.engine_loop.call(lambda e: collect_sample(e, metrics))
        if self.stats_line is not None:
            self.stats_line.observe(got)
        return got

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        ctx, engine_loop, prefaulter = self.ctx, self.engine_loop, self.prefaulter
        engine_loop.start(asyncio.get_running_loop())
        self.history.start(self.sample)
        if self.options.trust_request_chat_template:  # its processes start now, with the engine
            from radixkv.engine.template_sandbox import TemplateSandbox

            ctx.template_sandbox = TemplateSandbox()
        if prefaulter is not None:
            prefaulter.start()
        try:
            yield
        finally:
            if prefaulter is not None:
                await asyncio.to_thread(prefaulter.stop)
            await self.history.stop()
            if ctx.template_sandbox is not None:
                ctx.template_sandbox.close()
            await asyncio.to_thread(engine_loop.stop)
            # graceful shutdown (uvicorn's lifespan end: SIGTERM, SIGINT): make the disk tier
            # durable, in bounded time; never while a step may still be running
            if not engine_loop.alive:
                await asyncio.to_thread(self.engine.close)

    # ---------------------------------------------------------------- errors

    async def api_error(self, _: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code)

    async def validation_error(self, _: Request, exc: RequestValidationError) -> JSONResponse:
        self.metrics.rejected.labels(reason="invalid").inc()
        message, param = _describe_validation_errors(list(exc.errors()))
        return JSONResponse(error_body(message, param=param), status_code=400)

    async def http_error(self, _: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body(str(exc.detail), type=kind), status_code=exc.status_code, headers=exc.headers
        )

    async def client_gone(self, _: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # the client hung up: nobody reads this, no traceback

    async def unexpected(self, _: Request, exc: Exception) -> JSONResponse:
        message = internal_error(f"unhandled {type(exc).__name__}: {exc}")  # logs the traceback
        return JSONResponse(error_body(message, type="server_error"), status_code=500)

    # ---------------------------------------------------------------- auth

    def authenticate(self, request: Request, admin: bool) -> None:
        """Check the request's key (401/403 :class:`APIError`) and set its caller and tenant
        salt for the request path (:mod:`.tenancy`)."""
        REQUEST_TENANT_SALT.set(None)
        REQUEST_CALLER.set(None)
        caller = self.keys.authorize(request.headers.get("authorization"), admin=admin)
        REQUEST_TENANT_SALT.set(caller.salt)
        REQUEST_CALLER.set(caller)

    async def require_auth(self, request: Request) -> None:
        self.authenticate(request, admin=False)

    async def require_admin(self, request: Request) -> None:
        self.authenticate(request, admin=True)


def create_app(engine: EngineAPI, options: AppOptions | None = None, **fields: Any) -> FastAPI:
    """Build the server app around ``engine``: ``ServerApp(engine, options).build_app()``.
    ``fields`` are :class:`AppOptions` fields by name, over ``options`` (or the defaults):
    ``create_app(engine, api_key="k")`` is ``create_app(engine, AppOptions(api_key="k"))``.
    Raises ``ValueError`` on a bad option or key set, ``TypeError`` on an unknown field."""
    base = options or AppOptions()
    return ServerApp(engine, dataclasses.replace(base, **fields) if fields else base).build_app()


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list", "tuple"}


def _field_path(loc: Any) -> str | None:
    """``loc`` of a pydantic error as a dotted field path, without union member tags."""
    parts: list[str] = []
    for part in loc or ():
        if part == "body" and not parts:
            continue
        text = str(part)
        if isinstance(part, str) and ("[" in text or text in _TYPE_TAGS):
            break  # e.g. ("stop", "str") or ("prompt", "list[int]"): a union member, not a field
        parts.append(text)
    return ".".join(parts) or None


def _describe_validation_errors(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One OpenAI-style message (naming the field) for FastAPI's validation errors."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return f"Invalid JSON body: {ctx.get('error', first.get('msg', ''))}", None
    param = _field_path(first.get("loc"))
    if param is None and first.get("type") in ("model_attributes_type", "dict_type"):
        return "The request body must be a JSON object (send Content-Type: application/json)", None
    msgs: list[str] = []
    others = 0
    for err in errors:
        if _field_path(err.get("loc")) == param:
            msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
            if err.get("type") == "extra_forbidden":
                msg = "this field is not supported by radixkv (refused, never silently ignored)"
            if msg not in msgs:
                msgs.append(msg)
        else:
            others += 1
    message = " or ".join(msgs)
    if param:
        message = f"{param}: {message}"
    if others:
        message += f" (and {others} more error(s) in other fields)"
    return message, param
