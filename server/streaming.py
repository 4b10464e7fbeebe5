"""What every route family shares to answer a request: SSE framing, client-disconnect handling,
and the accumulation of a request's outputs (one :class:`Seq` per sequence of ``n``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from .intake import usage_dict

if TYPE_CHECKING:
    from radixkv.engine.request import StepOutput

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


class ClientDisconnected(Exception):
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


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
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
    raise ClientDisconnected


@dataclass
class Seq:
    """What one sequence (one of ``n``) produced so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    #: per token, its ``{token_id: Logprob}`` (the top-K, then the token itself)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_role: bool = False


@dataclass
class Collected:
    """A whole request's outputs (non-streaming answers)."""

    seqs: list[Seq]
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    prompt_logprobs: list[Any] | None = None  # None at position 0, then dicts as above

    def update_meta(self, out: StepOutput) -> None:
        self.prompt_tokens = max(self.prompt_tokens, int(out.prompt_tokens or 0))
        self.cached_tokens = max(self.cached_tokens, int(out.cached_tokens or 0))
        for tier, count in (out.cached_tokens_by_tier or {}).items():
            self.cached_by_tier[tier] = max(self.cached_by_tier.get(tier, 0), int(count))

    def add(self, out: StepOutput) -> Seq:
        self.update_meta(out)
        seq = self.seqs[int(out.index or 0)]
        seq.text += out.new_text or ""
        seq.token_ids.extend(out.new_token_ids or ())
        if out.logprobs:
            seq.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            seq.finish_reason = out.finish_reason
            seq.stop_reason = out.stop_reason
        return seq

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    def usage(self) -> dict[str, Any]:
        return usage_dict(
            self.prompt_tokens, self.completion_tokens, self.cached_tokens, self.cached_by_tier
        )
