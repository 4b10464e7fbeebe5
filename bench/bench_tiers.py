"""TTFT of a 512-token prefix served from each cache tier, on the real model, in one run.

One engine (SmolLM2-135M by default) with a host tier and a disk tier. Every measurement is a
request ``system prefix (512 tokens) + a fresh question (~16 tokens)`` with ``max_tokens=1``, so
TTFT = the prefill of whatever is not served from cache, plus one sampled token. The prefix is
put in the wanted tier before each request:

* ``recompute``: nothing cached (device and host flushed, disk files removed);
* ``device``: the prefix is in the device tree (a previous request computed it);
* ``host``: device-evicted, so it lives in host pages (write-back) and is loaded back;
* ``disk``: then host-evicted, so it lives in files only (writes finished) and is read back;
* ``remote`` (with ``--remote``: a local ``redis-server`` started for the run, the pages written
  through to it): device and host flushed, disk files removed, so it is read from Redis only
  (loopback: what a replica on the same machine pays; over a network add the transfer time).

Cases are interleaved (each repetition runs all four) because the machine is shared; the table
reports medians and the ratios to recompute. Targets: host <= 1/3, disk <= 1/2 of recompute.

Usage (from the repo root)::

    .venv/bin/python bench/bench_tiers.py                 # SmolLM2, 5 repetitions
    .venv/bin/python bench/bench_tiers.py --repeats 3 --json
    .venv/bin/python bench/bench_tiers.py --remote          # also from a local Redis
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from radixkv import Engine, SamplingParams  # noqa: E402

CASES = ("recompute", "device", "host", "disk")

TEXT = (
    "You are a careful assistant for a library that lends books, music and films. Answer "
    "questions about opening hours, loans, renewals, reservations, fines, inter-library loans, "
    "digital lending, study rooms, printing, accessibility services and events. Be concise, "
    "cite the relevant rule, and never invent a policy. "
)


def make_prefix(engine: Engine, length: int) -> list[int]:
    """Exactly ``length`` tokens of a plausible system prompt."""
    ids: list[int] = []
    i = 0
    while len(ids) < length:
        ids += engine.tokenize(f"Rule {i}. " + TEXT)
        i += 1
    return ids[:length]


def question(engine: Engine, n: int) -> list[int]:
    return engine.tokenize(f" Question {n}: may I renew item number {1000 + 37 * n} twice?")


def place(engine: Engine, prefix: list[int], case: str, n: int, redis_url: str | None) -> None:
    """Put ``prefix`` in the tier of ``case`` (it was cached on the device by the caller)."""
    tiers = engine.tiers
    assert tiers is not None
    if case in ("recompute", "remote"):
        engine.flush_cache()  # waits for queued writes: Redis has the prefix
        tiers.clear_disk()
        if case == "recompute" and redis_url:  # not in Redis either
            import redis as redis_lib

            redis_lib.Redis.from_url(redis_url).flushdb()
        return
    if case == "device":
        return
    engine.tree.evict(engine.tree.evictable_size)  # device -> host (write-back)
    if case == "disk":
        engine.tree.evict_host(engine.tree.host_size)  # host -> disk
        tiers.sync()


def ttft(engine: Engine, prompt: list[int]) -> tuple[float, dict[str, int]]:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    (out,) = engine.generate([prompt], params)
    wall = time.perf_counter() - t0
    return (out.ttft if out.ttft is not None else wall), dict(out.cached_tokens_by_tier)


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = tempfile.TemporaryDirectory(prefix="radixkv-bench-tiers-")
    knobs: dict[str, Any] = dict(
        page_size=args.page_size,
        kv_cache_tokens=8192,
        host_cache_tokens=8192,
        disk_cache_dir=tmp.name,
    )
    if args.dtype:
        knobs["dtype"] = args.dtype
    redis = None
    cases = CASES + (("remote",) if args.remote else ())
    if args.remote:
        from radixkv.server.cluster import Cluster

        redis = Cluster(replicas=0, remote_cache=True).start()  # Redis alone
        knobs.update(remote_cache_url=redis.redis_url, kv_mac_key_file=redis.kv_mac_key_file)
    engine = Engine(args.model, **knobs)
    prefix = make_prefix(engine, args.prefix_tokens)
    times: dict[str, list[float]] = {c: [] for c in cases}
    tiers_seen: dict[str, dict[str, int]] = {}
    n = 0
    # warm-up: one recompute and one hit of each kind, not measured
    for rep in range(args.repeats + 1):
        for case in cases:
            engine.flush_cache()
            engine.tiers.clear_disk()  # type: ignore[union-attr]
            n += 1
            ttft(engine, prefix + question(engine, n))  # compute the prefix on the device
            place(engine, prefix, case, n, redis.redis_url if redis is not None else None)
            n += 1
            t, by_tier = ttft(engine, prefix + question(engine, n))
            engine.check_integrity()
            if rep:
                times[case].append(t)
                tiers_seen[case] = by_tier
    engine.tiers.close()  # type: ignore[union-attr]
    tmp.cleanup()
    if redis is not None:
        redis.stop()
    med = {c: statistics.median(times[c]) for c in cases}
    base = med["recompute"]
    return {
        "model": engine.model_name,
        "dtype": str(engine.runner.dtype),
        "prefix_tokens": args.prefix_tokens,
        "page_size": args.page_size,
        "repeats": args.repeats,
        "ttft_s": med,
        "ratio_to_recompute": {c: med[c] / base for c in cases},
        "cached_by_tier": tiers_seen,
        "targets_met": {
            "host<=1/3": med["host"] <= base / 3,
            "disk<=1/2": med["disk"] <= base / 2,
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prefix-tokens", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: the machine's)")
    ap.add_argument("--remote", action="store_true", help="also serve it from a local Redis")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    res = run(args)
    if args.json:
        print(json.dumps(res))
        return 0
    print(
        f"{res['model']} ({res['dtype']}), {res['prefix_tokens']}-token prefix, "
        f"page {res['page_size']}, median of {res['repeats']}"
    )
    print(f"{'served from':<12} {'TTFT ms':>9} {'x recompute':>12}  cached tokens by tier")
    for c in res["ttft_s"]:
        print(
            f"{c:<12} {res['ttft_s'][c] * 1e3:>9.1f} {res['ratio_to_recompute'][c]:>12.3f}  "
            f"{res['cached_by_tier'].get(c)}"
        )
    for k, ok in res["targets_met"].items():
        print(f"target {k}: {'met' if ok else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
