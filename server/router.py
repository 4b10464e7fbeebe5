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
from prometheus_client import CONTENT_TYPE_LATEST

from radixkv.server.guards import DEFAULT_MAX_BODY_BYTES, LOOPBACK_HOSTS, RequestGuard
from radixkv.server.protocol import APIError, error_body
from radixkv.server.redaction import install_access_log_redactor
from radixkv.server.router_metrics import RouterMetrics
from radixkv.server.router_policy import (
    POLICIES,
    CacheAwarePolicy,
    ReplicaPrefixIndex,
    ReplicaState,
    RoundRobinPolicy,
    RouteKey,
    make_policy,
    route_key,
)
from radixkv.server.streaming import SSE_DONE, sse
from radixkv.server.tenancy import Caller, KeyRing

__all__ = ["POLICIES", "RouterApp", "RouterMetrics", "create_router_app"]

logger = logging.getLogger(__name__)

#: request headers passed through to the replica
_FORWARD_HEADERS = ("authorization", "content-type", "accept", "x-request-id", "user-agent")
#: response headers passed back to the client
_RETURN_HEADERS = ("content-type", "cache-control", "x-request-id")
_PROXIED = ("/v1/completions", "/v1/chat/completions", "/generate")


def _norm(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    return url


def _unreachable(exc: Exception | None) -> bool:
    """A connection that could not be made: the replica is down, not a connection broken."""
    return isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))


def _headers_of(request: Request) -> dict[str, str]:
    # the first value of each, as checked: a second Authorization header is not forwarded
    return {k: v for k in _FORWARD_HEADERS if (v := request.headers.get(k)) is not None}


def _answer_headers(resp: httpx.Response, url: str | None) -> dict[str, str]:
    out = {k: v for k, v in resp.headers.items() if k.lower() in _RETURN_HEADERS}
    if url is not None:  # 2xx only: where a refused request would have gone is not told
        out["x-radixkv-replica"] = url
    return out


def _no_replica(tried: int) -> JSONResponse:
    msg = (
        "no healthy replica can take the request"
        if not tried
        else f"every replica tried ({tried}) failed before answering"
    )
    return JSONResponse(error_body(msg, type="server_error"), status_code=503)


class RouterApp:
    """The router over ``replicas`` (base URLs like ``http://127.0.0.1:8001``); see the module
    docstring. Its state is its fields: ``states`` (one :class:`ReplicaState` per replica, in
    the order given), ``policy``, ``metrics`` and ``keys``; each route is a method, registered
    by :meth:`build_app` (a route method has no docstring: FastAPI would publish it as the
    route's OpenAPI description). The pooled HTTP client to the replicas (:attr:`client`) exists while
    an app built from it runs (its lifespan), as does the health loop.

    ``api_keys``, ``admin_key`` and ``salt_from_api_key``: the keys the replicas take (a
    :class:`~radixkv.server.tenancy.KeyRing`; none: the router is open). ``public_metrics``:
    ``/metrics`` without a key (load and health only). ``policy_knobs`` go to the policy
    (``cache_threshold``, ``balance_abs_threshold``, ``balance_rel_threshold``). Raises
    ``ValueError`` on a bad policy, knob, key set or an empty replica list."""

    def __init__(
        self,
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
    ) -> None:
        self.keys = KeyRing(list(api_keys or []), admin_key, tenants=salt_from_api_key)
        if not replicas:
            raise ValueError("the router needs at least one --replica URL")
        urls = [_norm(u) for u in replicas]
        if len(set(urls)) != len(urls):
            raise ValueError(f"a replica is listed twice: {urls}")
        self.policy: CacheAwarePolicy | RoundRobinPolicy = make_policy(policy, **policy_knobs)
        self.states = [ReplicaState(u, ReplicaPrefixIndex(tree_capacity)) for u in urls]
        self.metrics = RouterMetrics(urls)
        self.health_interval = health_interval
        self.request_timeout = request_timeout
        self.public_metrics = public_metrics
        self._client: httpx.AsyncClient | None = None

    def build_app(self) -> FastAPI:
        """The FastAPI app: the replicas' guards, then every route, over this router's state."""
        app = FastAPI(title="radixkv router", lifespan=self.lifespan)
        # the replicas' guards, before the router reads a body: its size, and (keyless) the Host
        hosts = sorted(LOOPBACK_HOSTS) if self.keys.open else None
        app.add_middleware(RequestGuard, max_body_bytes=DEFAULT_MAX_BODY_BYTES, allowed_hosts=hosts)
        install_access_log_redactor()  # a key typed into a query string never reaches the log
        app.state.replicas = self.states
        app.state.policy = self.policy
        app.state.metrics = self.metrics
        app.state.keys = self.keys
        for path in _PROXIED:
            app.add_api_route(path, self.proxy, methods=["POST"], include_in_schema=True)
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/router/stats", self.stats, methods=["GET"])
        app.add_api_route("/metrics", self.prom, methods=["GET"])
        app.add_api_route("/flush_cache", self.flush, methods=["POST"])
        return app

    # ---------------------------------------------------------------- replicas' health

    @property
    def client(self) -> httpx.AsyncClient:
        """The HTTP client to the replicas (only while the app runs)."""
        if self._client is None:
            raise RuntimeError("the router's HTTP client exists only while its app runs")
        return self._client

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        timeout = httpx.Timeout(self.request_timeout, connect=5.0)
        self._client = httpx.AsyncClient(timeout=timeout, limits=limits)
        task = asyncio.create_task(self.health_loop())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await self._client.aclose()

    def mark(self, i: int, healthy: bool, why: str = "") -> None:
        st = self.states[i]
        if st.healthy and not healthy:
            logger.warning("replica %s is down (%s): no traffic until it answers", st.url, why)
            st.index.clear()
        elif healthy and not st.healthy:
            logger.warning("replica %s is back", st.url)
        st.healthy = healthy
        self.metrics.healthy.labels(replica=st.url).set(1 if healthy else 0)

    async def check(self, i: int) -> None:
        try:
            # a generous timeout: a busy replica is slow, not dead
            r = await self.client.get(self.states[i].url + "/health", timeout=5.0)
            self.mark(i, r.status_code == 200, f"/health answered {r.status_code}")
        except httpx.HTTPError as exc:
            self.mark(i, False, type(exc).__name__)

    async def health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.check(i) for i in range(len(self.states))))
            await asyncio.sleep(self.health_interval)

    def fail(self, i: int, why: str, dead: bool) -> None:
        self.states[i].errors += 1
        self.metrics.errors.labels(replica=self.states[i].url).inc()
        if dead:
            self.mark(i, False, why)

    # ---------------------------------------------------------------- request bookkeeping

    def authorize(self, request: Request, admin: bool = False) -> Caller | JSONResponse:
        """The caller, when it may go on; else the replicas' 401 or 403 answer
        (:meth:`KeyRing.authorize`). The key itself is never logged or echoed."""
        try:
            return self.keys.authorize(request.headers.get("authorization"), admin=admin)
        except APIError as exc:
            return JSONResponse(exc.body(), status_code=exc.status_code)

    def answered(self, i: int, key: RouteKey, matched: int) -> None:
        """The replica answered 2xx: only now does the key enter its tree and the counters."""
        st = self.states[i]
        st.index.insert(key)
        st.matched_units += matched
        st.key_units += len(key)
        self.metrics.match_chars.labels(replica=st.url).inc(matched)
        self.metrics.key_chars.labels(replica=st.url).inc(len(key))

    def release(self, i: int) -> None:
        self.states[i].in_flight -= 1
        self.metrics.in_flight.labels(replica=self.states[i].url).dec()

    async def send_once_more_if_stale(
        self,
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
        error (then ``fail(..., dead=_unreachable(error))``)."""
        exc: Exception | None = None
        for _ in range(2):
            req = self.client.build_request(method, url, content=content, headers=headers)
            try:
                return await self.client.send(req, stream=stream), None
            except httpx.TransportError as err:
                exc = err
                if _unreachable(err):
                    break
                logger.info("%s %s failed before an answer (%s); once more", method, url, err)
        return None, exc

    # ---------------------------------------------------------------- proxied routes

    async def proxy(self, request: Request) -> Response:
        # POST a completion to the replica the policy picks, retrying on another one (each at
        # most once) while none has answered
        states, metrics = self.states, self.metrics
        caller = self.authorize(request)
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
        headers = _headers_of(request)
        tried: list[int] = []
        while True:
            i, matched = self.policy.select(states, key, exclude=tried)
            if i is None:
                return _no_replica(len(tried))
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
                resp, error = await self.send_once_more_if_stale(
                    "POST", st.url + path, headers, content=raw, stream=True
                )
                if resp is None:
                    self.fail(i, f"{type(error).__name__}: {error}", dead=_unreachable(error))
                    continue
                if resp.status_code == 503 and len(tried) < len(states):
                    await resp.aclose()
                    self.fail(i, "503", dead=False)
                    continue
                chunks = resp.aiter_raw()
                try:
                    first = await chunks.__anext__()
                except StopAsyncIteration:
                    first = b""
                except httpx.TransportError as exc:
                    await resp.aclose()
                    self.fail(i, f"{type(exc).__name__}: {exc}", dead=True)
                    continue
                ok = 200 <= resp.status_code < 300
                out_headers = _answer_headers(resp, st.url if ok else None)
                if not stream or not first:
                    rest = [first]
                    try:
                        async for chunk in chunks:
                            rest.append(chunk)
                    except httpx.TransportError as exc:
                        await resp.aclose()
                        self.fail(i, f"{type(exc).__name__}: {exc}", dead=True)
                        continue
                    await resp.aclose()
                    if ok:
                        self.answered(i, key, matched)
                    return Response(b"".join(rest), resp.status_code, headers=out_headers)
                if ok:  # a 2xx stream: the replica took the prompt
                    self.answered(i, key, matched)
                done = False  # the stream's generator releases the replica
                relay = self.relay(i, resp, first, chunks)
                return StreamingResponse(relay, resp.status_code, headers=out_headers)
            finally:
                if done:
                    self.release(i)

    async def relay(
        self, i: int, resp: httpx.Response, first: bytes, chunks: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes | str]:
        """A replica's streamed answer, chunk by chunk as it arrives; releases the replica at
        its end. A stream that breaks ends with an error chunk and ``[DONE]``."""
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        except httpx.TransportError as exc:
            self.fail(i, f"stream broke: {type(exc).__name__}", dead=False)
            # the client gets a clear end, not a stream cut without [DONE]
            msg = f"the replica's stream broke ({type(exc).__name__}); retry"
            yield sse(error_body(msg, type="server_error", code="replica_failed"))
            yield SSE_DONE
        finally:
            await resp.aclose()
            self.release(i)

    # ---------------------------------------------------------------- the router's own routes

    async def models(self, request: Request) -> Response:
        if isinstance(refused := self.authorize(request), Response):
            return refused
        tried: list[int] = []
        for i, st in enumerate(self.states):
            if not st.healthy:
                continue
            tried.append(i)
            r, error = await self.send_once_more_if_stale(
                "GET", st.url + "/v1/models", _headers_of(request)
            )
            if r is None:
                self.fail(i, type(error).__name__, dead=_unreachable(error))
                continue
            url = st.url if 200 <= r.status_code < 300 else None
            return Response(r.content, r.status_code, headers=_answer_headers(r, url))
        return _no_replica(len(tried))

    def replica_report(self) -> list[dict[str, Any]]:
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
            for st in self.states
        ]

    async def health(self) -> JSONResponse:
        ok = any(st.healthy for st in self.states)
        reps = [
            {"url": st.url, "healthy": st.healthy, "in_flight": st.in_flight, "errors": st.errors}
            for st in self.states
        ]  # open: nothing of the prompts (no match, key or tree sizes)
        body = {"status": "ok" if ok else "no healthy replica", "replicas": reps}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def stats(self, request: Request) -> Response:
        if isinstance(refused := self.authorize(request, admin=True), Response):
            return refused
        return JSONResponse({"policy": self.policy.name, "replicas": self.replica_report()})

    async def prom(self, request: Request) -> Response:
        admin = self.authorize(request, admin=True)
        if isinstance(admin, Response) and not self.public_metrics:
            return admin
        detail = not isinstance(admin, Response)  # public: load and health only
        return Response(self.metrics.render(detail=detail), media_type=CONTENT_TYPE_LATEST)

    async def flush(self, request: Request) -> Response:
        if isinstance(refused := self.authorize(request, admin=True), Response):
            return refused
        results = {}
        status = 200
        for i, st in enumerate(self.states):
            if not st.healthy:
                continue
            r, error = await self.send_once_more_if_stale(
                "POST", st.url + "/flush_cache", _headers_of(request)
            )
            if r is None:
                self.fail(i, type(error).__name__, dead=_unreachable(error))
                continue
            results[st.url] = r.status_code
            if r.status_code != 200:
                status = r.status_code
            else:
                st.index.clear()
        return JSONResponse({"success": status == 200, "replicas": results}, status_code=status)


def create_router_app(
    replicas: Sequence[str], policy: str = "cache_aware", **options: Any
) -> FastAPI:
    """The router app over ``replicas``: ``RouterApp(replicas, policy, **options)``'s app (see
    :class:`RouterApp` for the options; ``ValueError`` on a bad one)."""
    return RouterApp(replicas, policy, **options).build_app()
