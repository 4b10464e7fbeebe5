"""The router's Prometheus metrics (:class:`RouterMetrics`), labelled by replica URL: what
``/metrics`` and ``/router/stats`` of ``radixkv router`` (:mod:`.router`) report."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

__all__ = ["RouterMetrics"]


class RouterMetrics:
    """The router's Prometheus metrics, labelled by replica URL: ``registry`` (load and health,
    what ``public_metrics`` shows) and ``detail`` (prefix-match and key-length counters: what
    the prompts were like, admin only)."""

    def __init__(self, replicas: Sequence[str]) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.detail = d = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "radixkv_router_requests", "Requests sent to a replica.", ["replica"], registry=r
        )
        self.match_chars = Counter(
            "radixkv_router_prefix_match_chars",
            "Routing-key units (characters, or token ids for id prompts) the router's tree "
            "already held for the replica a request went to (2xx answers only).",
            ["replica"],
            registry=d,
        )
        self.key_chars = Counter(
            "radixkv_router_request_chars",
            "Routing-key units of the requests a replica answered 2xx.",
            ["replica"],
            registry=d,
        )
        self.errors = Counter(
            "radixkv_router_replica_errors",
            "Failed attempts on a replica (unreachable, dropped, 503, broken stream).",
            ["replica"],
            registry=r,
        )
        self.retries = Counter(
            "radixkv_router_retries", "Requests retried on another replica.", registry=r
        )
        self.in_flight = Gauge(
            "radixkv_router_in_flight", "Requests in flight per replica.", ["replica"], registry=r
        )
        self.healthy = Gauge(
            "radixkv_router_replica_healthy",
            "1 while a replica is healthy.",
            ["replica"],
            registry=r,
        )
        for url in replicas:
            for m in (self.requests, self.match_chars, self.key_chars, self.errors):
                m.labels(replica=url)
            self.in_flight.labels(replica=url)
            self.healthy.labels(replica=url).set(1)

    def render(self, detail: bool = True) -> bytes:
        out = generate_latest(self.registry)
        return out + generate_latest(self.detail) if detail else out
