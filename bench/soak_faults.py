"""The soak with faults: replicas with host, disk and Redis tiers behind the router, mixed
traffic, and faults injected while it runs (``python -m bench.soak --minutes 30 --faults``).

Set-up (:class:`SoakCluster`, a :class:`~radixkv.server.cluster.Cluster`): Redis with a
password, ``--replicas`` replicas (each on its share of the cores, a tiny device pool so pages
move between tiers all the time, a host tier, the remote tier written through, and one disk
directory shared by all of them on a small tmpfs when it can be mounted), and ``radixkv router``
(cache_aware) in front.

Traffic, through the router unless said: the plain soak's generation mix (chat, completions and
``/generate``; streams and not; ``n`` up to 3; a third of the streams dropped by the client;
clients that give up early), slow readers (a stream read with pauses), greedy *check* requests
(their answers are compared with the answers the same prompts got before any fault), and pins
churning on the replicas (pin with a short ttl, unpin).

Faults, in cycles over the run after the warm-up: Redis killed (SIGKILL, data lost) and
restarted; the disk tier's filesystem filled to the last byte, then freed; replica 1 killed and
restarted. Each fault has a window (from injection until the component is back); every request
is filed under a window its run overlapped (a slow reader may learn of a kill after the replica is
back), else under ``none``.

The report ends with one JSON line: requests, outcomes by kind, wrong answers, p50/p99, RSS
growth of the replica that is never killed and of the router after warm-up, leaked pages and
integrity of every replica at the end, and per fault what happened in its window. It passes
when there is no wrong answer, no unclear failure anywhere (a connection cut, a stream without
its end, a client timeout the client did not ask for), no failure at all outside the replica
kill windows, no leaked page, integrity holds and RSS growth stays under 10%.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any

import httpx

from bench.soak_measure import percentile, wait_idle
from bench.soak_traffic import FaultClock, Outcomes, Traffic, check_prompts, drive, greedy
from radixkv.server.cluster import Cluster, free_port, wait_healthy

__all__ = ["SoakCluster", "main_faults", "run_fault_soak"]

RSS_GROWTH_LIMIT_PCT = 10.0
#: characters the router remembers per replica (LRU beyond): its trees are the router's only
#: growing structure, and at the default (1M) a 30-minute run ends before they reach their bound.
#: At the soak's prompt lengths a tree grows ~55 characters per request inserted, so 16K fills
#: after ~300 requests, well inside the warm-up (~650 requests at ~6 req/s
#: for 108 s of a 12-minute run; 64K filled only 55-70% of the way), and the router's RSS after
#: the warm-up shows leaks, not filling
ROUTER_TREE_CAPACITY = 16384


class SoakCluster(Cluster):
    """A :class:`Cluster` whose replicas are ``bench.soak``'s server child (tiny pool, host
    tier, one shared disk directory, the remote tier; ``--tiny`` for the tiny random Llama)."""

    def __init__(
        self, *, tiny: bool, disk_dir: str, dtype: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.tiny = tiny
        self.disk_dir = disk_dir
        self.dtype = dtype

    def replica_command(self, i: int) -> list[str]:
        cmd = [sys.executable, "-m", "bench.soak", "--serve", "--port", str(self.ports[i])]
        cmd += ["--disk-dir", self.disk_dir, "--model", self.model]
        cmd += ["--remote-cache", str(self.replica_redis_url)]
        cmd += ["--kv-mac-key-file", str(self.kv_mac_key_file)]
        cmd += ["--dtype", self.dtype] if self.dtype else []
        return cmd + (["--tiny"] if self.tiny else []) + self.serve_args


# ------------------------------------------------------------------------------ the faults


def mount_tmpfs(path: str, size_mb: int) -> str | None:
    """Mount a ``size_mb`` tmpfs at ``path``; returns why not (None when mounted)."""
    try:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs", path],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"mount failed: {exc}"
    return None if r.returncode == 0 else f"mount failed: {r.stderr.strip() or r.returncode}"


def fill_disk(path: str) -> int:
    """Write a file under ``path`` until the filesystem is full; returns the bytes written."""
    block, written = b"\0" * (1 << 20), 0
    with open(os.path.join(path, "filler.bin"), "wb", buffering=0) as fh:
        try:
            while True:
                written += fh.write(block)
        except OSError:
            small = b"\0" * 4096
            with contextlib.suppress(OSError):
                while True:
                    written += fh.write(small)
    return written


def inject_faults(
    cluster: SoakCluster,
    clock: FaultClock,
    start: float,
    end: float,
    disk_full_ok: bool,
    stop: threading.Event,
) -> None:
    """The fault thread: cycles of Redis kill/restart, disk full/freed, replica 1 kill/restart
    between ``start`` and ``end`` (monotonic times). Each window closes when the component is
    back."""
    cycles = max(1, round((end - start) / 300))
    period = (end - start) / cycles

    def at(t: float) -> bool:  # sleep until t; False when told to stop
        return not stop.wait(max(0.0, t - time.monotonic()))

    for c in range(cycles):
        base = start + c * period
        if not at(base + 0.08 * period):
            return
        clock.begin("redis_down")
        clock.mark("redis_killed", cycle=c)
        cluster.kill_redis()
        if not at(base + 0.22 * period):
            cluster.restart_redis()
            return
        cluster.restart_redis()
        clock.mark("redis_restarted", cycle=c)
        clock.end()
        if disk_full_ok:
            if not at(base + 0.35 * period):
                return
            clock.begin("disk_full")
            written = fill_disk(cluster.disk_dir)
            clock.mark("disk_filled", cycle=c, filler_mb=round(written / 2**20, 1))
            stopped = not at(base + 0.5 * period)
            os.unlink(os.path.join(cluster.disk_dir, "filler.bin"))
            clock.mark("disk_freed", cycle=c)
            clock.end()
            if stopped:
                return
        if not at(base + 0.6 * period):
            return
        clock.begin("replica_killed")
        clock.mark("replica_killed", cycle=c, replica=1)
        cluster.kill_replica(1)
        cluster.restart_replica(1)
        clock.mark("replica_restarted", cycle=c, replica=1)
        time.sleep(2.0)  # the router's next health check sees it back
        clock.end()


def _rss_mb(pid: int) -> float:
    import psutil

    return round(psutil.Process(pid).memory_info().rss / 2**20, 1)


def run_fault_soak(
    minutes: float = 30.0,
    *,
    tiny: bool = False,
    model: str = "smollm2",
    replicas: int = 2,
    concurrency: int = 8,
    seed: int = 0,
    tie_margin: float | None = None,
    dtype: str | None = None,
    warmup_fraction: float = 0.15,
    log_dir: str | None = None,
    rss_growth_limit_pct: float | None = RSS_GROWTH_LIMIT_PCT,
    router_tree_capacity: int = ROUTER_TREE_CAPACITY,
) -> dict[str, Any]:
    """Run the soak with faults and return its report (see the module docstring).
    ``rss_growth_limit_pct=None`` reports RSS growth without judging it (a run of a minute or
    two has not reached its steady state)."""
    if replicas < 2:
        raise ValueError("the fault soak kills replica 1: give at least 2 replicas")
    if tiny:
        dtype = "float32"  # the tiny model's child runs in float32
    if tie_margin is None:  # a rounding difference flips only a near tie: nats between top two
        tie_margin = 0.02 if dtype == "float32" else 0.25
    log_dir = log_dir or tempfile.mkdtemp(prefix="radixkv-soak-faults-")
    disk_dir = tempfile.mkdtemp(prefix="radixkv-soak-disk-")
    why_no_tmpfs = mount_tmpfs(disk_dir, 48 if tiny else 160)
    cluster = SoakCluster(
        tiny=tiny,
        disk_dir=disk_dir,
        dtype=None if tiny else dtype,
        replicas=replicas,
        model=model,
        log_dir=log_dir,
    )
    report: dict[str, Any] = {
        "model": "tiny-llama" if tiny else model,
        "minutes": minutes,
        "replicas": replicas,
        "concurrency": concurrency,
        "disk_tmpfs": why_no_tmpfs or "mounted",
        "dtype": dtype or "host default",
        "router_tree_capacity": router_tree_capacity,
        "tie_margin": tie_margin,
    }
    router: subprocess.Popen[Any] | None = None
    stop = threading.Event()
    faults: threading.Thread | None = None
    try:
        cluster.start()
        port = free_port()
        cmd = [sys.executable, "-m", "radixkv", "router", "--port", str(port)]
        cmd += ["--health-interval", "1", "--log-level", "warning"]
        cmd += ["--tree-capacity", str(router_tree_capacity)]
        for url in cluster.urls:
            cmd += ["--replica", url]
        with open(os.path.join(log_dir, "router.log"), "ab") as log:
            router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        router_url = f"http://127.0.0.1:{port}"
        wait_healthy(router_url, router, 60)
        prompts = check_prompts(tiny)
        reference: dict[str, dict[str, Any]] = {}

        async def references() -> None:
            async with httpx.AsyncClient(base_url=cluster.urls[0]) as http:
                for p in prompts:
                    got = await greedy(http, p)
                    if isinstance(got, tuple):
                        raise RuntimeError(f"reference answer failed: {got}")
                    reference[p] = got

        asyncio.run(references())
        clock, out = FaultClock(), Outcomes()
        total = minutes * 60.0
        t0 = time.monotonic()
        warm_end = t0 + max(10.0, warmup_fraction * total)
        end = t0 + total
        pid0, router_pid = cluster.procs[0].pid, router.pid
        traffic = Traffic(
            router_url,
            cluster.urls,
            concurrency,
            seed,
            tiny,
            reference,
            tie_margin,
            rss={"replica0": lambda: _rss_mb(pid0), "router": lambda: _rss_mb(router_pid)},
            rss_every=max(5.0, total / 30),
        )
        asyncio.run(drive(traffic, warm_end, clock, Outcomes()))
        rss0 = {"replica0": _rss_mb(pid0), "router": _rss_mb(router_pid)}
        faults = threading.Thread(
            target=inject_faults,
            args=(cluster, clock, time.monotonic(), end - 0.1 * total, why_no_tmpfs is None, stop),
            daemon=True,
        )
        faults.start()
        traffic.seed = seed + 1
        asyncio.run(drive(traffic, end, clock, out))
        stop.set()
        faults.join(timeout=900)
        idle = [wait_idle(u) for u in cluster.urls]
        integrity = [httpx.get(f"{u}/cache/integrity", timeout=60).json() for u in cluster.urls]
        rss1 = {"replica0": _rss_mb(pid0), "router": _rss_mb(router_pid)}
        report.update(summarise(out, clock, idle, integrity, rss0, rss1, t0, rss_growth_limit_pct))
    finally:
        stop.set()
        if router is not None:
            router.kill()
            router.wait(10)
        cluster.stop()
        if why_no_tmpfs is None:
            subprocess.run(["umount", "-l", disk_dir], check=False, capture_output=True)
        shutil.rmtree(disk_dir, ignore_errors=True)
    report["logs"] = log_dir
    return report


def summarise(
    out: Outcomes,
    clock: FaultClock,
    idle: list[dict[str, Any]],
    integrity: list[dict[str, Any]],
    rss0: dict[str, float],
    rss1: dict[str, float],
    t0: float,
    rss_growth_limit_pct: float | None,
) -> dict[str, Any]:
    """The report's figures and the verdict."""
    total: Counter[str] = Counter()
    for c in out.by_window.values():
        total.update(c)
    unclear = sum(n for k, n in total.items() if k.startswith("unclear"))
    outside_kill = sum(
        n
        for w, c in out.by_window.items()
        if w != "replica_killed"
        for k, n in c.items()
        if k.startswith(("unclear", "error"))
    )
    growth = {k: round(100.0 * (rss1[k] - rss0[k]) / rss0[k], 2) for k in rss0 if rss0[k] > 0}
    leaked = sum(
        int(i.get("leaked_pages") or 0) + int(i.get("leaked_host_pages") or 0) for i in integrity
    )
    checks = {k: total.get(f"check_{k}", 0) for k in ("same", "tie", "wrong")}
    result = {
        "elapsed_s": round(time.monotonic() - t0, 1),
        "requests": sum(total.values()),
        "outcomes": dict(sorted(total.items())),
        "by_window": {w: dict(sorted(c.items())) for w, c in sorted(out.by_window.items())},
        "greedy_checks": checks,
        "wrong_answers": len(out.wrong),
        "wrong_examples": out.wrong[:3],
        "unclear_failures": unclear,
        "failures_outside_replica_kills": outside_kill,
        "error_examples": out.examples,
        "latency_p50_s": round(percentile(out.latencies, 50), 3),
        "latency_p99_s": round(percentile(out.latencies, 99), 3),
        "rss_after_warmup_mb": rss0,
        "rss_end_mb": rss1,
        "rss_growth_pct": growth,
        "rss_series_mb": out.rss_series,
        "rss_growth_limit_pct": rss_growth_limit_pct,
        "leaked_pages": leaked,
        "integrity_ok": all(bool(i.get("ok")) for i in integrity),
        "integrity_errors": [i.get("error") for i in integrity if not i.get("ok")],
        "idle_at_end": all(s.get("running") == 0 and s.get("waiting") == 0 for s in idle),
        "fault_events": clock.events,
    }
    result["passed"] = bool(
        result["wrong_answers"] == 0
        and unclear == 0
        and outside_kill == 0
        and leaked == 0
        and result["integrity_ok"]
        and result["idle_at_end"]
        and (rss_growth_limit_pct is None or all(g < rss_growth_limit_pct for g in growth.values()))
        and any(e["event"] == "replica_restarted" for e in clock.events)
    )
    return result


def main_faults(args: Any) -> int:
    """``python -m bench.soak --faults``: run, print the report, end with one JSON line."""
    report = run_fault_soak(
        args.minutes,
        tiny=args.tiny,
        model=args.model,
        replicas=args.replicas,
        concurrency=args.concurrency,
        seed=args.seed,
        dtype=args.dtype,
    )
    for key in ("outcomes", "by_window", "greedy_checks", "fault_events", "error_examples"):
        print(f"{key}: {json.dumps(report.get(key))}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(report, separators=(",", ":")))
    return 0 if report["passed"] else 1
