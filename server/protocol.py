"""Request/response models of the HTTP API and the checks that turn them into engine calls.

Three request shapes are accepted:

* OpenAI ``/v1/completions`` (:class:`CompletionRequest`) and ``/v1/chat/completions``
  (:class:`ChatCompletionRequest`), with vLLM's extra sampling fields;
* SGLang ``/generate`` (:class:`GenerateRequest`) whose ``sampling_params`` dict uses vLLM names.

Field-level checks (types, ranges) live in the pydantic models, so FastAPI reports them as
validation errors that :mod:`radixkv.server.app` turns into OpenAI-shaped 400 answers naming the
field. Checks that need the engine (context length, tokenization, the chat template) live in
:mod:`radixkv.server.intake`.
Responses are plain dicts built by the app: they follow OpenAI's JSON shapes exactly, and
building them as dicts keeps the streaming path cheap.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .protocol_fields import (
    ChatTemplateFields,
    GenerateLogitsFields,
    LogitsFields,
    SGLangAccepted,
)
from .structured_fields import ChatToolFields, GenerateStructuredFields, StructuredFields

MAX_N = 16
"""Largest ``n`` (parallel samples of one prompt) a request may ask for."""
MAX_LOGPROBS = 20
"""Largest top-logprobs count accepted (OpenAI's own limit)."""
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: Most choices (prompts x n) one completions request may ask for.
MAX_PROMPTS = 256
"""OpenAI's default ``max_tokens`` for ``/v1/completions``."""
DEFAULT_GENERATE_MAX_NEW_TOKENS = 128
"""SGLang's default ``max_new_tokens`` for ``/generate``."""


class APIError(Exception):
    """An error answered to the client in OpenAI's shape ``{"error": {...}}``."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body of the error answer."""
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str,
    *,
    type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
    param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# --------------------------------------------------------------------------------------------
# Text that can be encoded: JSON may carry lone surrogates ("\\ud800"), which no tokenizer,
# salt hash or UTF-8 response can take
# --------------------------------------------------------------------------------------------


def _find_bad_text(value: Any, path: str) -> str | None:
    """The path of the first string under ``value`` that is not valid Unicode, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = ascii(value[exc.start : exc.end])
            return f"{path or 'body'} is not valid Unicode text (lone surrogate {bad})"
        return None
    if isinstance(value, Mapping):
        for key, item in value.items():
            found = _find_bad_text(key, path) or _find_bad_text(
                item, f"{path}.{key}" if path else str(key)
            )
            if found:
                return found
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            if isinstance(item, int | float | bool) or item is None:
                continue
            found = _find_bad_text(item, f"{path}[{i}]")
            if found:
                return found
    return None


class RequestBody(BaseModel):
    """Base of the request bodies: every string in the body must be valid Unicode (400 if not),
    so no tokenizer, cache-salt hash or UTF-8 answer meets a lone surrogate later."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        found = _find_bad_text(data, "")
        if found:
            raise ValueError(found)
        return data


# --------------------------------------------------------------------------------------------
# Sampling fields shared by every endpoint
# --------------------------------------------------------------------------------------------


class SamplingFields(RequestBody, LogitsFields):
    """Sampling knobs with vLLM's names and OpenAI's ranges.

    ``None`` means "the default": OpenAI's defaults for the OpenAI endpoints, SGLang's for
    ``/generate``. Unknown fields are ignored (OpenAI clients send e.g. ``user``).
    """

    model_config = ConfigDict(extra="ignore")

    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    # beam search and prompt logprobs (vLLM's extra fields)
    use_beam_search: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    length_penalty: float = Field(1.0, ge=-100.0, le=100.0)
    early_stopping: bool | Literal["never"] = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @field_validator("best_of")
    @classmethod
    def _best_of_covers_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if value is not None and value < n:
            raise ValueError(f"best_of ({value}) must be >= n ({n})")
        if value is not None and value > n and not info.data.get("use_beam_search"):
            raise ValueError("best_of > n is supported with use_beam_search only")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k_not_zero(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 16:
            raise ValueError("at most 16 stop sequences are supported")
        return value

    def stop_list(self) -> list[str] | None:
        """``stop`` as a list of non-empty strings (or None)."""
        if self.stop is None:
            return None
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        stops = [s for s in stops if s]
        return stops or None

    def engine_kwargs(
        self, *, max_tokens: int, default_temperature: float, logprobs: int | None
    ) -> dict[str, Any]:
        """Keyword arguments for ``SamplingParams`` (vLLM names)."""
        kwargs: dict[str, Any] = {
            "n": self.n,
            "max_tokens": max_tokens,
            "temperature": default_temperature if self.temperature is None else self.temperature,
            "ignore_eos": self.ignore_eos,
            "seed": self.seed,
            "stop": self.stop_list(),
            "stop_token_ids": list(self.stop_token_ids) if self.stop_token_ids else None,
            "logprobs": logprobs,
            "prompt_logprobs": self.prompt_logprobs,
            "use_beam_search": self.use_beam_search,
            "best_of": self.best_of,
            "length_penalty": self.length_penalty,
            "early_stopping": self.early_stopping,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            **self.logits_kwargs(),
        }
        for name in (
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
        ):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        return kwargs


def _check_beam_stream(stream: bool, use_beam_search: bool) -> bool:
    if stream and use_beam_search:
        raise ValueError(
            "streaming is not supported with use_beam_search (beams are reranked until the end)"
        )
    return stream


class StreamOptions(BaseModel):
    """OpenAI ``stream_options``."""

    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class OpenAIAccepted(BaseModel):
    """OpenAI fields taken and without effect here: nothing is stored (``store`` must not be
    true), there is one service tier, ``user`` and ``metadata`` are labels. Any other field
    radixkv does not implement is a 400 naming it (``extra="forbid"``), never ignored."""

    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default"] | None = None
    store: Literal[False] | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(SamplingFields, OpenAIAccepted, SGLangAccepted, StructuredFields):
    """``POST /v1/completions``."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 8},
                {"model": "smollm2", "prompt": [72, 101, 108], "max_tokens": 4, "n": 2},
                {"model": "smollm2", "prompt": "Hi", "max_tokens": 4, "stream": True},
            ]
        },
    )

    model: str | None = None  # optional, as in vLLM: the served model
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0: the prompt alone, with echo (vLLM)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    cache_salt: str | None = None

    @field_validator("stream")
    @classmethod
    def _no_beam_stream(cls, value: bool, info: ValidationInfo) -> bool:
        return _check_beam_stream(value, info.data.get("use_beam_search", False))

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one (a string or token ids), or several (a list of strings or
        of token-id lists), at most :data:`MAX_PROMPTS`; a 400 for ``max_tokens: 0`` without
        ``echo`` (nothing to answer)."""
        if self.max_tokens == 0 and (not self.echo or self.use_beam_search):
            raise APIError(
                400,
                "max_tokens may be 0 only with echo=true (the prompt alone), without beam search",
                param="max_tokens",
            )
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) * self.n > MAX_PROMPTS:
                raise APIError(
                    400,
                    f"{len(prompt)} prompts x n={self.n} choices is over the {MAX_PROMPTS} "
                    "choices one request may ask for; split the batch",
                    param="prompt",
                )
            return list(prompt)
        return [prompt]  # type: ignore[list-item]


class ChatMessage(BaseModel):
    """One chat message; ``content`` may be a string or a list of ``{"type": "text"}`` parts."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template expects it (content flattened to text)."""
        content = self.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type", "text") != "text":
                    raise APIError(
                        400,
                        f"message content part of type {part.get('type')!r} is not supported; "
                        "only text parts are",
                        param="messages",
                    )
                parts.append(str(part.get("text", "")))
            content = "".join(parts)
        out = dict(self.model_extra or {})
        out.update({"role": self.role, "content": content or ""})
        return out


class ChatCompletionRequest(
    SamplingFields,
    OpenAIAccepted,
    SGLangAccepted,
    StructuredFields,
    ChatToolFields,
    ChatTemplateFields,
):
    """``POST /v1/chat/completions``."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "model": "smollm2",
                    "messages": [{"role": "user", "content": "Hello!"}],
                    "max_tokens": 8,
                    "cache_salt": "tenant-a",
                },
                {
                    "model": "smollm2",
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_completion_tokens": 4,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            ]
        },
    )

    model: str | None = None  # optional, as in vLLM: the served model
    messages: list[ChatMessage]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    cache_salt: str | None = None

    @field_validator("stream")
    @classmethod
    def _no_beam_stream(cls, value: bool, info: ValidationInfo) -> bool:
        return _check_beam_stream(value, info.data.get("use_beam_search", False))

    @field_validator("messages")
    @classmethod
    def _messages_not_empty(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("messages must contain at least one message")
        return value

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (new name) or ``max_tokens`` (deprecated name)."""
        return self.max_completion_tokens if self.max_completion_tokens else self.max_tokens


class GenerateSamplingParams(SamplingFields, GenerateStructuredFields, GenerateLogitsFields):
    """``sampling_params`` of ``/generate``: ``max_new_tokens`` (SGLang) or ``max_tokens``."""

    max_new_tokens: int | None = Field(None, ge=1)

    def requested_max_tokens(self) -> int:
        """The token budget, with SGLang's default."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        if self.max_tokens is not None:
            return self.max_tokens
        return DEFAULT_GENERATE_MAX_NEW_TOKENS


class GenerateRequest(RequestBody):
    """``POST /generate`` (SGLang's native shape)."""

    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "examples": [
                {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8}},
                {"input_ids": [72, 101, 108], "sampling_params": {"max_new_tokens": 4, "n": 2}},
            ]
        },
    )

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: bool = False
    salt: str | None = None
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=MAX_LOGPROBS)
    logprob_start_len: int = Field(-1, ge=-1)
    return_text_in_logprobs: bool = False

    @field_validator("stream")
    @classmethod
    def _no_beam_stream(cls, value: bool, info: ValidationInfo) -> bool:
        sp = info.data.get("sampling_params")
        return _check_beam_stream(value, sp is not None and sp.use_beam_search)

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of `text` or `input_ids`")
        return self

    def prompt(self) -> str | list[int]:
        """The prompt as given."""
        return self.text if self.text is not None else list(self.input_ids or [])


class UnpinRequest(RequestBody):
    """``POST /cache/unpin``: remove the pins on a prompt's cached path."""

    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"examples": [{"text": "You are a helpful assistant."}]}
    )

    text: str | None = None
    input_ids: list[int] | None = None
    salt: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> Self:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of `text` or `input_ids`")
        return self


class PinRequest(UnpinRequest):
    """``POST /cache/pin``: keep a cached prefix from eviction (``ttl`` seconds, or the server's
    maximum pin ttl)."""

    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "examples": [{"text": "You are a helpful assistant.", "ttl": 60.0, "salt": "t1"}]
        },
    )

    ttl: float | None = Field(None, gt=0)
