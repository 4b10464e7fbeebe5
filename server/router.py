"""``radixkv router``: one HTTP front for several ``radixkv serve`` replicas, sending each
request where its prefix is cached.

``create_router_app(replicas, policy="cache_aware", ...)`` returns a FastAPI app speaking the
replicas' API: ``POST /v1/completions``, ``/v1/chat/completions`` and ``/generate`` are proxied
to the replica the policy picks (:mod:`radixkv.server.router_policy`), the body and the
``Authorization`` header passed through unchanged (the replicas check API keys too), a streamed
answer relayed chunk by chunk as it arrives (``httpx`` async streaming, nothing buffered).
Each 2xx answer carries ``x-radixkv-replica: URL``.

Threat model: the router's prefix trees hold its clients' prompts, and how far a prompt matched
is exactly what a guesser needs to read another tenant's system prompt a character at a time.
The router protects them with the replicas' keys (``api_keys``, ``admin_key``,
``salt_from_api_key``; :class:`~radixkv.server.tenancy.KeyRing`):

* every route but ``/health`` checks ``Authorization: Bearer KEY`` at the router, before any
  routing or tree work (401 ``invalid_api_key``); a keyless caller learns nothing;
* the trees are namespaced by tenant (with ``salt_from_api_key``, the key's tenant salt) and
  client salt: a tenant's prompt never matches another tenant's;
* a prompt enters the tree (and the match counters) only once its replica answered 2xx: a
  refused or failed request leaves no trace;
* ``/router/stats``, ``/metrics`` and ``/flush_cache`` need the admin key (403 for other keys);
  ``public_metrics`` opens ``/metrics`` without a key, without the prefix-match and key-length
  counters (those stay admin-only); ``/health`` tells only health, load and errors.

Before all of that the router has the replicas' :class:`~radixkv.server.guards.RequestGuard`:
a body over 8 MiB is refused (413) unread, and without keys only loopback ``Host`` names are
served (421, DNS rebinding).

Without any key the router is open, as the replicas are: one trust domain (loopback). The
router cannot hide from its tenants *which* replica holds their own prefixes, nor tree sizes
and load (a tenant's volume, never its text).

Failures: a replica that cannot be reached, drops the connection or answers 503 (overloaded)
before the first byte of its answer is retried on another healthy replica (each at most once),
and a replica that could not be reached is marked dead at once. A request that fails on an open
connection before any answer (a kept-alive connection the replica closed as the request went
out) is sent once more to the same replica first, and does not mark it dead; so are the
router's own calls to replicas (``/v1/models``, ``/flush_cache``). A background task
``GET``s every replica's ``/health`` each ``health_interval`` seconds; a dead replica gets no
traffic (its prefix tree is cleared: its cache is gone when it restarts) until it answers
again. A stream that breaks after its first chunk ends there (tokens already sent cannot be
taken back).

The router's own endpoints: ``GET /health`` (open: 200 while a replica is healthy, 503
otherwise, with each replica's health, in-flight and errors), ``GET /v1/models`` (any key; from a
healthy replica), ``GET /metrics`` (admin; Prometheus: per-replica requests, prefix-match and key
characters, errors, in-flight and health), ``GET /router/stats`` (admin; the same as JSON, with
tree sizes) and ``POST /flush_cache`` (admin; forwarded to every healthy replica with the
caller's ``Authorization``; the trees of those that answered 200 are cleared).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)

from radixkv.server.guards import DEFAULT_MAX_BODY_BYTES, LOOPBACK_HOSTS, RequestGuard
from radixkv.server.protocol import APIError, error_body
from radixkv.server.redaction import install_access_log_redactor
from radixkv.server.router_policy import (
    POLICIES,
    ReplicaPrefixIndex,
    ReplicaState,
    RouteKey,
    make_policy,
    route_key,
)
from radixkv.server.streaming import SSE_DONE, sse
from radixkv.server.tenancy import Caller, KeyRing

__all__ = ["POLICIES", "RouterMetrics", "create_router_app"]

logger = logging.getLogger(__name__)

#: request headers passed through to the replica
_FORWARD_HEADERS = ("authorization", "content-type", "accept", "x-request-id", "user-agent")
#: response headers passed back to the client
_RETURN_HEADERS = ("content-type", "cache-control", "x-request-id")
_PROXIED = ("/v1/completions", "/v1/chat/completions", "/generate")


class RouterMetrics:
    """The router's Prometheus metrics, labelled by replica URL: ``registry`` (load and health,
    what ``public_metrics`` shows) and ``detail`` (prefix-match and key-length counters: what
    the prompts were like, admin only)."""

    def __init__(self, replicas: Sequence[str]) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.detail = d = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "radixkv_router_requests", "Requests sent to a replica.", ["replica"], registry=r
        )
        self.match_chars = Counter(
            "radixkv_router_prefix_match_chars",
            "Routing-key units (characters, or token ids for id prompts) the router's tree "
            "already held for the replica a request went to (2xx answers only).",
            ["replica"],
            registry=d,
        )
        self.key_chars = Counter(
            "radixkv_router_request_chars",
            "Routing-key units of the requests a replica answered 2xx.",
            ["replica"],
            registry=d,
        )
        self.errors = Counter(
            "radixkv_router_replica_errors",
            "Failed attempts on a replica (unreachable, dropped, 503, broken stream).",
            ["replica"],
            registry=r,
        )
        self.retries = Counter(
            "radixkv_router_retries", "Requests retried on another replica.", registry=r
        )
        self.in_flight = Gauge(
            "radixkv_router_in_flight", "Requests in flight per replica.", ["replica"], registry=r
        )
        self.healthy = Gauge(
            "radixkv_router_replica_healthy",
            "1 while a replica is healthy.",
            ["replica"],
            registry=r,
        )
        for url in replicas:
            for m in (self.requests, self.match_chars, self.key_chars, self.errors):
                m.labels(replica=url)
            self.in_flight.labels(replica=url)
            self.healthy.labels(replica=url).set(1)

    def render(self, detail: bool = True) -> bytes:
        out = generate_latest(self.registry)
        return out + generate_latest(self.detail) if detail else out


def _norm(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    return url


def create_router_app(
    replicas: Sequence[str],
    policy: str = "cache_aware",
    *,
    health_interval: float = 2.0,
    tree_capacity: int = 1 << 20,
    request_timeout: float = 600.0,
    api_keys: Sequence[str] | None = None,
    admin_key: str | None = None,
    salt_from_api_key: bool = False,
    public_metrics: bool = False,
    **policy_knobs: Any,
) -> FastAPI:
    """The router app over ``replicas`` (base URLs like ``http://127.0.0.1:8001``); see the
    module docstring. ``api_keys``, ``admin_key`` and ``salt_from_api_key``: the keys the
    replicas take (a :class:`~radixkv.server.tenancy.KeyRing`; none: the router is open).
    ``public_metrics``: ``/metrics`` without a key (load and health only). ``policy_knobs`` go
    to the policy (``cache_threshold``, ``balance_abs_threshold``, ``balance_rel_threshold``).
    Raises ``ValueError`` on a bad policy, knob, key set or an empty replica list."""
    ring = KeyRing(list(api_keys or []), admin_key, tenants=salt_from_api_key)
    if not replicas:
        raise ValueError("the router needs at least one --replica URL")
    urls = [_norm(u) for u in replicas]
    if len(set(urls)) != len(urls):
        raise ValueError(f"a replica is listed twice: {urls}")
    pol = make_policy(policy, **policy_knobs)
    states = [ReplicaState(u, ReplicaPrefixIndex(tree_capacity)) for u in urls]
    metrics = RouterMetrics(urls)
    holder: dict[str, Any] = {}

    def client() -> httpx.AsyncClient:
        return holder["client"]

    def mark(i: int, healthy: bool, why: str = "") -> None:
        st = states[i]
        if st.healthy and not healthy:
            logger.warning("replica %s is down (%s): no traffic until it answers", st.url, why)
            st.index.clear()
        elif healthy and not st.healthy:
            logger.warning("replica %s is back", st.url)
        st.healthy = healthy
        metrics.healthy.labels(replica=st.url).set(1 if healthy else 0)

    async def check(i: int) -> None:
        try:
            # a generous timeout: a busy replica is slow, not dead
            r = await client().get(states[i].url + "/health", timeout=5.0)
            mark(i, r.status_code == 200, f"/health answered {r.status_code}")
        except httpx.HTTPError as exc:
            mark(i, False, type(exc).__name__)

    async def health_loop() -> None:
        while True:
            await asyncio.gather(*(check(i) for i in range(len(states))))
            await asyncio.sleep(health_interval)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        timeout = httpx.Timeout(request_timeout, connect=5.0)
        holder["client"] = httpx.AsyncClient(timeout=timeout, limits=limits)
        task = asyncio.create_task(health_loop())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await holder["client"].aclose()

    app = FastAPI(title="radixkv router", lifespan=lifespan)
    # the replicas' guards, before the router reads a body: its size, and (keyless) the Host
    hosts = sorted(LOOPBACK_HOSTS) if ring.open else None
    app.add_middleware(RequestGuard, max_body_bytes=DEFAULT_MAX_BODY_BYTES, allowed_hosts=hosts)
    install_access_log_redactor()  # a key typed into a query string never reaches the log
    app.state.replicas = states
    app.state.policy = pol
    app.state.metrics = metrics
    app.state.keys = ring

    def unreachable(exc: Exception | None) -> bool:
        """A connection that could not be made: the replica is down, not a connection broken."""
        return isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))

    def fail(i: int, why: str, dead: bool) -> None:
        states[i].errors += 1
        metrics.errors.labels(replica=states[i].url).inc()
        if dead:
            mark(i, False, why)

    def headers_of(request: Request) -> dict[str, str]:
        # the first value of each, as checked: a second Authorization header is not forwarded
        return {k: v for k in _FORWARD_HEADERS if (v := request.headers.get(k)) is not None}

    def authorize(request: Request, admin: bool = False) -> Caller | JSONResponse:
        """The caller, when it may go on; else the replicas' 401 or 403 answer
        (:meth:`KeyRing.authorize`). The key itself is never logged or echoed."""
        try:
            return ring.authorize(request.headers.get("authorization"), admin=admin)
        except APIError as exc:
            return JSONResponse(exc.body(), status_code=exc.status_code)

    def answer_headers(resp: httpx.Response, url: str | None) -> dict[str, str]:
        out = {k: v for k, v in resp.headers.items() if k.lower() in _RETURN_HEADERS}
        if url is not None:  # 2xx only: where a refused request would have gone is not told
            out["x-radixkv-replica"] = url
        return out

    def no_replica(tried: int) -> JSONResponse:
        msg = (
            "no healthy replica can take the request"
            if not tried
            else f"every replica tried ({tried}) failed before answering"
        )
        return JSONResponse(error_body(msg, type="server_error"), status_code=503)

    def answered(i: int, key: RouteKey, matched: int) -> None:
        """The replica answered 2xx: only now does the key enter its tree and the counters."""
        st = states[i]
        st.index.insert(key)
        st.matched_units += matched
        st.key_units += len(key)
        metrics.match_chars.labels(replica=st.url).inc(matched)
        metrics.key_chars.labels(replica=st.url).inc(len(key))

    async def proxy(request: Request) -> Response:
        caller = authorize(request)
        if isinstance(caller, Response):  # before the body is read: no routing, no tree work
            return caller
        path = request.url.path
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        stream = isinstance(body, dict) and bool(body.get("stream"))
        key = route_key(path, body, tenant=caller.salt)
        headers = headers_of(request)
        tried: list[int] = []
        while True:
            i, matched = pol.select(states, key, exclude=tried)
            if i is None:
                return no_replica(len(tried))
            if tried:
                metrics.retries.inc()
            tried.append(i)
            st = states[i]
            st.requests += 1
            metrics.requests.labels(replica=st.url).inc()
            st.in_flight += 1
            metrics.in_flight.labels(replica=st.url).inc()
            done = True
            try:
                resp, error = await send_once_more_if_stale(
                    "POST", st.url + path, headers, content=raw, stream=True
                )
                if resp is None:
                    fail(i, f"{type(error).__name__}: {error}", dead=unreachable(error))
                    continue
                if resp.status_code == 503 and len(tried) < len(states):
                    await resp.aclose()
                    fail(i, "503", dead=False)
                    continue
                chunks = resp.aiter_raw()
                try:
                    first = await chunks.__anext__()
                except StopAsyncIteration:
                    first = b""
                except httpx.TransportError as exc:
                    await resp.aclose()
                    fail(i, f"{type(exc).__name__}: {exc}", dead=True)
                    continue
                ok = 200 <= resp.status_code < 300
                out_headers = answer_headers(resp, st.url if ok else None)
                if not stream or not first:
                    rest = [first]
                    try:
                        async for chunk in chunks:
                            rest.append(chunk)
                    except httpx.TransportError as exc:
                        await resp.aclose()
                        fail(i, f"{type(exc).__name__}: {exc}", dead=True)
                        continue
                    await resp.aclose()
                    if ok:
                        answered(i, key, matched)
                    return Response(b"".join(rest), resp.status_code, headers=out_headers)
                if ok:  # a 2xx stream: the replica took the prompt
                    answered(i, key, matched)
                done = False  # the stream's generator releases the replica

                async def relay(
                    first: bytes = first, chunks: Any = chunks, resp: Any = resp, i: int = i
                ) -> AsyncIterator[bytes | str]:
                    try:
                        yield first
                        async for chunk in chunks:
                            yield chunk
                    except httpx.TransportError as exc:
                        fail(i, f"stream broke: {type(exc).__name__}", dead=False)
                        # the client gets a clear end, not a stream cut without [DONE]
                        msg = f"the replica's stream broke ({type(exc).__name__}); retry"
                        yield sse(error_body(msg, type="server_error", code="replica_failed"))
                        yield SSE_DONE
                    finally:
                        await resp.aclose()
                        release(i)

                return StreamingResponse(relay(), resp.status_code, headers=out_headers)
            finally:
                if done:
                    release(i)

    async def send_once_more_if_stale(
        method: str,
        url: str,
        headers: dict[str, str],
        content: bytes | None = None,
        stream: bool = False,
    ) -> tuple[httpx.Response | None, Exception | None]:
        """Send a request to a replica (its answer streamed or read whole). A transport error
        other than an unreachable replica, before any answer (typically a kept-alive connection
        the replica closed just as the request went out), is tried once more on a fresh
        connection, not taken for a dead replica. Returns the response, or None and the last
        error (then ``fail(..., dead=unreachable(error))``)."""
        exc: Exception | None = None
        for _ in range(2):
            req = client().build_request(method, url, content=content, headers=headers)
            try:
                return await client().send(req, stream=stream), None
            except httpx.TransportError as err:
                exc = err
                if unreachable(err):
                    break
                logger.info("%s %s failed before an answer (%s); once more", method, url, err)
        return None, exc

    def release(i: int) -> None:
        states[i].in_flight -= 1
        metrics.in_flight.labels(replica=states[i].url).dec()

    for path in _PROXIED:
        app.add_api_route(path, proxy, methods=["POST"], include_in_schema=True)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if isinstance(refused := authorize(request), Response):
            return refused
        tried: list[int] = []
        for i, st in enumerate(states):
            if not st.healthy:
                continue
            tried.append(i)
            r, error = await send_once_more_if_stale(
                "GET", st.url + "/v1/models", headers_of(request)
            )
            if r is None:
                fail(i, type(error).__name__, dead=unreachable(error))
                continue
            url = st.url if 200 <= r.status_code < 300 else None
            return Response(r.content, r.status_code, headers=answer_headers(r, url))
        return no_replica(len(tried))

    def replica_report() -> list[dict[str, Any]]:
        return [
            {
                "url": st.url,
                "healthy": st.healthy,
                "in_flight": st.in_flight,
                "requests": st.requests,
                "prefix_match_units": st.matched_units,
                "key_units": st.key_units,
                "errors": st.errors,
                "tree_units": st.index.size,
            }
            for st in states
        ]

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = any(st.healthy for st in states)
        reps = [
            {"url": st.url, "healthy": st.healthy, "in_flight": st.in_flight, "errors": st.errors}
            for st in states
        ]  # open: nothing of the prompts (no match, key or tree sizes)
        body = {"status": "ok" if ok else "no healthy replica", "replicas": reps}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/router/stats")
    async def stats(request: Request) -> Response:
        if isinstance(refused := authorize(request, admin=True), Response):
            return refused
        return JSONResponse({"policy": pol.name, "replicas": replica_report()})

    @app.get("/metrics")
    async def prom(request: Request) -> Response:
        admin = authorize(request, admin=True)
        if isinstance(admin, Response) and not public_metrics:
            return admin
        detail = not isinstance(admin, Response)  # public: load and health only
        return Response(metrics.render(detail=detail), media_type=CONTENT_TYPE_LATEST)

    @app.post("/flush_cache")
    async def flush(request: Request) -> Response:
        if isinstance(refused := authorize(request, admin=True), Response):
            return refused
        results = {}
        status = 200
        for i, st in enumerate(states):
            if not st.healthy:
                continue
            r, error = await send_once_more_if_stale(
                "POST", st.url + "/flush_cache", headers_of(request)
            )
            if r is None:
                fail(i, type(error).__name__, dead=unreachable(error))
                continue
            results[st.url] = r.status_code
            if r.status_code != 200:
                status = r.status_code
            else:
                st.index.clear()
        return JSONResponse({"success": status == 200, "replicas": results}, status_code=status)

    return app
