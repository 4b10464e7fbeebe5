"""The asyncio side of one engine request (:class:`RequestStream`) and the errors the engine
loop answers with (:class:`QueueFullError` 503, :class:`OwnerLimitError` 429,
:class:`EngineRequestError` with its own status)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixkv.engine.request import StepOutput

__all__ = ["EngineRequestError", "OwnerLimitError", "QueueFullError", "RequestStream"]


class QueueFullError(Exception):
    """The bounded waiting queue is full (answered 503)."""


class OwnerLimitError(QueueFullError):
    """One owner (API key) has its limit of waiting requests (answered 429)."""


class EngineRequestError(Exception):
    """A request failed inside the engine or the loop (answered with ``status_code``)."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message


@dataclass
class StreamFailure:
    """Put in a request's queue instead of a ``StepOutput`` when the request failed."""

    status_code: int
    message: str


@dataclass
class RequestStream:
    """The asyncio side of one engine request: its outputs arrive in ``queue``.

    Iterate :meth:`outputs` to get ``StepOutput`` objects until every one of the ``n`` sequences
    has finished; a failure raises :class:`EngineRequestError`.
    """

    request_id: str
    n: int
    arrival: float
    queue: asyncio.Queue[StepOutput | StreamFailure] = field(default_factory=asyncio.Queue)
    finished_indices: set[int] = field(default_factory=set)
    failed: bool = False

    @property
    def finished(self) -> bool:
        """True once every sequence finished (or the request failed)."""
        return self.failed or len(self.finished_indices) >= self.n

    async def outputs(self) -> AsyncIterator[StepOutput]:
        """Yield the request's ``StepOutput``s in order, ending after the last sequence ends."""
        while not self.finished:
            item = await self.queue.get()
            if isinstance(item, StreamFailure):
                self.failed = True
                raise EngineRequestError(item.status_code, item.message)
            if item.finished:
                self.finished_indices.add(int(item.index or 0))
            yield item
