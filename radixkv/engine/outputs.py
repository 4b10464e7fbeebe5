"""What the engine reports: one :class:`StepOutput` per sequence per step, one
:class:`RequestOutput` per finished request (offline API), and the ``stats()`` dict the server's
``/cache/stats`` and ``/metrics`` read. Pure assembly from sequence and engine state; changes
nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from radixkv.engine.request import CompletionOutput, RequestOutput, Sequence, StepOutput, now

if TYPE_CHECKING:
    from radixkv.cache.allocator import BlockAllocator
    from radixkv.cache.radix_tree import RadixTree
    from radixkv.engine.request import PositionLogprobs, Prompt
    from radixkv.engine.scheduler import Scheduler

__all__ = [
    "engine_stats",
    "prefill_time",
    "queue_time",
    "request_output",
    "step_output",
    "with_prompt_logprobs",
]


def step_output(
    seq: Sequence, tokens: list[int], delta: str, logprobs: list[PositionLogprobs] | None
) -> StepOutput:
    """What ``seq`` produced this step: ``tokens`` (0 or 1), their text ``delta``, logprobs."""
    return StepOutput(
        request_id=seq.request_id,
        index=seq.index,
        new_token_ids=tokens,
        new_text=delta,
        finished=seq.is_finished,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        prompt_tokens=len(seq.prompt_ids),
        cached_tokens=seq.cached_tokens or 0,
        cached_tokens_by_tier=dict(seq.cached_by_tier),
        logprobs=logprobs,
        queue_time=queue_time(seq),
        prefill_time=prefill_time(seq),
    )


def queue_time(seq: Sequence) -> float | None:
    """Seconds ``seq`` waited before its first admission (None while it waits)."""
    return None if seq.scheduled_time is None else max(0.0, seq.scheduled_time - seq.arrival)


def prefill_time(seq: Sequence) -> float | None:
    """Seconds from ``seq``'s first admission to its first token (None before either)."""
    if seq.scheduled_time is None or seq.first_token_time is None:
        return None
    return max(0.0, seq.first_token_time - seq.scheduled_time)


def with_prompt_logprobs(out: StepOutput, seq: Sequence) -> StepOutput:
    """``out`` with, on ``seq``'s first token, the prompt's logprobs when they were asked."""
    if seq.prompt_logprobs is not None and len(seq.output_ids) == 1:
        out.prompt_logprobs = list(seq.prompt_logprobs)
    return out


def cumulative_logprob(seq: Sequence) -> float | None:
    """The sum of ``seq``'s sampled tokens' logprobs (vLLM's), None without ``logprobs``."""
    if seq.params.logprobs is None:
        return None
    return float(sum(d[t].logprob for t, d in zip(seq.output_ids, seq.output_logprobs)))


def request_output(request_id: str, prompt: Prompt, group: list[Sequence]) -> RequestOutput:
    """The whole answer of a finished request; ``group`` holds its ``n`` sequences."""
    group = sorted(group, key=lambda s: s.index)
    head = group[0]
    return RequestOutput(
        request_id=request_id,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=head.prompt_ids,
        outputs=[
            CompletionOutput(
                index=s.index,
                token_ids=s.output_ids,
                text=s.detok.text,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                logprobs=list(s.output_logprobs) if s.params.logprobs is not None else None,
                cumulative_logprob=cumulative_logprob(s),
            )
            for s in group
        ],
        cached_tokens=head.cached_tokens or 0,
        cached_tokens_by_tier=dict(head.cached_by_tier),
        ttft=(head.first_token_time - head.arrival) if head.first_token_time else None,
        latency=now() - head.arrival,
        prompt_logprobs=head.prompt_logprobs,
    )


class StatsSource(Protocol):
    """What :func:`engine_stats` reads (the engine has these)."""

    model_name: str
    page_size: int
    counters: dict[str, int]
    cached_by_tier: dict[str, int]
    allocator: BlockAllocator
    tree: RadixTree
    scheduler: Scheduler
    tiers: Any
    runner: Any


def _kv_format(runner: Any) -> dict[str, Any]:
    """The pool's KV dtype (``auto``: the model's, named) and its bytes per token, scales
    included, so capacity reads in tokens for the chosen KV dtype."""
    pool = getattr(runner, "pool", None)
    if pool is None:
        return {}
    kind = getattr(runner, "kv_cache_dtype", "auto")
    return {
        "kv_cache_dtype": str(pool.dtype).removeprefix("torch.") if kind == "auto" else kind,
        "kv_bytes_per_token": pool.bytes_per_page // pool.page_size,
        "kv_pool_bytes": pool.total_bytes,
    }


def engine_stats(engine: StatsSource) -> dict[str, Any]:
    """Queue lengths, page occupancy, cache sizes and the running totals of ``engine``."""
    alloc, tree = engine.allocator, engine.tree
    cached_pages = tree.total_size // engine.page_size
    c = engine.counters
    out: dict[str, Any] = {
        "model": engine.model_name,
        "running": len(engine.scheduler.running),
        "waiting": len(engine.scheduler.waiting),
        "page_size": engine.page_size,
        **_kv_format(engine.runner),
        "pages_total": alloc.num_pages,
        "pages_used": alloc.num_used,
        "pages_cached": cached_pages,
        "pages_free": alloc.num_free,
        # cached pages nothing running holds: free for admission (eviction), as vLLM counts them
        "pages_evictable": tree.evictable_size // engine.page_size,
        "cache_evictable_tokens": tree.evictable_size,
        "cache_protected_tokens": tree.protected_size,
        "requests_total": c["requests"],
        "prompt_tokens_total": c["prompt_tokens"],
        "cached_tokens_total": c["cached_tokens"],
        "generated_tokens_total": c["generated_tokens"],
        "cached_tokens_by_tier": dict(engine.cached_by_tier),
        "hit_rate": c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0,
        # of cached_tokens_total: taken from a sibling's prefill in the step it ran
        "borrowed_tokens_total": engine.scheduler.num_borrowed_tokens,
        "preemptions_total": engine.scheduler.num_preemptions,
        "steps_total": c["steps"],
    }
    if engine.tiers is not None:
        out["tiers"] = engine.tiers.stats()
    return out
