"""OpenAI-compatible routes: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models`` (:class:`OpenAIRoutes`).

Each POST handler runs the same steps, each a method: parse the body into a plan (prompt token
ids and sampling params, :mod:`.openai_answers`), compile its structured-output constraint,
submit its engine request(s), then collect the whole answer or stream it
(:class:`~.openai_answers.CompletionAnswer`, :class:`~.openai_answers.ChatAnswer`).
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .context import ServerContext
from .intake import (
    chat_token_ids,
    check_prompt_not_empty,
    make_sampling_params,
    new_id,
    prompt_token_ids,
    resolve_max_tokens,
)
from .openai_answers import ChatAnswer, ChatPlan, CompletionAnswer, CompletionPlan
from .protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
)
from .streaming import Collected, SSEResponse
from .structured_outputs import compile_constraint, structured_kwargs
from .tool_calls import tool_plan

if TYPE_CHECKING:
    from radixkv.engine.api import EngineAPI
    from radixkv.engine.sampling import SamplingParams

    from .engine_loop import RequestStream


class OpenAIRoutes:
    """The OpenAI routes of one app, all behind ``ctx.auth``: :meth:`router` registers the
    handlers :meth:`completions`, :meth:`chat_completions` and :meth:`list_models`.

    A route method has no docstring (FastAPI would publish it as the route's OpenAPI
    description). Holds no per-request state: a request's state lives in its plan and answer
    (:mod:`.openai_answers`), so one instance serves every request of its app."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.engine: EngineAPI = ctx.engine

    def router(self) -> APIRouter:
        """The routes, each behind ``ctx.auth``."""
        router = APIRouter()
        auth = self.ctx.auth
        router.add_api_route(
            "/v1/completions", self.completions, methods=["POST"], dependencies=auth
        )
        router.add_api_route(
            "/v1/chat/completions", self.chat_completions, methods=["POST"], dependencies=auth
        )
        router.add_api_route("/v1/models", self.list_models, methods=["GET"], dependencies=auth)
        return router

    # ---------------------------------------------------------------- /v1/completions

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        ctx = self.ctx
        ctx.check_model(body.model)
        plan = await self.plan_completion(body)
        await compile_constraint(self.engine, plan.plans[0][1], ctx.owner())  # one for all
        rid = new_id("cmpl")
        streams = await self.submit_all(rid, plan, arrival)
        echoed = await self.echoed_texts(plan)
        if not body.stream:
            results = await self.collect_all(request, streams, body.n)
            answer = CompletionAnswer(plan, rid, echoed, ctx.served_name, ctx.token_str)
            return JSONResponse(answer.whole(results))
        answer = CompletionAnswer(plan, rid, echoed, ctx.served_name, ctx.token_str)
        return SSEResponse(ctx.guarded_stream(streams, partial(answer.stream, streams)))

    async def plan_completion(self, body: CompletionRequest) -> CompletionPlan:
        """Parse: each prompt's one tokenization and its sampling params (a 400 for an empty
        prompt or a bad field)."""
        engine = self.engine
        prompts = body.prompts()
        zero = body.max_tokens == 0  # with echo: the prompt alone (completion_batch)
        top = body.logprobs or 0
        echo_lp = body.echo and body.logprobs is not None
        plans: list[tuple[list[int], SamplingParams]] = []
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
        return CompletionPlan(body, prompts, plans)

    async def submit_all(
        self, rid: str, plan: CompletionPlan, arrival: float
    ) -> list[RequestStream]:
        """Submit one engine request per prompt (``rid``, or ``rid-p`` for several); if one is
        refused, those already submitted are aborted."""
        streams: list[RequestStream] = []
        try:
            for p, (ids, params) in enumerate(plan.plans):
                sub = rid if len(plan.plans) == 1 else f"{rid}-{p}"
                streams.append(
                    await self.ctx.submit(sub, ids, params, plan.body.cache_salt, arrival)
                )
        except BaseException:
            for st in streams:
                self.ctx.engine_loop.abort(st.request_id)
            raise
        return streams

    async def echoed_texts(self, plan: CompletionPlan) -> list[str]:
        """Each prompt's text before its choices' with ``echo`` ("" without): a text prompt as
        sent, token ids decoded."""
        echoed = [""] * len(plan.plans)
        if plan.body.echo:
            for p, prompt in enumerate(plan.prompts):
                echoed[p] = (
                    prompt if isinstance(prompt, str) else await self.echo_text(plan.plans[p][0])
                )
        return echoed

    async def echo_text(self, ids: list[int]) -> str:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            return ""
        return str(await asyncio.to_thread(tokenizer.decode, ids))

    async def collect_all(
        self, request: Request, streams: list[RequestStream], n: int
    ) -> list[Collected]:
        """Collect every prompt's whole answer; on an error or disconnect all are cancelled
        (each aborts its engine request)."""
        tasks = [asyncio.ensure_future(self.ctx.collect(request, st, n)) for st in streams]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:  # each aborts its engine request when cancelled
                t.cancel()
            raise

    # ---------------------------------------------------------------- /v1/chat/completions

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        ctx = self.ctx
        ctx.check_model(body.model)
        plan = await self.plan_chat(body)
        await compile_constraint(self.engine, plan.params, ctx.owner())
        rid = new_id("chatcmpl")
        stream = await ctx.submit(rid, plan.prompt_ids, plan.params, body.cache_salt, arrival)
        if not body.stream:
            result = await ctx.collect(request, stream, body.n)
            answer = ChatAnswer(plan, rid, ctx.served_name, ctx.token_str)
            return JSONResponse(answer.whole(result))
        answer = ChatAnswer(plan, rid, ctx.served_name, ctx.token_str)
        return SSEResponse(ctx.guarded_stream(stream, partial(answer.stream, stream)))

    async def plan_chat(self, body: ChatCompletionRequest) -> ChatPlan:
        """Parse: render the messages (with the tools the template shows) to token ids, and
        the sampling params with their constraint (the tools', or the body's)."""
        ctx = self.ctx
        messages = [m.template_dict() for m in body.messages]
        tools = tool_plan(body, ctx.tool_parser)
        options = ctx.template_options(body)
        if body.tools and body.tool_choice != "none":  # the template shows them (as vLLM)
            options["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
        prompt_ids = await chat_token_ids(self.engine, messages, **options)
        check_prompt_not_empty(prompt_ids, "messages")
        max_tokens = resolve_max_tokens(
            len(prompt_ids), body.requested_max_tokens(), self.engine.max_model_len, default=None
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
        return ChatPlan(body, prompt_ids, params, tools, reasoner)

    # ---------------------------------------------------------------- /v1/models

    async def list_models(self) -> dict[str, Any]:
        ctx = self.ctx
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": ctx.created,
                    "owned_by": "radixkv",
                    "root": str(self.engine.model_name),
                    "max_model_len": self.engine.max_model_len,
                }
                for name in ctx.served_names or [ctx.served_name]
            ],
        }
