"""From a validated request to engine calls: prompt and context checks, tokenization and the
chat template, sampling parameters, and the small pieces of OpenAI's response shapes (ids,
timestamps, usage). Errors are :class:`~radixkv.server.protocol.APIError` (HTTP 400 naming the
field)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from radixkv.engine.chat_template import encode_rendered, render_chat_text
from radixkv.engine.errors import ParamError
from radixkv.engine.template_sandbox import TemplateBusyError, TemplateLimitError

from .protocol import APIError

if TYPE_CHECKING:
    from radixkv.engine.api import EngineAPI, Tokenizer
    from radixkv.engine.sampling import SamplingParams

__all__ = [
    "FinishReason",
    "apply_chat_template",
    "chat_token_ids",
    "check_prompt_not_empty",
    "conversation_chars",
    "check_text_length",
    "make_sampling_params",
    "named_field",
    "new_id",
    "prompt_token_ids",
    "now",
    "render_text",
    "resolve_max_tokens",
    "tokenize_text",
    "usage_dict",
]


def check_prompt_not_empty(prompt: str | Sequence[int], param: str = "prompt") -> None:
    """Refuse an empty prompt with a 400."""
    if len(prompt) == 0:
        raise APIError(400, f"{param} must not be empty", param=param)


def resolve_max_tokens(
    prompt_tokens: int, requested: int | None, max_model_len: int, *, default: int | None
) -> int:
    """Return the token budget or raise a 400 that names the numbers.

    ``requested`` None takes ``default``; a ``default`` of None means "the rest of the context"
    (OpenAI chat semantics).
    """
    if prompt_tokens >= max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {prompt_tokens} tokens, which leaves no room for a completion. "
            "Please shorten the prompt.",
            param="prompt",
            code="context_length_exceeded",
        )
    if requested is None:
        if default is None:
            return max_model_len - prompt_tokens
        return min(default, max_model_len - prompt_tokens)
    if prompt_tokens + requested > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, "
            f"{requested} for the completion). Please reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


def tokenize_text(engine: EngineAPI, text: str) -> list[int]:
    """Token ids of ``text`` as the engine would tokenize it."""
    return [int(t) for t in engine.tokenize(text)]


def apply_chat_template(
    tokenizer: Tokenizer | None, messages: list[dict[str, Any]], **options: Any
) -> list[int]:
    """Token ids of the rendered conversation (:func:`render_chat_text` with ``options``, then
    :func:`encode_rendered`: the engine's own path); a model without a template or a template
    error is a 400, a template past its sandbox's bounds a 400, a sandbox with no slot a 429
    (this key's) or 503 (every process's)."""
    return encode_rendered(tokenizer, render_text(tokenizer, messages, **options))


def render_text(tokenizer: Tokenizer | None, messages: list[dict[str, Any]], **options: Any) -> str:
    """:func:`~radixkv.engine.chat_template.render_chat_text`, its errors as HTTP errors (see
    :func:`apply_chat_template`)."""
    try:
        return render_chat_text(tokenizer, messages, **options)
    except TemplateBusyError as exc:
        code = "key_limit" if exc.status == 429 else "template_busy"
        kind = "rate_limit_error" if exc.status == 429 else "server_error"
        raise APIError(exc.status, str(exc), type=kind, param="chat_template", code=code) from exc
    except TemplateLimitError as exc:
        raise APIError(400, str(exc), param="chat_template", code="template_limit") from exc
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from exc


MAX_CHARS_PER_TOKEN = 32
"""Text longer than this many characters per token of the context (``max_model_len``) is
refused before tokenizing: it cannot fit, and tokenizing it would hold the tokenizer lock the
engine thread needs (tokens of this tokenizer are rarely over 16 characters)."""


def check_text_length(engine: EngineAPI, num_chars: int, param: str) -> None:
    """Refuse (400, naming the bound) text too long to fit the context, before tokenizing."""
    max_model_len = int(engine.max_model_len or 0)
    if max_model_len and num_chars > MAX_CHARS_PER_TOKEN * max_model_len:
        raise APIError(
            400,
            f"{param} has {num_chars} characters; this model's context holds {max_model_len} "
            f"tokens, and text over {MAX_CHARS_PER_TOKEN} characters a token of context is "
            "refused before tokenizing. Please shorten it.",
            param=param,
            code="context_length_exceeded",
        )


async def prompt_token_ids(
    engine: EngineAPI, prompt: str | list[int], param: str = "prompt"
) -> list[int]:
    """The prompt as token ids, tokenized once per request and off the event loop (a thread of
    its own; the engine's tokenizer is locked for this), so the engine never tokenizes it again.
    Text too long to fit the context is refused first (:func:`check_text_length`)."""
    if isinstance(prompt, list):
        return prompt
    check_text_length(engine, len(prompt), param)
    return await asyncio.to_thread(tokenize_text, engine, prompt)


def conversation_chars(messages: list[dict[str, Any]], extra: Any = None) -> int:
    """Characters of everything a chat template may render: every field of every message
    (``content``, ``tool_calls``, ``name``, extra fields) and ``extra`` (the template's keyword
    arguments, the tools), as JSON."""
    return len(json.dumps([messages, extra], ensure_ascii=False, default=str))


async def chat_token_ids(
    engine: EngineAPI, messages: list[dict[str, Any]], **options: Any
) -> list[int]:
    """The conversation's token ids as the chat endpoint renders it: the length check of all it
    holds (:func:`conversation_chars`, :func:`check_text_length`), the template rendered off the
    event loop and off the tokenizer lock (:func:`render_text`; a request's own template in the
    sandbox ``options`` names), the length check of the rendered text, then the text tokenized.
    ``options``: ``render_chat_text``'s; the template defaults to the engine's
    ``chat_template`` (``--chat-template``), else the model's."""
    extra = [options.get("chat_template_kwargs"), options.get("tools")]
    check_text_length(engine, conversation_chars(messages, extra), "messages")
    tokenizer = engine.tokenizer
    options.setdefault("chat_template", engine.chat_template)
    text = await asyncio.to_thread(render_text, tokenizer, messages, **options)
    check_text_length(engine, len(text), "messages")  # the template may have multiplied it
    return await asyncio.to_thread(encode_rendered, tokenizer, text)


def make_sampling_params(kwargs: dict[str, Any]) -> SamplingParams:
    """Build the engine's ``SamplingParams``; a bad value becomes a 400 naming the field."""
    from radixkv.engine.sampling import SamplingParams

    try:
        return SamplingParams(**kwargs).validate()
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc), param=named_field(exc)) from exc


def named_field(exc: BaseException) -> str | None:
    """The request field an engine validation error names: a
    :class:`~radixkv.engine.errors.ParamError`'s ``field``; None for any other error (an empty
    prompt, a prompt over the context, an unknown keyword: the message says what is wrong)."""
    return exc.field if isinstance(exc, ParamError) else None


def new_id(prefix: str) -> str:
    """An OpenAI-style object id (``cmpl-…``, ``chatcmpl-…``)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """OpenAI's ``created`` timestamp."""
    return int(time.time())


FinishReason = Literal["stop", "length", "abort"]


def usage_dict(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    cached_by_tier: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """OpenAI ``usage`` with ``prompt_tokens_details.cached_tokens`` (plus per-tier detail)."""
    details: dict[str, Any] = {"cached_tokens": cached_tokens}
    if cached_by_tier:
        details["cached_tokens_by_tier"] = dict(cached_by_tier)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": details,
    }
