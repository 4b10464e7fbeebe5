"""The FastAPI app: OpenAI-compatible and SGLang-style endpoints over one engine thread.

``create_app(engine, api_key=None, max_waiting=1024, model_name=None)`` returns the app; its
lifespan starts the :class:`~radixkv.server.engine_loop.EngineLoop` thread (and stops it).

Endpoints: ``POST /generate``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /health`` (never needs auth), ``GET /metrics``, ``GET /cache/stats``,
``POST /flush_cache``, ``POST /cache/pin``. Every error is answered in OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from .engine_loop import EngineLoop, EngineRequestError, QueueFullError, RequestStream
from .metrics import ServerMetrics
from .protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    PinRequest,
    apply_chat_template,
    check_prompt_not_empty,
    error_body,
    make_sampling_params,
    new_id,
    now,
    resolve_max_tokens,
    tokenize_text,
    usage_dict,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MAX_WAITING = 1024
_SSE_DONE = "data: [DONE]\n\n"


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


class _ClientDisconnected(Exception):
    """The client went away before the answer was ready."""


class SSEResponse(StreamingResponse):
    """A streaming response that always notices a client disconnect and closes its generator.

    Starlette only listens for ``http.disconnect`` on old ASGI servers; on ASGI >= 2.4 it relies
    on ``send`` failing, which happens only at the next chunk and leaves the body generator
    un-closed. Here a disconnect cancels the stream at once and the generator is always closed,
    so its ``finally`` (which aborts the engine request) runs promptly.
    """

    def __init__(self, content: AsyncIterator[str], **kwargs: Any) -> None:
        kwargs.setdefault("media_type", "text/event-stream")
        headers = dict(kwargs.pop("headers", None) or {})
        headers.setdefault("Cache-Control", "no-cache")
        headers.setdefault("X-Accel-Buffering", "no")
        super().__init__(content, headers=headers, **kwargs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise _ClientDisconnected


@dataclass
class _Seq:
    """What one sequence (one of ``n``) produced so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    sent_role: bool = False


@dataclass
class _Collected:
    """A whole request's outputs (non-streaming answers)."""

    seqs: list[_Seq]
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)

    def update_meta(self, out: Any) -> None:
        self.prompt_tokens = max(self.prompt_tokens, int(out.prompt_tokens or 0))
        self.cached_tokens = max(self.cached_tokens, int(out.cached_tokens or 0))
        for tier, count in (getattr(out, "cached_tokens_by_tier", None) or {}).items():
            self.cached_by_tier[tier] = max(self.cached_by_tier.get(tier, 0), int(count))

    def add(self, out: Any) -> _Seq:
        self.update_meta(out)
        seq = self.seqs[int(getattr(out, "index", 0) or 0)]
        seq.text += out.new_text or ""
        seq.token_ids.extend(out.new_token_ids or ())
        if out.logprobs:
            seq.logprobs.extend(out.logprobs)
        if out.finished:
            seq.finish_reason = out.finish_reason
        return seq

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    def usage(self) -> dict[str, Any]:
        return usage_dict(
            self.prompt_tokens, self.completion_tokens, self.cached_tokens, self.cached_by_tier
        )


# --------------------------------------------------------------------------------------------
# App factory
# --------------------------------------------------------------------------------------------


def create_app(
    engine: Any,
    *,
    api_key: str | None = None,
    max_waiting: int | None = DEFAULT_MAX_WAITING,
    model_name: str | None = None,
) -> FastAPI:
    """Build the server app around ``engine`` (see docs/design.md, "Engine step API").

    ``api_key``: when set, every endpoint but ``/health`` needs ``Authorization: Bearer KEY``.
    ``max_waiting``: bound on requests accepted but not yet producing tokens (503 past it).
    ``model_name``: the name served in ``/v1/models`` and checked in requests (defaults to
    ``engine.model_name``).
    """
    served_name = model_name or str(getattr(engine, "model_name", None) or "default")
    accepted_names = {served_name, str(getattr(engine, "model_name", served_name))}
    metrics = ServerMetrics(served_name)
    engine_loop = EngineLoop(engine, metrics=metrics, max_waiting=max_waiting)
    created = now()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine_loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(engine_loop.stop)

    app = FastAPI(title="radixkv", version="0.1.0", lifespan=lifespan)
    app.state.engine = engine
    app.state.engine_loop = engine_loop
    app.state.metrics = metrics
    app.state.model_name = served_name

    # ---------------------------------------------------------------- errors

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.rejected.labels(reason="invalid").inc()
        message, param = _describe_validation_errors(list(exc.errors()))
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body(str(exc.detail), type=kind), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return JSONResponse(
            error_body(f"internal server error: {type(exc).__name__}: {exc}", type="server_error"),
            status_code=500,
        )

    # ---------------------------------------------------------------- auth

    async def require_auth(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), api_key.encode()
        ):
            raise APIError(
                401,
                "Incorrect or missing API key: send the header 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    auth = [Depends(require_auth)]

    # ---------------------------------------------------------------- shared request path

    def check_model(name: str) -> None:
        if name not in accepted_names:
            raise APIError(
                404,
                f"The model `{name}` does not exist. This server serves `{served_name}`.",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )

    async def submit(
        request_id: str, prompt: str | list[int], params: Any, salt: str | None, arrival: float
    ) -> RequestStream:
        try:
            return await engine_loop.add_request(
                request_id, prompt, params, salt=salt, arrival=arrival
            )
        except ValueError as exc:
            metrics.rejected.labels(reason="invalid").inc()
            raise APIError(400, str(exc)) from exc
        except QueueFullError as exc:
            metrics.rejected.labels(reason="queue_full").inc()
            raise APIError(503, str(exc), type="server_error", code="queue_full") from exc
        except EngineRequestError as exc:
            raise APIError(exc.status_code, exc.message, type="server_error") from exc

    async def collect(request: Request, stream: RequestStream, n: int) -> _Collected:
        """Gather a whole request; abort it if the client disconnects."""
        result = _Collected(seqs=[_Seq() for _ in range(n)])

        async def consume() -> None:
            async for out in stream.outputs():
                result.add(out)

        try:
            await _unless_disconnected(request, consume())
        except _ClientDisconnected:
            engine_loop.abort(stream.request_id)
            raise
        except EngineRequestError as exc:
            engine_loop.release(stream.request_id)
            raise APIError(exc.status_code, exc.message, type="server_error") from exc
        except BaseException:
            engine_loop.abort(stream.request_id)
            raise
        engine_loop.release(stream.request_id)
        return result

    async def guarded_stream(
        stream: RequestStream, body: Callable[[], AsyncIterator[str]]
    ) -> AsyncIterator[str]:
        """Run a streaming body; on disconnect or error the engine request is aborted."""
        completed = False
        try:
            async for chunk in body():
                yield chunk
            completed = True
        except EngineRequestError as exc:
            completed = True  # the loop already dropped it from the engine
            yield _sse(error_body(exc.message, type="server_error", code=exc.status_code))
            yield _SSE_DONE
        finally:
            if completed:
                engine_loop.release(stream.request_id)
            else:
                engine_loop.abort(stream.request_id)

    def token_str(token_id: int) -> str:
        tokenizer = getattr(engine, "tokenizer", None)
        if tokenizer is None:
            return f"<{token_id}>"
        return str(tokenizer.decode([token_id]))

    # ---------------------------------------------------------------- OpenAI: completions

    def completion_logprobs(
        token_ids: list[int], logprobs: list[float], top: int, offset: int
    ) -> dict[str, Any]:
        tokens = [token_str(t) for t in token_ids]
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        lps = list(logprobs) + [None] * (len(tokens) - len(logprobs))
        return {
            "tokens": tokens,
            "token_logprobs": lps[: len(tokens)],
            "top_logprobs": [
                {t: lp} if top > 0 and lp is not None else {} for t, lp in zip(tokens, lps)
            ],
            "text_offset": offsets,
        }

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        check_model(body.model)
        prompt = body.single_prompt()
        check_prompt_not_empty(prompt)
        prompt_len = len(prompt) if isinstance(prompt, list) else len(tokenize_text(engine, prompt))
        check_prompt_not_empty(prompt if isinstance(prompt, list) else [0] * prompt_len)
        max_tokens = resolve_max_tokens(
            prompt_len,
            body.max_tokens,
            engine.max_model_len,
            default=DEFAULT_COMPLETION_MAX_TOKENS,
        )
        params = make_sampling_params(
            body.engine_kwargs(
                max_tokens=max_tokens, default_temperature=1.0, logprobs=body.logprobs
            )
        )
        rid = new_id("cmpl")
        stream = await submit(rid, prompt, params, body.cache_salt, arrival)
        top = body.logprobs or 0
        want_logprobs = body.logprobs is not None

        if not body.stream:
            result = await collect(request, stream, body.n)
            choices = []
            for i, seq in enumerate(result.seqs):
                choices.append(
                    {
                        "index": i,
                        "text": seq.text,
                        "logprobs": completion_logprobs(seq.token_ids, seq.logprobs, top, 0)
                        if want_logprobs
                        else None,
                        "finish_reason": seq.finish_reason,
                    }
                )
            return JSONResponse(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": now(),
                    "model": served_name,
                    "choices": choices,
                    "usage": result.usage(),
                }
            )

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        created_at = now()

        async def body_iter() -> AsyncIterator[str]:
            result = _Collected(seqs=[_Seq() for _ in range(body.n)])
            async for out in stream.outputs():
                seq = result.seqs[int(getattr(out, "index", 0) or 0)]
                offset = len(seq.text)
                result.add(out)
                if not (out.new_text or out.finished or out.new_token_ids):
                    continue
                chunk: dict[str, Any] = {
                    "id": rid,
                    "object": "text_completion",
                    "created": created_at,
                    "model": served_name,
                    "choices": [
                        {
                            "index": int(getattr(out, "index", 0) or 0),
                            "text": out.new_text or "",
                            "logprobs": completion_logprobs(
                                list(out.new_token_ids or ()), list(out.logprobs or ()), top, offset
                            )
                            if want_logprobs
                            else None,
                            "finish_reason": out.finish_reason if out.finished else None,
                        }
                    ],
                }
                if include_usage:
                    chunk["usage"] = None
                yield _sse(chunk)
            if include_usage:
                yield _sse(
                    {
                        "id": rid,
                        "object": "text_completion",
                        "created": created_at,
                        "model": served_name,
                        "choices": [],
                        "usage": result.usage(),
                    }
                )
            yield _SSE_DONE

        return SSEResponse(guarded_stream(stream, body_iter))

    # ---------------------------------------------------------------- OpenAI: chat

    def chat_logprobs(token_ids: list[int], logprobs: list[float], top: int) -> dict[str, Any]:
        content = []
        for tid, lp in zip(token_ids, logprobs):
            tok = token_str(tid)
            entry = {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}
            content.append({**entry, "top_logprobs": [entry] if top > 0 else []})
        return {"content": content}

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        check_model(body.model)
        tokenizer = getattr(engine, "tokenizer", None)
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: use /v1/completions with token ids")
        prompt_ids = apply_chat_template(tokenizer, [m.template_dict() for m in body.messages])
        check_prompt_not_empty(prompt_ids, "messages")
        max_tokens = resolve_max_tokens(
            len(prompt_ids), body.requested_max_tokens(), engine.max_model_len, default=None
        )
        top = body.top_logprobs or 0
        params = make_sampling_params(
            body.engine_kwargs(
                max_tokens=max_tokens,
                default_temperature=1.0,
                logprobs=top if body.logprobs else None,
            )
        )
        rid = new_id("chatcmpl")
        stream = await submit(rid, prompt_ids, params, body.cache_salt, arrival)

        if not body.stream:
            result = await collect(request, stream, body.n)
            choices = []
            for i, seq in enumerate(result.seqs):
                choices.append(
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": seq.text},
                        "logprobs": chat_logprobs(seq.token_ids, seq.logprobs, top)
                        if body.logprobs
                        else None,
                        "finish_reason": seq.finish_reason,
                    }
                )
            return JSONResponse(
                {
                    "id": rid,
                    "object": "chat.completion",
                    "created": now(),
                    "model": served_name,
                    "choices": choices,
                    "usage": result.usage(),
                }
            )

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        created_at = now()

        def chunk(index: int, delta: dict[str, Any], finish: str | None, lp: Any) -> str:
            payload: dict[str, Any] = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created_at,
                "model": served_name,
                "choices": [
                    {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
                ],
            }
            if include_usage:
                payload["usage"] = None
            return _sse(payload)

        async def body_iter() -> AsyncIterator[str]:
            result = _Collected(seqs=[_Seq() for _ in range(body.n)])
            for i in range(body.n):
                result.seqs[i].sent_role = True
                yield chunk(i, {"role": "assistant", "content": ""}, None, None)
            async for out in stream.outputs():
                index = int(getattr(out, "index", 0) or 0)
                result.add(out)
                lp = (
                    chat_logprobs(list(out.new_token_ids or ()), list(out.logprobs or ()), top)
                    if body.logprobs and out.new_token_ids
                    else None
                )
                if out.new_text or lp is not None:
                    yield chunk(index, {"content": out.new_text or ""}, None, lp)
                if out.finished:
                    yield chunk(index, {}, out.finish_reason, None)
            if include_usage:
                yield _sse(
                    {
                        "id": rid,
                        "object": "chat.completion.chunk",
                        "created": created_at,
                        "model": served_name,
                        "choices": [],
                        "usage": result.usage(),
                    }
                )
            yield _SSE_DONE

        return SSEResponse(guarded_stream(stream, body_iter))

    # ---------------------------------------------------------------- SGLang: /generate

    @app.post("/generate", dependencies=auth)
    async def generate(body: GenerateRequest, request: Request) -> Response:
        arrival = time.monotonic()
        prompt = body.prompt()
        param = "text" if body.text is not None else "input_ids"
        check_prompt_not_empty(prompt, param)
        prompt_len = len(prompt) if isinstance(prompt, list) else len(tokenize_text(engine, prompt))
        check_prompt_not_empty([0] * prompt_len, param)
        sp = body.sampling_params
        max_tokens = resolve_max_tokens(
            prompt_len, sp.requested_max_tokens(), engine.max_model_len, default=None
        )
        params = make_sampling_params(
            sp.engine_kwargs(
                max_tokens=max_tokens,
                default_temperature=1.0,
                logprobs=0 if body.return_logprob else None,
            )
        )
        rid = new_id("gen")
        stream = await submit(rid, prompt, params, body.salt, arrival)
        n = sp.n

        def item(result: _Collected, index: int) -> dict[str, Any]:
            seq = result.seqs[index]
            reason = seq.finish_reason
            finish: dict[str, Any] | None = None
            if reason is not None:
                finish = {"type": reason}
                if reason == "length":
                    finish["length"] = max_tokens
            meta: dict[str, Any] = {
                "id": rid,
                "prompt_tokens": result.prompt_tokens,
                "completion_tokens": len(seq.token_ids),
                "cached_tokens": result.cached_tokens,
                "cached_tokens_details": dict(result.cached_by_tier),
                "finish_reason": finish,
                "e2e_latency": time.monotonic() - arrival,
            }
            if body.return_logprob:
                meta["output_token_logprobs"] = list(seq.logprobs)
            out: dict[str, Any] = {
                "text": seq.text,
                "output_ids": list(seq.token_ids),
                "meta_info": meta,
            }
            if n > 1:
                out["index"] = index
            return out

        if not body.stream:
            result = await collect(request, stream, n)
            items = [item(result, i) for i in range(n)]
            return JSONResponse(items if n > 1 else items[0])

        async def body_iter() -> AsyncIterator[str]:
            result = _Collected(seqs=[_Seq() for _ in range(n)])
            async for out in stream.outputs():
                result.add(out)
                if out.new_token_ids or out.finished:
                    yield _sse(item(result, int(getattr(out, "index", 0) or 0)))
            yield _SSE_DONE

        return SSEResponse(guarded_stream(stream, body_iter))

    # ---------------------------------------------------------------- models, health, metrics

    @app.get("/v1/models", dependencies=auth)
    async def list_models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": served_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "radixkv",
                    "max_model_len": getattr(engine, "max_model_len", None),
                }
            ],
        }

    @app.get("/health")
    async def health() -> Response:
        if not engine_loop.alive:
            return JSONResponse(
                error_body("the engine thread is not running", type="server_error"),
                status_code=503,
            )
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", dependencies=auth)
    async def prometheus_metrics() -> Response:
        try:
            stats = await engine_loop.call(lambda e: e.stats())
            metrics.update_from_stats(stats)
        except Exception:  # stale gauges beat a failed scrape
            logger.exception("engine.stats() failed during a metrics scrape")
        return Response(metrics.render(), media_type=metrics.content_type)

    # ---------------------------------------------------------------- cache administration

    @app.get("/cache/stats", dependencies=auth)
    async def cache_stats() -> dict[str, Any]:
        stats = await engine_loop.call(lambda e: e.stats())
        metrics.update_from_stats(stats)
        return jsonable_encoder(stats)

    @app.post("/flush_cache", dependencies=auth)
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

    @app.post("/cache/pin", dependencies=auth)
    async def pin(body: PinRequest) -> dict[str, Any]:
        arrival = time.monotonic()
        if body.text is not None:
            check_prompt_not_empty(body.text, "text")
            ids = tokenize_text(engine, body.text)
        else:
            ids = list(body.input_ids or [])
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
        try:
            pinned = await engine_loop.call(
                lambda e: int(e.pin_prefix(ids, salt=body.salt, ttl=body.ttl))
            )
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        return {"pinned_tokens": pinned, "prompt_tokens": len(ids)}

    return app


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


def _in_flight(engine: Any) -> int:
    """Running + waiting requests according to ``engine.stats()`` (best effort)."""
    try:
        stats = engine.stats()
        return int(stats.get("running", 0)) + int(stats.get("waiting", 0))
    except Exception:  # pragma: no cover - defensive
        return -1
