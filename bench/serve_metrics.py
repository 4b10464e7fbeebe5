"""Metrics and the text report of the serving benchmark (vLLM's / SGLang's field names)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.serve_client import RequestResult

__all__ = ["ARRAY_KEYS", "METRIC_KEYS", "compute_metrics", "print_report", "sent_trace"]

#: Every summary field of the JSON report (vLLM / SGLang names + cache fields).
METRIC_KEYS = (
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "input_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p90_ttft_ms",
    "p99_ttft_ms",
    "std_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p90_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p90_itl_ms",
    "p99_itl_ms",
    "mean_e2e_latency_ms",
    "median_e2e_latency_ms",
    "p99_e2e_latency_ms",
    "cache_hit_rate",
    "total_cached_tokens",
)

#: Per-request arrays of the JSON report (index i = i-th request in send order).
ARRAY_KEYS = (
    "ttfts",
    "itls",
    "e2e_latencies",
    "start_times",
    "prompt_tokens",
    "cached_tokens",
    "output_lens",
    "errors",
)


def _stats(values: Sequence[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0, "std": 0.0}
    a = np.asarray(values, dtype=np.float64) * scale
    return {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "std": float(a.std()),
    }


def compute_metrics(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """Summary metrics (:data:`METRIC_KEYS`) and per-request arrays (:data:`ARRAY_KEYS`)."""
    ok = [r for r in results if r.success]
    tin = sum(r.prompt_tokens for r in ok)
    tout = sum(r.output_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ttft = _stats([r.ttft for r in ok])
    tpot = _stats([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1])
    itl = _stats([x for r in ok for x in r.itls])
    e2e = _stats([r.latency for r in ok])
    d = duration if duration > 0 else float("nan")
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": tin,
        "total_output_tokens": tout,
        "request_throughput": len(ok) / d,
        "input_throughput": tin / d,
        "output_throughput": tout / d,
        "total_token_throughput": (tin + tout) / d,
    }
    for name, s in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        for k in ("mean", "median", "p90", "p99"):
            out[f"{k}_{name}_ms"] = s[k]
    out["std_ttft_ms"] = ttft["std"]
    out["mean_e2e_latency_ms"] = e2e["mean"]
    out["median_e2e_latency_ms"] = e2e["median"]
    out["p90_e2e_latency_ms"] = e2e["p90"]
    out["p99_e2e_latency_ms"] = e2e["p99"]
    out["cache_hit_rate"] = cached / tin if tin else 0.0
    out["total_cached_tokens"] = cached
    out["ttfts"] = [r.ttft for r in results]
    out["itls"] = [r.itls for r in results]
    out["e2e_latencies"] = [r.latency for r in results]
    out["start_times"] = [r.start_time for r in results]
    out["prompt_tokens"] = [r.prompt_tokens for r in results]
    out["cached_tokens"] = [r.cached_tokens for r in results]
    out["output_lens"] = [r.output_tokens for r in results]
    out["errors"] = [r.error for r in results]
    return out


def sent_trace(results: list[RequestResult]) -> list[dict[str, Any]]:
    """The requests as actually sent, in send order, as a :mod:`radixkv.sim.workloads` trace.

    Chat prompts become their message contents joined by spaces (approximate: the server's chat
    template is not known here). ``output_text`` is the real answer for multi-turn replays.
    """
    trace: list[dict[str, Any]] = []
    for i, r in enumerate(results):
        p = r.prompt
        if p is None:
            continue
        req: dict[str, Any] = {"id": i, "output_len": r.output_len}
        if isinstance(p, list) and p and isinstance(p[0], dict):
            req["text"] = " ".join(str(m.get("content", "")) for m in p)
        elif isinstance(p, list):
            req["input_ids"] = p
        else:
            req["text"] = p
        if r.generated_text:
            req["output_text"] = r.generated_text
        if r.salt is not None:
            req["salt"] = r.salt
        trace.append(req)
    return trace


def print_report(report: dict[str, Any], file: Any = None) -> None:
    """Print the summary table (vLLM's layout)."""
    out = file or sys.stdout
    cfg = report.get("config", {})
    w = 50

    def line(label: str, value: Any) -> None:
        if isinstance(value, float):
            print(f"{label:<40}{value:>10.2f}", file=out)
        else:
            print(f"{label:<40}{value!s:>10}", file=out)

    print(" Serving Benchmark Result ".center(w, "="), file=out)
    line("Workload:", cfg.get("workload", "?"))
    line("Successful requests:", report["completed"])
    line("Failed requests:", report["failed"])
    line("Benchmark duration (s):", report["duration"])
    line("Total input tokens:", report["total_input_tokens"])
    line("Total cached tokens:", report["total_cached_tokens"])
    line("Cache hit rate (%):", 100.0 * report["cache_hit_rate"])
    line("Total generated tokens:", report["total_output_tokens"])
    line("Request throughput (req/s):", report["request_throughput"])
    line("Input token throughput (tok/s):", report["input_throughput"])
    line("Output token throughput (tok/s):", report["output_throughput"])
    line("Total token throughput (tok/s):", report["total_token_throughput"])
    for title, key in (
        ("Time to First Token", "ttft"),
        ("Time per Output Token (excl. 1st token)", "tpot"),
        ("Inter-token Latency", "itl"),
    ):
        print(f" {title} ".center(w, "-"), file=out)
        for stat in ("mean", "median", "p90", "p99"):
            line(f"{stat.capitalize()} {key.upper()} (ms):", report[f"{stat}_{key}_ms"])
    print(" End-to-end Latency ".center(w, "-"), file=out)
    for stat in ("mean", "median", "p99"):
        line(f"{stat.capitalize()} E2E Latency (ms):", report[f"{stat}_e2e_latency_ms"])
    print("=" * w, file=out)
    errors = [e for e in report.get("errors", []) if e]
    if errors:
        print(f"first error: {errors[0]}", file=out)
