"""Prometheus metrics of the server.

Each app gets its own :class:`~prometheus_client.CollectorRegistry` (so several servers can live
in one process, as in the tests). Per-request metrics (token counters, TTFT, inter-token latency,
end-to-end latency) are updated by the engine thread from ``StepOutput``s; the cache and queue
gauges are refreshed from ``engine.stats()`` at scrape time. The same series are also exposed
under vLLM's and SGLang's names (:mod:`.peer_metrics`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

CACHE_SOURCES = ("device", "host", "disk", "remote")
"""Tiers a cached prompt token can come from (``cached_tokens_by_tier`` keys)."""

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class ServerMetrics:
    """The server's metrics, in a registry of their own."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str = "") -> None:
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
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "radixkv_inter_token_latency_seconds",
            "Between two consecutive outputs of one sequence.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "radixkv_e2e_request_latency_seconds",
            "From request arrival to its last token.",
            buckets=_E2E_BUCKETS,
            registry=r,
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
