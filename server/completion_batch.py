"""The pieces of ``/v1/completions`` that take several prompts in one request or echo the prompt
with its logprobs, as vLLM answers them (what evaluation harnesses send: ``echo: true,
logprobs: k, max_tokens: 0 or 1`` and ``prompt: [..]``).

* Several prompts are several engine requests, submitted together (so they share the cache as
  separate requests do); choice ``p * n + i`` is prompt ``p``'s ``i``-th (OpenAI's order), and
  ``usage`` is summed (:func:`summed_usage`). Streams are merged as their outputs come
  (:func:`merged`).
* ``echo`` with ``logprobs``: the choice's ``logprobs`` cover the prompt's tokens, then the
  output's (:func:`echo_logprobs`); the first prompt token has none (``null``), as vLLM gives it.
* ``max_tokens: 0`` (with ``echo`` only): the prompt alone. The engine runs one token, which is
  dropped: ``text`` is the prompt, ``completion_tokens`` 0, ``finish_reason`` ``"length"``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from .intake import usage_dict
from .logprob_format import Entry, TokenStr, completion_logprobs

__all__ = ["echo_logprobs", "merged", "summed_usage"]


def echo_logprobs(
    prompt_ids: Sequence[int],
    prompt_entries: Sequence[Entry | None] | None,
    output_ids: Sequence[int],
    output_entries: Sequence[Entry | None],
    k: int,
    token_str: TokenStr,
) -> dict[str, Any]:
    """OpenAI ``logprobs`` over the prompt then the output (offsets from the prompt's start)."""
    entries = list(prompt_entries or [None] * len(prompt_ids))
    entries += [None] * (len(prompt_ids) - len(entries))
    return completion_logprobs(
        [*prompt_ids, *output_ids], entries[: len(prompt_ids)] + list(output_entries), k,
        token_str, 0,
    )  # fmt: skip


def summed_usage(results: Sequence[Any], completion: bool = True) -> dict[str, Any]:
    """``usage`` of several prompts' results (:class:`~.streaming.Collected`), summed;
    ``completion`` False counts no completion tokens (``max_tokens: 0``)."""
    tiers: dict[str, int] = {}
    for r in results:
        for tier, count in r.cached_by_tier.items():
            tiers[tier] = tiers.get(tier, 0) + count
    return usage_dict(
        sum(r.prompt_tokens for r in results),
        sum(r.completion_tokens for r in results) if completion else 0,
        sum(r.cached_tokens for r in results),
        tiers,
    )


_DONE = object()


async def merged(streams: Sequence[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """``(i, item)`` from every ``streams[i]`` as items arrive; ends when all have ended, raises
    the first error of any (the others are then cancelled)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, raised there
            queue.put_nowait((i, _DONE, exc))
            return
        queue.put_nowait((i, _DONE, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    left = len(tasks)
    try:
        while left:
            i, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is _DONE:
                left -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
