"""One replica vs radixkv's router vs sgl-router (cache-aware and round robin), on a
multi-group shared-prefix workload.

The workload is SGLang's ``generated-shared-prefix`` shape scaled to this machine: ``--groups``
system prompts (~``--system-tokens`` tokens each) x ``--questions`` questions, prompt = system +
"\\n\\n" + question, shuffled (seeded), ``--max-tokens`` generated per request, sent by
``--concurrency`` clients as streaming OpenAI ``/v1/completions`` requests
(``bench/router_workload.py``).

For each replica count in ``--replicas`` (``2``, ``4`` or ``2,4``), one run starts that many
``radixkv serve`` replicas (``radixkv.server.cluster.Cluster``: each pinned to its share of the
CPUs; with fewer CPUs than replicas, replicas share CPUs, and the header says so; no remote tier
unless ``--remote-cache``) and measures, flushing every cache (and Redis) between cases:

* ``one_replica``: every request to replica 0 (its CPUs only): the single-server hit rate, the
  optimum a router can reach (every group's system prompt computed once);
* ``cache_aware`` / ``round_robin``: ``radixkv router`` (in this process) over all replicas;
* ``sgl_cache_aware`` / ``sgl_round_robin``: sgl-router (PyPI ``sglang-router``, a child
  process: ``radixkv.server.sgl_router_launch``) over the same replicas.

Per case: hit rate = cached prompt tokens / prompt tokens (the replicas' own counters,
``/cache/stats``, before and after the case: the same for both routers), that rate over
one_replica's, TTFT p50/p99 (to the first streamed chunk carrying a token), requests/s and
output tokens/s over the case's wall time (routers started before the clock starts). Targets:
cache-aware hit rate >= 95% of one_replica's; without ``--remote-cache`` above round robin's;
with it, round robin >= 90% of one_replica's (its misses are served from Redis).

``--model tiny`` runs the tiny random Llama (``bench/tiny_model.py``, fp32, torch attention)
for a smoke test of the harness: its figures are not a result.

Usage (from the repo root; time it under the shared lock)::

    flock /tmp/radixkv-bench.lock .venv/bin/python bench/bench_router.py --replicas 2,4
    flock /tmp/radixkv-bench.lock .venv/bin/python bench/bench_router.py --replicas 2,4 \\
        --remote-cache
    .venv/bin/python bench/bench_router.py --model tiny --groups 2 --questions 4 --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from bench.router_workload import (  # noqa: E402
    drive,
    host_isa,
    percentile,
    replica_counters,
    workload,
)
from radixkv.server.cluster import Cluster, free_port, wait_healthy  # noqa: E402

CASES = ("one_replica", "cache_aware", "round_robin", "sgl_cache_aware", "sgl_round_robin")
TINY_SERVE_ARGS = ["--dtype", "float32", "--attention-backend", "torch"]


class _RouterThread:
    """radixkv's router app on a free loopback port in a uvicorn thread."""

    def __init__(self, urls: list[str], policy: str) -> None:
        import uvicorn

        from radixkv.server.router import create_router_app

        self.port = free_port()
        app = create_router_app(urls, policy, health_interval=1.0)
        cfg = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> _RouterThread:
        self.thread.start()
        wait_healthy(self.url, None, 30)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class _Direct:
    """No router: every request to one replica."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self) -> _Direct:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _front(case: str, urls: list[str], log_dir: str | None) -> Any:
    if case == "one_replica":
        return _Direct(urls[0])
    if case.startswith("sgl_"):
        from radixkv.server.sgl_router_launch import SglRouter

        return SglRouter(urls, free_port(), case[4:], log_dir=log_dir)
    return _RouterThread(urls, case)


def _flush(urls: list[str], redis_url: str | None) -> None:
    """Empty every replica's cache (and the shared Redis): each case starts cold."""
    if redis_url is not None:
        import redis

        redis.Redis.from_url(redis_url).flushdb()
    for u in urls:
        for _ in range(50):
            if httpx.post(u + "/flush_cache", timeout=30).status_code == 200:
                break
            time.sleep(0.2)


def run_case(
    case: str, urls: list[str], model: str, prompts: list[str], args, redis_url: str | None
) -> dict[str, Any]:
    """One case, cold: flush, start its front (router or none), drive the workload."""
    with _front(case, urls, args.log_dir) as front:
        _flush(urls, redis_url)
        before = replica_counters(urls)
        t0 = time.perf_counter()
        rows = drive(front.url, model, prompts, args.max_tokens, args.concurrency)
        wall = time.perf_counter() - t0
        after = replica_counters(urls)
    done = {u: {k: after[u][k] - before[u][k] for k in after[u]} for u in urls}
    prompt = sum(d["prompt"] for d in done.values())
    cached = sum(d["cached"] for d in done.values())
    ttfts = [r["ttft"] for r in rows]
    usage = [r["usage"] for r in rows if r["usage"]]
    return {
        "case": case,
        "requests": len(rows),
        "seconds": wall,
        "requests_per_s": len(rows) / wall,
        "output_tokens_per_s": sum(u.get("completion_tokens", 0) for u in usage) / wall,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "remote_hit_rate": sum(d["remote"] for d in done.values()) / prompt if prompt else 0.0,
        "requests_per_replica": [done[u]["requests"] for u in urls],
        "streams_with_usage": len(usage),
    }


def verdict(by: dict[str, dict[str, Any]], remote_cache: bool) -> dict[str, Any]:
    """The targets, for the cases that ran (hit rates relative to one_replica's)."""
    one = by["one_replica"]["hit_rate"]
    rel = {c: (r["hit_rate"] / one if one else 0.0) for c, r in by.items()}
    out: dict[str, Any] = {}
    for prefix in ("", "sgl_"):
        ca, rr = by.get(prefix + "cache_aware"), by.get(prefix + "round_robin")
        if ca is not None:
            out[f"{prefix}cache_aware_hit>=0.95x_one_replica"] = rel[prefix + "cache_aware"] >= 0.95
        if rr is not None and remote_cache:
            out[f"{prefix}round_robin_hit>=0.90x_one_replica"] = rel[prefix + "round_robin"] >= 0.90
        if ca is not None and rr is not None and not remote_cache:
            out[f"{prefix}cache_aware_hit>round_robin"] = ca["hit_rate"] > rr["hit_rate"]
    return out


def run_config(n: int, args, prompts: list[str], model_path: str, serve_args: list[str]):
    """Every case in ``args.order`` over ``n`` replicas; the report of that configuration."""
    cores = sorted(os.sched_getaffinity(0))
    cluster = Cluster(
        n,
        model=model_path,
        serve_args=serve_args,
        remote_cache=args.remote_cache,
        log_dir=os.path.join(args.log_dir, f"replicas{n}") if args.log_dir else None,
    )
    t_start = time.perf_counter()
    with cluster:
        model = httpx.get(cluster.urls[0] + "/v1/models").json()["data"][0]["id"]
        # first-use costs (kernels, allocator) outside the measurement
        for u in cluster.urls:
            drive(u, model, ["warm up " * 20], 2, 1)
        results = [
            run_case(c, cluster.urls, model, prompts, args, cluster.redis_url) for c in args.order
        ]
    by = {r["case"]: r for r in results}
    one = by["one_replica"]["hit_rate"]
    for r in results:
        r["hit_rate_vs_one_replica"] = r["hit_rate"] / one if one else 0.0
    return {
        "replicas": n,
        "cores": cores,
        "replica_cores": cluster.core_groups,
        "shared_cores": len(cores) < n,
        "results": results,
        "verdict": verdict(by, args.remote_cache),
        "seconds": time.perf_counter() - t_start,
    }


def print_config(cfg: dict[str, Any], remote_cache: bool) -> None:
    n, cores = cfg["replicas"], cfg["cores"]
    share = (
        f"{n} replicas on {len(cores)} cores: replicas share cores"
        if cfg["shared_cores"]
        else f"{n} replicas on {len(cores)} cores"
    )
    print(
        f"\n== {share}, replica cores {cfg['replica_cores']} (one_replica: replica 0's), "
        f"remote cache {'on' if remote_cache else 'off'}"
    )
    print(
        f"{'case':<16} {'hit':>6} {'/one':>6} {'remote':>6} {'ttft p50':>9} {'ttft p99':>9} "
        f"{'req/s':>7} {'tok/s':>7} {'secs':>6}  per replica"
    )
    for r in cfg["results"]:
        print(
            f"{r['case']:<16} {r['hit_rate']:>6.3f} {r['hit_rate_vs_one_replica']:>6.3f} "
            f"{r['remote_hit_rate']:>6.3f} {r['ttft_p50_s'] * 1e3:>7.0f}ms "
            f"{r['ttft_p99_s'] * 1e3:>7.0f}ms {r['requests_per_s']:>7.2f} "
            f"{r['output_tokens_per_s']:>7.1f} {r['seconds']:>6.1f}  {r['requests_per_replica']}"
        )
    for k, v in cfg["verdict"].items():
        print(f"target {k}: {'met' if v else 'MISSED'}")
    print(f"({cfg['seconds']:.0f} s with start-up)")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2 (default), a path, or tiny")
    p.add_argument("--replicas", default="2", help="replica counts, comma-separated: 2, 4, 2,4")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--questions", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--remote-cache", action="store_true", help="replicas share a Redis tier")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--order",
        default=",".join(CASES),
        help="the cases in the order they run (default: all, "
        f"{','.join(CASES)}; one_replica is required, the others may be left out); the machine "
        "is shared, so a second run in another order shows how much is noise",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--log-dir", default=None, help="replica and router logs (default: discarded)")
    args = p.parse_args(argv)
    args.order = [c.strip() for c in args.order.split(",") if c.strip()]
    if "one_replica" not in args.order or len(set(args.order)) != len(args.order):
        p.error("--order must list one_replica, and each case at most once")
    if unknown := set(args.order) - set(CASES):
        p.error(f"unknown cases {sorted(unknown)}; choose from {', '.join(CASES)}")
    try:
        args.replicas = [int(x) for x in args.replicas.split(",") if x.strip()]
    except ValueError:
        p.error("--replicas takes integers, comma-separated")
    if not args.replicas or min(args.replicas) < 2:
        p.error("--replicas needs counts of at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    prompts = workload(args.groups, args.questions, args.system_tokens, args.seed)
    serve_args = ["--log-level", "warning"]
    with tempfile.TemporaryDirectory(prefix="radixkv-bench-router-") as tmp:
        model_path = args.model
        if args.model == "tiny":
            from bench.tiny_model import save_tiny_model_dir

            model_path = save_tiny_model_dir(
                os.path.join(tmp, "tiny"), max_position_embeddings=4096
            )
            serve_args += TINY_SERVE_ARGS
        t_start = time.perf_counter()
        configs = [run_config(n, args, prompts, model_path, serve_args) for n in args.replicas]
    report = {
        "host": host_isa(),
        "model": args.model,
        "workload": {
            "groups": args.groups,
            "questions": args.questions,
            "system_tokens": args.system_tokens,
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
            "remote_cache": args.remote_cache,
        },
        "configs": configs,
        "total_seconds": time.perf_counter() - t_start,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    w = report["workload"]
    print(f"host: {report['host']}; model {args.model}")
    print(
        f"{w['groups']} system prompts x {w['questions']} questions, ~{w['system_tokens']}-token "
        f"systems, {w['max_tokens']} output tokens, {w['concurrency']} streaming clients, "
        f"remote cache {'on' if args.remote_cache else 'off'}; hit = cached / prompt tokens "
        "(replica counters), /one = over one_replica's, TTFT to the first token chunk"
    )
    for cfg in configs:
        print_config(cfg, args.remote_cache)
    print(f"total {report['total_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
