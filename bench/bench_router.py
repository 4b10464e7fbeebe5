"""Cache-aware routing vs round robin vs one replica, on a multi-group shared-prefix workload.

The workload is SGLang's ``generated-shared-prefix`` shape scaled to this machine: ``--groups``
system prompts (~``--system-tokens`` tokens each) x ``--questions`` questions, prompt = system +
"\\n\\n" + question, shuffled (seeded), ``--max-tokens`` generated per request, sent by
``--concurrency`` clients through the OpenAI ``/v1/completions`` API.

One run starts two ``radixkv serve`` replicas (``radixkv.server.cluster.Cluster``: each pinned
to its own CPUs, no remote tier unless ``--remote-cache``) and measures, flushing every cache
between cases:

* ``one_replica``: every request to replica 0 (its CPUs only): the single-server hit rate, the
  optimum a router can reach (every group's system prompt computed once);
* ``cache_aware``: the router (in this process) over both replicas;
* ``round_robin``: the same router with the round-robin policy.

Hit rate = cached prompt tokens / prompt tokens, from the replicas' ``usage``. Throughput is
requests/s and generated tokens/s over the wall time of the case. Targets: cache_aware's hit rate
>= 95% of one_replica's and above round robin's (without ``--remote-cache``: with it, round
robin's misses are served from Redis, which is what the shared tier is for). Each replica gets half the CPUs, so on a
2-core host "two replicas" is two single-core servers against one single-core server.

Usage (from the repo root; time it under the shared lock)::

    flock /tmp/radixkv-bench.lock .venv/bin/python bench/bench_router.py
    .venv/bin/python bench/bench_router.py --groups 8 --questions 16 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from radixkv.server.cluster import Cluster, free_port, wait_healthy  # noqa: E402

CASES = ("one_replica", "cache_aware", "round_robin")

_WORDS = [
    "library",
    "loans",
    "renewals",
    "reservations",
    "fines",
    "catalogue",
    "archive",
    "periodicals",
    "manuscripts",
    "maps",
    "records",
    "lending",
    "desk",
    "opening",
    "hours",
    "study",
    "rooms",
    "printing",
    "scanning",
    "accessibility",
    "events",
    "membership",
    "cards",
    "children",
    "section",
    "reference",
    "shelves",
    "returns",
    "overdue",
    "notices",
    "holds",
]


def system_prompt(g: int, tokens: int) -> str:
    """A distinct system prompt of roughly ``tokens`` tokens (~4 characters a token)."""
    rnd = random.Random(1000 + g)
    words = [f"You are assistant {g} of branch {g * 7 + 3}."]
    while sum(len(w) + 1 for w in words) < 4 * tokens:
        words.append(rnd.choice(_WORDS))
    return " ".join(words)


def workload(groups: int, questions: int, tokens: int, seed: int = 0) -> list[str]:
    systems = [system_prompt(g, tokens) for g in range(groups)]
    rnd = random.Random(seed)
    prompts = [
        f"{systems[g]}\n\nQuestion {q}: what about {rnd.choice(_WORDS)} and "
        f"{rnd.choice(_WORDS)} on day {rnd.randint(1, 28)}?"
        for g in range(groups)
        for q in range(questions)
    ]
    rnd.shuffle(prompts)
    return prompts


class _RouterThread:
    """The router app on a free loopback port in a uvicorn thread."""

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


async def _drive(base: str, model: str, prompts: list[str], max_tokens: int, conc: int):
    sem = asyncio.Semaphore(conc)
    out: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=conc + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def one(p: str) -> None:
            async with sem:
                r = await client.post(
                    base + "/v1/completions",
                    json={
                        "model": model,
                        "prompt": p,
                        "max_tokens": max_tokens,
                        "temperature": 0.0,
                        "ignore_eos": True,
                    },
                )
                r.raise_for_status()
                usage = r.json()["usage"]
                details = usage.get("prompt_tokens_details") or {}
                out.append(
                    {
                        "prompt": usage["prompt_tokens"],
                        "cached": details.get("cached_tokens", 0),
                        "remote": (details.get("cached_tokens_by_tier") or {}).get("remote", 0),
                        "completion": usage["completion_tokens"],
                        "replica": r.headers.get("x-radixkv-replica"),
                    }
                )

        await asyncio.gather(*(one(p) for p in prompts))
    return out


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
    _flush(urls, redis_url)
    t0 = time.perf_counter()
    if case == "one_replica":
        rows = asyncio.run(_drive(urls[0], model, prompts, args.max_tokens, args.concurrency))
    else:
        with _RouterThread(urls, case) as rt:
            rows = asyncio.run(_drive(rt.url, model, prompts, args.max_tokens, args.concurrency))
    wall = time.perf_counter() - t0
    prompt = sum(r["prompt"] for r in rows)
    cached = sum(r["cached"] for r in rows)
    per_replica: dict[str, int] = {}
    for r in rows:
        per_replica[r["replica"] or urls[0]] = per_replica.get(r["replica"] or urls[0], 0) + 1
    return {
        "case": case,
        "requests": len(rows),
        "seconds": wall,
        "requests_per_s": len(rows) / wall,
        "output_tokens_per_s": sum(r["completion"] for r in rows) / wall,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "remote_hit_rate": sum(r["remote"] for r in rows) / prompt if prompt else 0.0,
        "requests_per_replica": per_replica,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
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
        help="the cases in the order they run (default one_replica,cache_aware,round_robin); "
        "the machine is shared, so a second run in another order shows how much is noise",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--log-dir", default=None, help="replica logs (default: discarded)")
    args = p.parse_args(argv)

    order = [c.strip() for c in args.order.split(",") if c.strip()]
    if sorted(order) != sorted(CASES):
        p.error(f"--order must list each of {', '.join(CASES)} once")
    prompts = workload(args.groups, args.questions, args.system_tokens, args.seed)
    serve_args = ["--log-level", "warning"]
    cluster = Cluster(
        2,
        model=args.model,
        serve_args=serve_args,
        remote_cache=args.remote_cache,
        log_dir=args.log_dir,
    )
    t_start = time.perf_counter()
    with cluster:
        model = httpx.get(cluster.urls[0] + "/v1/models").json()["data"][0]["id"]
        # warm both replicas (first-use costs: kernels, allocator) outside the measurement
        for u in cluster.urls:
            asyncio.run(_drive(u, model, ["warm up " * 20], 2, 1))
        results = [
            run_case(c, cluster.urls, model, prompts, args, cluster.redis_url) for c in order
        ]
    total = time.perf_counter() - t_start
    by = {r["case"]: r for r in results}
    one = by["one_replica"]["hit_rate"]
    verdict = {
        "cache_aware_vs_one_replica_hit": by["cache_aware"]["hit_rate"] / one if one else 0.0,
        "cache_aware_hit>=0.95x_one_replica": by["cache_aware"]["hit_rate"] >= 0.95 * one,
        "cache_aware_hit>round_robin": by["cache_aware"]["hit_rate"]
        > by["round_robin"]["hit_rate"],
        "cache_aware_vs_round_robin_throughput": by["cache_aware"]["requests_per_s"]
        / by["round_robin"]["requests_per_s"],
    }
    report = {
        "workload": {
            "groups": args.groups,
            "questions": args.questions,
            "system_tokens": args.system_tokens,
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
            "remote_cache": args.remote_cache,
        },
        "replica_cores": cluster.core_groups,
        "results": results,
        "verdict": verdict,
        "total_seconds": total,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    w = report["workload"]
    print(
        f"{w['groups']} system prompts x {w['questions']} questions, ~{w['system_tokens']}-token "
        f"systems, {w['max_tokens']} output tokens, concurrency {w['concurrency']}, replica "
        f"cores {cluster.core_groups}, remote cache {'on' if args.remote_cache else 'off'}"
    )
    print(
        f"{'case':<12} {'hit_rate':>8} {'(remote)':>8} {'req/s':>7} {'out tok/s':>9} "
        f"{'secs':>6}  per replica"
    )
    for r in results:
        print(
            f"{r['case']:<12} {r['hit_rate']:>8.3f} {r['remote_hit_rate']:>8.3f} "
            f"{r['requests_per_s']:>7.2f} "
            f"{r['output_tokens_per_s']:>9.1f} {r['seconds']:>6.1f}  "
            f"{sorted(r['requests_per_replica'].values())}"
        )
    for k, v in verdict.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    print(f"total {total:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
