"""OpenAI-compatible routes: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .completion_batch import echo_logprobs, merged, summed_usage
from .context import ServerContext
from .intake import (
    chat_token_ids,
    check_prompt_not_empty,
    make_sampling_params,
    new_id,
    now,
    prompt_token_ids,
    resolve_max_tokens,
)
from .logprob_format import chat_logprobs, completion_logprobs, vllm_prompt_logprobs
from .protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
)
from .reasoning import ReasoningStream, split_reasoning
from .streaming import SSE_DONE, Collected, Seq, SSEResponse, sse
from .structured_outputs import compile_constraint, structured_kwargs
from .tool_calls import ToolCallStream, tool_plan


def openai_routes(ctx: ServerContext) -> APIRouter:
    """The OpenAI routes of one app (all behind ``ctx.auth``)."""
    engine = ctx.engine
    served_name = ctx.served_name
    auth = ctx.auth
    check_model, submit, collect = ctx.check_model, ctx.submit, ctx.collect
    guarded_stream, token_str = ctx.guarded_stream, ctx.token_str
    router = APIRouter()

    async def echo_text(ids: list[int]) -> str:
        tokenizer = engine.tokenizer
        if tokenizer is None:
            return ""
        return str(await asyncio.to_thread(tokenizer.decode, ids))

    def prompt_logprobs(result: Collected, prompt_ids: list[int] | None, k: int) -> Any:
        if result.prompt_logprobs is None or prompt_ids is None:
            return None
        return vllm_prompt_logprobs(prompt_ids, result.prompt_logprobs, k, token_str)

    @router.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        check_model(body.model)
        prompts = body.prompts()
        zero = body.max_tokens == 0  # with echo: the prompt alone (completion_batch)
        want_logprobs, top = body.logprobs is not None, body.logprobs or 0
        echo_lp = body.echo and want_logprobs
        plans: list[tuple[list[int], Any]] = []
        for prompt in prompts:
            ids = await prompt_token_ids(engine, prompt)  # the prompt's one tokenization
            check_prompt_not_empty(ids)
            max_tokens = resolve_max_tokens(
                len(ids),
                1 if zero else body.max_tokens,
                engine.max_model_len,
                default=DEFAULT_COMPLETION_MAX_TOKENS,
            )
            kwargs = body.engine_kwargs(
                max_tokens=max_tokens, default_temperature=1.0, logprobs=body.logprobs
            )
            if echo_lp:  # the prompt's logprobs too, with the same top-k
                kwargs["prompt_logprobs"] = max(kwargs["prompt_logprobs"] or 0, top)
            plans.append((ids, make_sampling_params(kwargs | structured_kwargs(body))))
        await compile_constraint(engine, plans[0][1], ctx.owner())  # one constraint for all
        rid = new_id("cmpl")
        streams: list[Any] = []
        try:
            for p, (ids, params) in enumerate(plans):
                sub = rid if len(plans) == 1 else f"{rid}-{p}"
                streams.append(await submit(sub, ids, params, body.cache_salt, arrival))
        except BaseException:
            for st in streams:
                ctx.engine_loop.abort(st.request_id)
            raise
        n = body.n
        echoed = [""] * len(plans)  # echo: each prompt's text before its choices'
        if body.echo:
            for p, prompt in enumerate(prompts):
                echoed[p] = prompt if isinstance(prompt, str) else await echo_text(plans[p][0])

        def choice_logprobs(p: int, result: Collected, ids: list[int], lps: list[Any]) -> Any:
            if echo_lp:
                return echo_logprobs(plans[p][0], result.prompt_logprobs, ids, lps, top, token_str)
            return completion_logprobs(ids, lps, top, token_str, 0) if want_logprobs else None

        if not body.stream:
            tasks = [asyncio.ensure_future(collect(request, st, n)) for st in streams]
            try:
                results = list(await asyncio.gather(*tasks))
            except BaseException:
                for t in tasks:  # each aborts its engine request when cancelled
                    t.cancel()
                raise
            choices = []
            for p, result in enumerate(results):
                for i, seq in enumerate(result.seqs):
                    ids, lps, text = (
                        ([], [], "") if zero else (seq.token_ids, seq.logprobs, seq.text)
                    )
                    choice = {
                        "index": p * n + i,
                        "text": echoed[p] + text,
                        "logprobs": choice_logprobs(p, result, ids, lps),
                        "finish_reason": "length" if zero else seq.finish_reason,
                        "stop_reason": None if zero else seq.stop_reason,
                    }
                    if body.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = prompt_logprobs(
                            result, plans[p][0], body.prompt_logprobs
                        )
                    choices.append(choice)
            return JSONResponse(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": now(),
                    "model": served_name,
                    "choices": choices,
                    "usage": summed_usage(results, completion=not zero),
                }
            )

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        created_at = now()

        def text_chunk(
            index: int, text: str, logprobs: Any = None, finish: Any = None, stop: Any = None
        ) -> dict[str, Any]:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            if finish is not None or stop is not None:
                choice["stop_reason"] = stop
            chunk: dict[str, Any] = {
                "id": rid,
                "object": "text_completion",
                "created": created_at,
                "model": served_name,
                "choices": [choice],
            }
            if include_usage:
                chunk["usage"] = None
            return chunk

        async def body_iter() -> AsyncIterator[str]:
            results = [Collected(seqs=[Seq() for _ in range(n)]) for _ in plans]
            # the echo goes first; with logprobs once the prompt's logprobs are known (they come
            # with its first output)
            echo_due = set(range(len(plans))) if body.echo else set()
            if not echo_lp:
                for p in sorted(echo_due):
                    for i in range(n):
                        yield sse(text_chunk(p * n + i, echoed[p]))
                echo_due.clear()
            async for p, out in merged([st.outputs() for st in streams]):
                result = results[p]
                local = int(out.index or 0)
                seq = result.seqs[local]
                offset = len(echoed[p]) + len(seq.text) if echo_lp else len(seq.text)
                result.add(out)
                if p in echo_due:
                    echo_due.discard(p)
                    for i in range(n):
                        elp = echo_logprobs(plans[p][0], result.prompt_logprobs, [], [], top,
                                            token_str)  # fmt: skip
                        yield sse(text_chunk(p * n + i, echoed[p], elp))
                if zero:  # the one token run is not the answer
                    if out.finished:
                        yield sse(text_chunk(p * n + local, "", None, "length"))
                    continue
                if not (out.new_text or out.finished or out.new_token_ids):
                    continue
                lp = (
                    completion_logprobs(
                        list(out.new_token_ids or ()),
                        list(out.logprobs or ()),
                        top,
                        token_str,
                        offset,
                    )  # fmt: skip
                    if want_logprobs
                    else None
                )
                yield sse(
                    text_chunk(
                        p * n + local,
                        out.new_text or "",
                        lp,
                        out.finish_reason if out.finished else None,
                        out.stop_reason,
                    )
                )
            if include_usage:
                yield sse(
                    {
                        "id": rid,
                        "object": "text_completion",
                        "created": created_at,
                        "model": served_name,
                        "choices": [],
                        "usage": summed_usage(results, completion=not zero),
                    }
                )
            yield SSE_DONE

        return SSEResponse(guarded_stream(streams, body_iter))

    # ---------------------------------------------------------------- OpenAI: chat

    @router.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        check_model(body.model)
        messages = [m.template_dict() for m in body.messages]
        tools = tool_plan(body, ctx.tool_parser)
        options = ctx.template_options(body)
        if body.tools and body.tool_choice != "none":  # the template shows them (as vLLM)
            options["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
        prompt_ids = await chat_token_ids(engine, messages, **options)
        check_prompt_not_empty(prompt_ids, "messages")
        max_tokens = resolve_max_tokens(
            len(prompt_ids), body.requested_max_tokens(), engine.max_model_len, default=None
        )
        top = body.top_logprobs or 0
        # the model's <think> block as reasoning_content (--reasoning-parser; a request's
        # separate_reasoning false keeps it in the content, as SGLang)
        reasoner = ctx.reasoning if body.separate_reasoning is not False else None
        constraint = structured_kwargs(
            body, ("tools", tools.spec) if tools and tools.spec else None
        )
        if reasoner and constraint:  # the grammar applies after the reasoning (as vLLM)
            constraint["structured_outputs"].after_reasoning = (reasoner.start, reasoner.end)
        params = make_sampling_params(
            body.engine_kwargs(
                max_tokens=max_tokens,
                default_temperature=1.0,
                logprobs=top if body.logprobs else None,
            )
            | constraint
        )
        await compile_constraint(engine, params, ctx.owner())
        rid = new_id("chatcmpl")
        stream = await submit(rid, prompt_ids, params, body.cache_salt, arrival)

        if not body.stream:
            result = await collect(request, stream, body.n)
            choices = []
            for i, seq in enumerate(result.seqs):
                thought, text = (
                    split_reasoning(reasoner, seq.text) if reasoner else (None, seq.text)
                )
                message, finish = (
                    tools.message(text or "", seq.finish_reason)
                    if tools
                    else ({"role": "assistant", "content": text}, seq.finish_reason)
                )
                if reasoner:
                    message["reasoning_content"] = thought
                choices.append(
                    {
                        "index": i,
                        "message": message,
                        "logprobs": chat_logprobs(seq.token_ids, seq.logprobs, top, token_str)
                        if body.logprobs
                        else None,
                        "finish_reason": finish,
                        "stop_reason": seq.stop_reason,
                    }
                )
            answer = {
                "id": rid,
                "object": "chat.completion",
                "created": now(),
                "model": served_name,
                "choices": choices,
                "usage": result.usage(),
            }
            if body.prompt_logprobs is not None:  # vLLM's extra: top-level, once per request
                answer["prompt_logprobs"] = prompt_logprobs(
                    result, prompt_ids, body.prompt_logprobs
                )
            return JSONResponse(answer)

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        created_at = now()

        def chunk(
            index: int, delta: dict[str, Any], finish: str | None, lp: Any, stop: Any = None
        ) -> str:
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = stop
            payload: dict[str, Any] = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created_at,
                "model": served_name,
                "choices": [choice],
            }
            if include_usage:
                payload["usage"] = None
            return sse(payload)

        async def body_iter() -> AsyncIterator[str]:
            result = Collected(seqs=[Seq() for _ in range(body.n)])
            for i in range(body.n):
                result.seqs[i].sent_role = True
                yield chunk(i, {"role": "assistant", "content": ""}, None, None)
            tool_stream = ToolCallStream(tools) if tools else None
            thinking = [ReasoningStream(reasoner) for _ in range(body.n)] if reasoner else None
            async for out in stream.outputs():
                index = int(out.index or 0)
                result.add(out)
                text = out.new_text or ""
                if thinking is not None:  # the <think> block's deltas go as reasoning_content
                    thought, text = thinking[index].feed(text)
                    if out.finished:
                        rest = thinking[index].finish()
                        thought, text = thought + rest[0], text + rest[1]
                    if thought:
                        yield chunk(index, {"reasoning_content": thought}, None, None)
                if tool_stream is not None:  # tool-call deltas instead of content
                    stop = out.stop_reason
                    for delta, end in tool_stream.deltas(
                        index, text, out.finished, out.finish_reason
                    ):
                        yield chunk(index, delta, end, None, stop)
                    continue
                lp = (
                    chat_logprobs(
                        list(out.new_token_ids or ()), list(out.logprobs or ()), top, token_str
                    )
                    if body.logprobs and out.new_token_ids
                    else None
                )
                if text or lp is not None:
                    yield chunk(index, {"content": text}, None, lp)
                if out.finished:
                    yield chunk(index, {}, out.finish_reason, None, out.stop_reason)
            if include_usage:
                yield sse(
                    {
                        "id": rid,
                        "object": "chat.completion.chunk",
                        "created": created_at,
                        "model": served_name,
                        "choices": [],
                        "usage": result.usage(),
                    }
                )
            yield SSE_DONE

        return SSEResponse(guarded_stream(stream, body_iter))

    @router.get("/v1/models", dependencies=auth)
    async def list_models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": ctx.created,
                    "owned_by": "radixkv",
                    "root": str(engine.model_name),
                    "max_model_len": engine.max_model_len,
                }
                for name in ctx.served_names or [served_name]
            ],
        }

    return router
