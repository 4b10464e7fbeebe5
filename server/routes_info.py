"""What vLLM and SGLang clients ask a server about itself, and its tokenizer.

* ``GET /version`` and ``GET|POST /ping`` (vLLM), open like ``/health``: ``{"version"}`` and an
  empty 200.
* ``POST /tokenize`` (vLLM's shape): ``{"prompt": TEXT, "add_special_tokens": true}`` or
  ``{"messages": [...]}`` (rendered by the chat template as the chat endpoint renders it, with
  the same template fields) ->
  ``{"count", "max_model_len", "tokens"}`` (``"token_strs"`` too with ``return_token_strs``).
  Without ``add_special_tokens`` (``false``) the ids are exactly those the engine computes for
  the prompt.
* ``POST /detokenize``: ``{"tokens": [...]}`` -> ``{"prompt": TEXT}``.
* ``GET /server_info`` / ``/get_server_info`` and ``/model_info`` / ``/get_model_info``
  (SGLang's names, what sgl-router reads to register a worker): the served model, context length,
  page size, KV pool size, version.

``model`` is optional in the tokenizer bodies; when given it must be a served name (404
otherwise). Text is bounded before tokenizing (:func:`.intake.check_text_length`), ids before
decoding (a context's worth at most).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import ConfigDict, Field, model_validator

from radixkv import __version__

from .context import ServerContext
from .intake import chat_token_ids, check_text_length
from .protocol import APIError, ChatMessage, RequestBody
from .protocol_fields import ChatTemplateFields

if TYPE_CHECKING:
    from radixkv.engine.api import Tokenizer

__all__ = ["DetokenizeRequest", "TokenizeRequest", "info_routes"]


class TokenizeRequest(RequestBody, ChatTemplateFields):
    """``POST /tokenize``: exactly one of ``prompt`` (text) or ``messages`` (rendered with the
    chat endpoint's template controls: ``add_generation_prompt``, ``continue_final_message``,
    ``chat_template_kwargs``, ``chat_template``)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` or `messages`")
        return self


class DetokenizeRequest(RequestBody):
    """``POST /detokenize``."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int] = Field(..., max_length=1 << 20)


def info_routes(ctx: ServerContext) -> APIRouter:
    """The discovery and tokenizer routes of one app."""
    engine = ctx.engine
    router = APIRouter()

    def tokenizer() -> Tokenizer:
        tok = engine.tokenizer
        if tok is None:
            raise APIError(
                400, "this model has no tokenizer: it takes token ids only", code="no_tokenizer"
            )
        return tok

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @router.api_route("/ping", methods=["GET", "POST"], include_in_schema=False)
    async def ping() -> Response:
        return Response(status_code=200)

    @router.post("/tokenize", dependencies=ctx.auth)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        tok = tokenizer()
        if body.messages is not None:
            messages = [m.template_dict() for m in body.messages]
            ids = await chat_token_ids(engine, messages, **ctx.template_options(body))
        else:
            text = str(body.prompt)
            check_text_length(engine, len(text), "prompt")
            ids = await asyncio.to_thread(
                tok.encode, text, add_special_tokens=body.add_special_tokens
            )
        ids = [int(t) for t in ids]
        out: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": engine.max_model_len,
            "tokens": ids,
        }
        if body.return_token_strs:
            convert = getattr(tok, "convert_ids_to_tokens", None)
            if convert is None:  # a tokenizer without token strings: each id's text
                out["token_strs"] = await asyncio.to_thread(lambda: [tok.decode([i]) for i in ids])
            else:
                out["token_strs"] = await asyncio.to_thread(convert, ids)
        return out

    @router.post("/detokenize", dependencies=ctx.auth)
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        ctx.check_model(body.model)
        tok = tokenizer()
        if any(t < 0 for t in body.tokens):
            raise APIError(400, "tokens must be token ids (>= 0)", param="tokens")
        # a decode holds the tokenizer lock the engine thread needs: no more than a context
        limit = int(engine.max_model_len or 0)
        if limit and len(body.tokens) > limit:
            raise APIError(
                400,
                f"tokens holds {len(body.tokens)} ids; this model's context holds {limit} and "
                "no more are decoded at once (send them in parts)",
                param="tokens",
                code="context_length_exceeded",
            )
        try:
            text = await asyncio.to_thread(tok.decode, body.tokens)
        except (OverflowError, ValueError, TypeError, IndexError) as exc:
            raise APIError(
                400, f"tokens holds ids this tokenizer cannot decode: {exc}", param="tokens"
            ) from exc
        return {"prompt": str(text)}

    def describe_model() -> dict[str, Any]:
        return {
            "model_path": str(engine.model_name),
            "tokenizer_path": str(engine.model_name),
            "served_model_name": ctx.served_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
        }

    async def server_info() -> dict[str, Any]:
        stats = await ctx.engine_loop.call(lambda e: e.stats())
        pages = int(stats.get("pages_total", 0))
        page_size = int(stats.get("page_size", 0) or engine.page_size)
        return {
            **describe_model(),
            "version": __version__,
            "context_length": engine.max_model_len,
            "page_size": page_size,
            "max_total_num_tokens": pages * page_size,
            "max_running_requests": engine.max_running_requests,
            "dp_size": 1,
            "tp_size": 1,
        }

    async def model_info() -> dict[str, Any]:
        return describe_model()

    for path in ("/model_info", "/get_model_info"):
        router.add_api_route(path, model_info, methods=["GET"], dependencies=ctx.auth)
    for path in ("/server_info", "/get_server_info"):
        router.add_api_route(path, server_info, methods=["GET"], dependencies=ctx.auth)
    return router
