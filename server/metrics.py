"""Prometheus metrics of the server.

Each app gets its own :class:`~prometheus_client.CollectorRegistry` (so several servers can live
in one process, as in the tests). Per-request metrics (token counters, TTFT, inter-token latency,
end-to-end latency) are updated by the engine thread from ``StepOutput``s; the cache and queue
gauges are refreshed from ``engine.stats()`` at scrape time. The same series are also exposed
under vLLM's and SGLang's names (:mod:`.peer_metrics`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

if TYPE_CHECKING:
    from .request_log import TrackedRequest

CACHE_SOURCES = ("device", "host", "disk", "remote")
"""Tiers a cached prompt token can come from (``cached_tokens_by_tier`` keys)."""

# vLLM's buckets (vllm/v1/metrics/loggers.py), so its dashboards' quantiles read the same
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's ``build_1_2_5_buckets``)."""
    out: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return tuple(out)
            out.append(value)
        exponent += 1


class ServerMetrics:
    """The server's metrics, in a registry of their own."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str = "", max_model_len: int = 8192) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # Plain totals of record_prompt for the dashboard's time series (stats_history).
        self.requests_seen = 0
        self.requests_hit = 0
        self.prompt_tokens_seen = 0
        self.cached_tokens_seen = 0
        self.cached_by_tier_seen: dict[str, int] = {}
        self.generated_tokens_seen = 0  # plain total of generation_tokens (engine thread)
        r = self.registry
        self.model_name = model_name
        self.prompt_tokens = Counter(
            "radixkv_prompt_tokens", "Prompt tokens of finished-prefill requests.", registry=r
        )
        self.generation_tokens = Counter(
            "radixkv_generation_tokens", "Tokens generated.", registry=r
        )
        self.cached_tokens = Counter(
            "radixkv_cached_tokens",
            "Prompt tokens served from the prefix cache (any tier).",
            registry=r,
        )
        self.cached_tokens_by_source = Counter(
            "radixkv_cached_tokens_by_source",
            "Prompt tokens served from the prefix cache, by the tier they came from.",
            ["source"],
            registry=r,
        )
        for source in CACHE_SOURCES:
            self.cached_tokens_by_source.labels(source=source)
        self.requests = Counter(
            "radixkv_requests",
            "Sequences that ended, by finish reason (stop|length|abort|error).",
            ["finish_reason"],
            registry=r,
        )
        self.engine_errors = Counter(
            "radixkv_engine_step_errors",
            "Exceptions raised by engine.step() (the affected requests failed with 500).",
            registry=r,
        )
        self.rejected = Counter(
            "radixkv_requests_rejected",
            "Requests refused before reaching the engine, by reason.",
            ["reason"],
            registry=r,
        )
        self.hit_rate = Gauge(
            "radixkv_cache_hit_rate",
            "Cached prompt tokens / prompt tokens since start (engine.stats()).",
            registry=r,
        )
        self.running = Gauge("radixkv_num_requests_running", "Running requests.", registry=r)
        self.waiting = Gauge("radixkv_num_requests_waiting", "Waiting requests.", registry=r)
        self.pages_total = Gauge("radixkv_kv_pages_total", "KV pages in the pool.", registry=r)
        self.pages_used = Gauge("radixkv_kv_pages_used", "KV pages in use.", registry=r)
        self.pages_cached = Gauge(
            "radixkv_kv_pages_cached", "KV pages held by the prefix cache.", registry=r
        )
        self.pages_free = Gauge("radixkv_kv_pages_free", "Free KV pages.", registry=r)
        self.pages_evictable = Gauge(
            "radixkv_kv_pages_evictable",
            "Cached KV pages that no running request holds (evicted when a request needs them).",
            registry=r,
        )
        self.preemptions = Counter(
            "radixkv_num_preemptions", "Requests preempted (recomputed later).", registry=r
        )
        self._preemptions_seen = 0
        self.kv_bytes_per_token = Gauge(
            "radixkv_kv_bytes_per_token",
            "Bytes of K and V one token takes in the pool over all layers, in its KV dtype "
            "(int8 / fp8 pages count their scales).",
            registry=r,
        )
        self.remote_up = Gauge(
            "radixkv_remote_cache_up",
            "1 while the shared remote KV tier (Redis) answers; 0 while it is off or when "
            "there is no remote tier.",
            registry=r,
        )
        self.remote_pages = Gauge(
            "radixkv_remote_cache_pages",
            "Remote tier page counts since start, by event "
            "(written, hit, miss, corrupt, write_failed, went_down).",
            ["event"],
            registry=r,
        )
        self.ttft = Histogram(
            "radixkv_time_to_first_token_seconds",
            "From request arrival to its first generated token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "radixkv_inter_token_latency_seconds",
            "Between two consecutive outputs of one sequence.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "radixkv_e2e_request_latency_seconds",
            "From request arrival to its last token.",
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        phases = {  # a finished request's phases, as vLLM splits them (engine timestamps)
            "queue": "From arrival to the scheduler's first admission (WAITING).",
            "prefill": "From the first admission to the first token (PREFILL).",
            "decode": "From the first token to the last (DECODE).",
            "inference": "From the first admission to the last token (RUNNING).",
        }
        self.phase = {
            name: Histogram(
                f"radixkv_request_{name}_time_seconds", doc, buckets=REQUEST_LATENCY_BUCKETS,
                registry=r,
            )
            for name, doc in phases.items()
        }  # fmt: skip
        self.request_tpot = Histogram(
            "radixkv_request_time_per_output_token_seconds",
            "A finished request's decode time over its generated tokens after the first.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        lengths = buckets_1_2_5(max(1, int(max_model_len)))
        self.request_prompt_tokens = Histogram(
            "radixkv_request_prompt_tokens", "A finished request's prompt tokens.",
            buckets=lengths, registry=r,
        )  # fmt: skip
        self.request_generation_tokens = Histogram(
            "radixkv_request_generation_tokens",
            "A finished request's generated tokens (all its sequences).",
            buckets=lengths, registry=r,
        )  # fmt: skip
        self.request_max_tokens = Histogram(
            "radixkv_request_params_max_tokens", "A finished request's max_tokens.",
            buckets=lengths, registry=r,
        )  # fmt: skip
        self.request_n = Histogram(
            "radixkv_request_params_n", "A finished request's n.", buckets=N_BUCKETS, registry=r
        )
        from .peer_metrics import PeerMetricNames

        r.register(PeerMetricNames(self))  # vllm:* and sglang:* names of the same series

    def record_generated(self, tokens: int) -> None:
        """Count ``tokens`` generated (engine thread)."""
        self.generated_tokens_seen += tokens
        self.generation_tokens.inc(tokens)

    def record_prompt(
        self, prompt_tokens: int, cached_tokens: int, by_tier: Mapping[str, int] | None
    ) -> None:
        """Count one request's prompt and cache hit (called once per request)."""
        self.requests_seen += 1
        self.requests_hit += cached_tokens > 0
        self.prompt_tokens_seen += max(0, prompt_tokens)
        self.cached_tokens_seen += max(0, cached_tokens)
        for source, count in (by_tier or {}).items():
            if count > 0:
                self.cached_by_tier_seen[source] = self.cached_by_tier_seen.get(source, 0) + count
        self.prompt_tokens.inc(max(0, prompt_tokens))
        self.cached_tokens.inc(max(0, cached_tokens))
        for source, count in (by_tier or {}).items():
            if count > 0:
                self.cached_tokens_by_source.labels(source=source).inc(count)

    def record_token(self, tracked: TrackedRequest, index: int, now: float) -> None:
        """Sequence ``index`` of ``tracked`` produced tokens at ``now``: TTFT on the request's
        first, the gap since that sequence's last otherwise (engine thread)."""
        if tracked.first_token_at is None:
            tracked.first_token_at = now
            self.ttft.observe(now - tracked.arrival)
        last = tracked.last_token_at.get(index)
        if last is not None:
            self.itl.observe(now - last)
        tracked.last_token_at[index] = now

    def record_finished(self, tracked: TrackedRequest, now: float) -> None:
        """Every sequence of ``tracked`` has ended at ``now``: its end-to-end latency, its
        phases (vLLM's queue / prefill / decode / inference split; those it never reached are
        not observed), its lengths and parameters."""
        self.e2e.observe(now - tracked.arrival)
        if tracked.queue_time is not None:
            self.phase["queue"].observe(tracked.queue_time)
        first = tracked.first_token_at
        if tracked.prefill_time is not None and first is not None:
            decode = max(0.0, now - first)
            self.phase["prefill"].observe(tracked.prefill_time)
            self.phase["decode"].observe(decode)
            self.phase["inference"].observe(tracked.prefill_time + decode)
            if tracked.generated > tracked.n:
                self.request_tpot.observe(decode / (tracked.generated - tracked.n))
        self.request_prompt_tokens.observe(tracked.prompt_tokens)
        self.request_generation_tokens.observe(tracked.generated)
        self.request_n.observe(tracked.n)
        if tracked.max_tokens is not None:
            self.request_max_tokens.observe(tracked.max_tokens)

    def update_from_stats(self, stats: Mapping[str, Any]) -> None:
        """Refresh the gauges from ``engine.stats()``."""
        gauges = {
            "running": self.running,
            "waiting": self.waiting,
            "pages_total": self.pages_total,
            "pages_used": self.pages_used,
            "pages_cached": self.pages_cached,
            "pages_free": self.pages_free,
            "pages_evictable": self.pages_evictable,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "hit_rate": self.hit_rate,
        }
        for key, gauge in gauges.items():
            value = stats.get(key)
            if isinstance(value, int | float):
                gauge.set(value)
        preemptions = stats.get("preemptions_total")
        if isinstance(preemptions, int) and preemptions > self._preemptions_seen:
            self.preemptions.inc(preemptions - self._preemptions_seen)
            self._preemptions_seen = preemptions
        remote = (stats.get("tiers") or {}).get("remote")
        if isinstance(remote, Mapping):
            self.remote_up.set(1 if remote.get("available") else 0)
            events = {
                "written": "writes",
                "hit": "hits",
                "miss": "misses",
                "corrupt": "corrupt_values",
                "write_failed": "writes_failed",
                "went_down": "went_down",
            }
            for event, key in events.items():
                self.remote_pages.labels(event=event).set(int(remote.get(key, 0)))

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
