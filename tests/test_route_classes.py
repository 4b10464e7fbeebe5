"""The route families and the router are classes whose handlers are methods (issue 60): each
handler can be called alone, without HTTP, the app or a server thread. One handler per class,
called directly on the fake engine (``fake_engine.py``), its real output checked."""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fake_engine import FakeEngine
from starlette.requests import Request

from radixkv.server.context import ServerContext
from radixkv.server.engine_loop import EngineLoop
from radixkv.server.metrics import ServerMetrics
from radixkv.server.protocol import CompletionRequest
from radixkv.server.routes_openai import OpenAIRoutes
from radixkv.server.streaming import SSE_DONE

MODEL = "fake"


def quiet_request() -> Request:
    """A request whose client never disconnects (its body was already parsed)."""

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


def context(engine: FakeEngine) -> ServerContext:
    metrics = ServerMetrics(MODEL, engine.max_model_len)
    loop = EngineLoop(engine, metrics=metrics)
    return ServerContext(
        engine=engine,
        engine_loop=loop,
        metrics=metrics,
        served_name=MODEL,
        accepted_names={MODEL},
        created=0,
        auth=[],
    )


async def _chunks(body: AsyncIterator[Any]) -> list[dict[str, Any]]:
    out = []
    async for chunk in body:
        text = chunk.decode() if isinstance(chunk, bytes) else chunk
        if text != SSE_DONE:
            out.append(json.loads(text.removeprefix("data: ")))
    return out


def test_openai_completions_handler_alone() -> None:
    """``OpenAIRoutes.completions``, whole and streamed: the fake engine's sequence ``i`` echoes
    the prompt from its token ``i``, so two prompts with ``n=2`` and ``max_tokens=3`` answer
    ``hel``/``ell`` and ``wor``/``orl`` at indices ``p * n + i``."""
    engine = FakeEngine()
    ctx = context(engine)
    routes = OpenAIRoutes(ctx)

    async def run() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        ctx.engine_loop.start()
        try:
            body = {"model": MODEL, "prompt": ["hello", "world"], "max_tokens": 3, "n": 2}
            whole = await routes.completions(CompletionRequest(**body), quiet_request())
            streamed = await routes.completions(
                CompletionRequest(**body, stream=True), quiet_request()
            )
            return json.loads(bytes(whole.body)), await _chunks(streamed.body_iterator)
        finally:
            await asyncio.to_thread(ctx.engine_loop.stop)

    whole, chunks = asyncio.run(run())
    expected = {0: "hel", 1: "ell", 2: "wor", 3: "orl"}
    assert whole["object"] == "text_completion" and whole["model"] == MODEL
    assert {c["index"]: c["text"] for c in whole["choices"]} == expected
    assert [c["finish_reason"] for c in whole["choices"]] == ["length"] * 4
    usage = whole["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        10,
        12,
        22,
    )
    streamed: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            streamed[choice["index"]] = streamed.get(choice["index"], "") + choice["text"]
    assert streamed == expected
    assert engine.has_unfinished() is False


def test_router_health_handler_alone() -> None:
    """``RouterApp.health`` over its typed state: 200 while a replica is healthy, 503 once the
    last one is marked down, each replica's health, in-flight and errors (nothing of the
    prompts); no replica is contacted, no app is built."""
    from radixkv.server.router import RouterApp

    router = RouterApp(["127.0.0.1:9", "http://127.0.0.1:10/"], health_interval=60.0)
    assert [st.url for st in router.states] == ["http://127.0.0.1:9", "http://127.0.0.1:10"]
    router.fail(0, "test", dead=True)
    first = asyncio.run(router.health())
    assert first.status_code == 200
    assert json.loads(bytes(first.body)) == {
        "status": "ok",
        "replicas": [
            {"url": "http://127.0.0.1:9", "healthy": False, "in_flight": 0, "errors": 1},
            {"url": "http://127.0.0.1:10", "healthy": True, "in_flight": 0, "errors": 0},
        ],
    }
    router.mark(1, False, "test")
    second = asyncio.run(router.health())
    assert second.status_code == 503
    assert json.loads(bytes(second.body))["status"] == "no healthy replica"


def test_server_app_handlers_alone() -> None:
    """``ServerApp``'s auth dependency and validation-error handler, called directly: a
    tenant's key passes ``require_auth`` but ``require_admin`` answers 403, the admin key
    passes both; a validation error becomes OpenAI's 400 naming the field, and counts as
    rejected ``invalid`` in the app's own metrics."""
    from fastapi.exceptions import RequestValidationError

    from radixkv.server.app import AppOptions, ServerApp
    from radixkv.server.protocol import APIError
    from radixkv.server.tenancy import REQUEST_CALLER

    server = ServerApp(FakeEngine(), AppOptions(api_key=["k-a", "k-b"], admin_key="k-admin"))
    assert server.served_names == ["fake-model"] and server.keys.open is False

    def keyed(key: str) -> Request:
        headers = [(b"authorization", f"Bearer {key}".encode())]
        return Request({"type": "http", "method": "GET", "path": "/", "headers": headers})

    tenant = contextvars.copy_context()  # the request's context: caller and tenant salt
    tenant.run(server.authenticate, keyed("k-a"), False)
    caller = tenant[REQUEST_CALLER]
    assert caller is not None and caller.admin is False and caller.key_id != "-"
    with pytest.raises(APIError) as refused:
        asyncio.run(server.require_admin(keyed("k-a")))
    assert refused.value.status_code == 403
    with pytest.raises(APIError) as unknown:
        asyncio.run(server.require_auth(keyed("k-c")))
    assert unknown.value.status_code == 401
    asyncio.run(server.require_admin(keyed("k-admin")))

    rejected = server.metrics.rejected.labels(reason="invalid")
    before = rejected._value.get()
    error = RequestValidationError(
        [{"type": "missing", "loc": ("body", "prompt"), "msg": "Field required"}]
    )
    answer = asyncio.run(server.validation_error(keyed("k-a"), error))
    assert answer.status_code == 400
    assert json.loads(bytes(answer.body)) == {
        "error": {
            "message": "prompt: Field required",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": None,
        }
    }
    assert rejected._value.get() == before + 1
