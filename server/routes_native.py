"""The SGLang-style native route: ``POST /generate`` (text or token ids in, ``meta_info`` out)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .context import ServerContext
from .intake import (
    check_prompt_not_empty,
    make_sampling_params,
    new_id,
    prompt_token_ids,
    resolve_max_tokens,
)
from .logprob_format import sglang_token_logprobs, sglang_top_logprobs
from .protocol import APIError, GenerateRequest
from .streaming import SSE_DONE, Collected, Seq, SSEResponse, sse
from .structured_outputs import compile_constraint, structured_kwargs


def native_routes(ctx: ServerContext) -> APIRouter:
    """The ``/generate`` route of one app (behind ``ctx.auth``)."""
    engine = ctx.engine
    auth = ctx.auth
    submit, collect, guarded_stream = ctx.submit, ctx.collect, ctx.guarded_stream
    router = APIRouter()

    @router.post("/generate", dependencies=auth)
    async def generate(body: GenerateRequest, request: Request) -> Response:
        arrival = time.monotonic()
        prompt = body.prompt()
        param = "text" if body.text is not None else "input_ids"
        ids = await prompt_token_ids(engine, prompt)  # the request's one tokenization
        check_prompt_not_empty(ids, param)
        prompt_len = len(ids)
        sp = body.sampling_params
        max_tokens = resolve_max_tokens(
            prompt_len, sp.requested_max_tokens(), engine.max_model_len, default=None
        )
        kwargs = sp.engine_kwargs(
            max_tokens=max_tokens,
            default_temperature=1.0,
            logprobs=body.top_logprobs_num if body.return_logprob else None,
        )
        start = body.logprob_start_len
        if body.return_logprob and start >= 0:  # input logprobs from position `start` on
            if start >= prompt_len:
                raise APIError(
                    400,
                    f"logprob_start_len ({start}) must be < the prompt length ({prompt_len})",
                    param="logprob_start_len",
                )
            kwargs["prompt_logprobs"] = body.top_logprobs_num
        params = make_sampling_params(kwargs | structured_kwargs(sp))
        await compile_constraint(engine, params, ctx.owner())
        token_str, with_text = ctx.token_str, body.return_text_in_logprobs
        top = body.top_logprobs_num
        prompt_ids = ids if body.return_logprob and start >= 0 else None
        rid = new_id("gen")
        stream = await submit(rid, ids, params, body.salt, arrival)
        n = sp.n

        def item(result: Collected, index: int) -> dict[str, Any]:
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
                meta["output_token_logprobs"] = sglang_token_logprobs(
                    seq.token_ids, seq.logprobs, token_str, with_text
                )
                meta["output_top_logprobs"] = (
                    sglang_top_logprobs(seq.logprobs, top, token_str, with_text)
                    if top > 0
                    else [None] * len(seq.token_ids)
                )
            if prompt_ids is not None and result.prompt_logprobs is not None:
                meta["input_token_logprobs"] = sglang_token_logprobs(
                    prompt_ids[start:], result.prompt_logprobs[start:], token_str, with_text
                )
                meta["input_top_logprobs"] = (
                    sglang_top_logprobs(result.prompt_logprobs[start:], top, token_str, with_text)
                    if top > 0
                    else [None] * (len(prompt_ids) - start)
                )
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
            result = Collected(seqs=[Seq() for _ in range(n)])
            async for out in stream.outputs():
                result.add(out)
                if out.new_token_ids or out.finished:
                    yield sse(item(result, int(out.index or 0)))
            yield SSE_DONE

        return SSEResponse(guarded_stream(stream, body_iter))

    return router
