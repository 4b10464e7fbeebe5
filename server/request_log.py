"""One in-flight request as the engine thread tracks it (:class:`TrackedRequest`, from its
acceptance to its last sequence's end: latencies, token counts, finish reasons), and the log line
vLLM's ``--enable-log-requests`` writes when it finishes (:func:`log_finished`): ids, counts and
latencies, never the request's text."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .request_stream import RequestStream

__all__ = ["TrackedRequest", "log_finished"]

logger = logging.getLogger("radixkv.server.engine_loop")


@dataclass
class TrackedRequest:
    """Engine-thread bookkeeping of one in-flight request."""

    stream: RequestStream
    n: int
    arrival: float
    owner: str | None = None
    first_token_at: float | None = None
    last_token_at: dict[int, float] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    prompt_recorded: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated: int = 0
    reasons: list[str] = field(default_factory=list)
    max_tokens: int | None = None
    #: the engine's phase times (seconds), from the first output that carries them
    queue_time: float | None = None
    prefill_time: float | None = None


def log_finished(request_id: str, tracked: TrackedRequest, now: float) -> None:
    """The INFO line of a finished request (logger ``radixkv.server.engine_loop``)."""
    first = tracked.first_token_at
    ttft = "-" if first is None else f"{first - tracked.arrival:.3f}"
    logger.info(
        "request %s finished (%s): prompt %d tokens (%d cached), %d generated, "
        "TTFT %s s, end to end %.3f s%s",
        request_id,
        ",".join(sorted(set(tracked.reasons))),
        tracked.prompt_tokens,
        tracked.cached_tokens,
        tracked.generated,
        ttft,
        now - tracked.arrival,
        f", key {tracked.owner}" if tracked.owner is not None else "",
    )
