"""vLLM's and SGLang's metric names for what they share with radixkv's own, so their dashboards
work unchanged against radixkv.

:class:`PeerMetricNames` is a Prometheus collector over :class:`~.metrics.ServerMetrics`: at
scrape time it renames radixkv's samples (no second bookkeeping) and adds a ``model_name``
label. What maps to what:

======================================  ==============================================
vLLM / SGLang                           radixkv
======================================  ==============================================
``vllm:prompt_tokens_total``,           ``radixkv_prompt_tokens_total``
``sglang:prompt_tokens_total``
``vllm:generation_tokens_total``,       ``radixkv_generation_tokens_total``
``sglang:generation_tokens_total``
``vllm:prefix_cache_queries_total``     ``radixkv_prompt_tokens_total`` (tokens looked up)
``vllm:prefix_cache_hits_total``,       ``radixkv_cached_tokens_total``
``sglang:cached_tokens_total``
``vllm:request_success_total``          ``radixkv_requests_total`` (``finished_reason``)
``vllm:num_requests_running`` /         ``radixkv_num_requests_running`` / ``_waiting``
``_waiting``, ``sglang:num_running_reqs``
/ ``sglang:num_queue_reqs``
``vllm:kv_cache_usage_perc``,           ``(radixkv_kv_pages_used - radixkv_kv_pages_evictable)
``sglang:token_usage``                  / radixkv_kv_pages_total`` (a fraction, 1 = full;
                                        cached pages no request holds are free, as in vLLM)
``vllm:num_preemptions_total``          ``radixkv_num_preemptions_total``
``sglang:cache_hit_rate``               ``radixkv_cache_hit_rate``
``{vllm,sglang}:time_to_first_token_seconds``, ``:inter_token_latency_seconds``,
``:e2e_request_latency_seconds``        the ``radixkv_`` histograms of the same names (vLLM's
                                        buckets)
``vllm:time_per_output_token_seconds``  ``radixkv_inter_token_latency_seconds``
``vllm:request_{queue,prefill,decode,   ``radixkv_request_{queue,prefill,decode,inference}_time_seconds``
inference}_time_seconds``               (the scheduler's first admission splits queue from prefill)
``vllm:request_time_per_output_token_   ``radixkv_request_time_per_output_token_seconds``
seconds``
``vllm:request_prompt_tokens``,         ``radixkv_request_prompt_tokens``, ``_generation_tokens``,
``_generation_tokens``, ``_params_n``,  ``radixkv_request_params_n``, ``_params_max_tokens``
``_params_max_tokens``
======================================  ==============================================
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

__all__ = ["PeerMetricNames"]


class PeerMetricNames(Collector):
    """Collector of the ``vllm:*`` and ``sglang:*`` names (see the module docstring)."""

    def __init__(self, metrics: Any) -> None:
        """``metrics``: the :class:`~.metrics.ServerMetrics` whose series are renamed (not
        imported here: metrics.py registers this collector)."""
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.m
        renames = [
            (m.prompt_tokens, ("vllm:prompt_tokens", "sglang:prompt_tokens")),
            (m.prompt_tokens, ("vllm:prefix_cache_queries",)),
            (m.generation_tokens, ("vllm:generation_tokens", "sglang:generation_tokens")),
            (m.cached_tokens, ("vllm:prefix_cache_hits", "sglang:cached_tokens")),
            (m.requests, ("vllm:request_success",)),
            (m.running, ("vllm:num_requests_running", "sglang:num_running_reqs")),
            (m.waiting, ("vllm:num_requests_waiting", "sglang:num_queue_reqs")),
            (m.hit_rate, ("sglang:cache_hit_rate",)),
            (m.ttft, ("vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds")),
            (
                m.itl,
                (
                    "vllm:inter_token_latency_seconds",
                    "vllm:time_per_output_token_seconds",
                    "sglang:inter_token_latency_seconds",
                ),
            ),
            (m.e2e, ("vllm:e2e_request_latency_seconds", "sglang:e2e_request_latency_seconds")),
            (m.preemptions, ("vllm:num_preemptions",)),
            *((h, (f"vllm:request_{name}_time_seconds",)) for name, h in m.phase.items()),
            (m.request_tpot, ("vllm:request_time_per_output_token_seconds",)),
            (m.request_prompt_tokens, ("vllm:request_prompt_tokens",)),
            (m.request_generation_tokens, ("vllm:request_generation_tokens",)),
            (m.request_max_tokens, ("vllm:request_params_max_tokens",)),
            (m.request_n, ("vllm:request_params_n",)),
        ]
        for source, names in renames:
            for family in source.collect():
                for name in names:
                    yield self._renamed(family, name)
        used, total = _value(m.pages_used), _value(m.pages_total)
        busy = max(0.0, used - _value(m.pages_evictable))
        usage = busy / total if total else 0.0
        for name in ("vllm:kv_cache_usage_perc", "sglang:token_usage"):
            family = Metric(
                name,
                "KV pages held by requests / KV pages in the pool (1 = full); cached pages that "
                "no request holds count as free, as vLLM and SGLang count them "
                "(radixkv_kv_pages_cached has those).",
                "gauge",
            )
            family.add_sample(name, {"model_name": m.model_name}, usage)
            yield family

    def _renamed(self, family: Metric, name: str) -> Metric:
        out = Metric(name, family.documentation, family.type)
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue  # radixkv's own series carry the creation times
            suffix = sample.name[len(family.name) :]
            labels = {**sample.labels, "model_name": self.m.model_name}
            if "finish_reason" in labels:  # vLLM's label name
                labels["finished_reason"] = labels.pop("finish_reason")
            out.add_sample(name + suffix, labels, sample.value, sample.timestamp, sample.exemplar)
        return out


def _value(gauge: object) -> float:
    for family in gauge.collect():  # type: ignore[attr-defined]
        for sample in family.samples:
            return float(sample.value)
    return 0.0
