"""A bounded soak run: the server under minutes of mixed, partly hostile traffic stays healthy.

``python -m bench.soak --minutes 5`` starts the server itself (a child process on loopback: the
real SmolLM2 model by default, ``--tiny`` for the tiny random Llama) with a deliberately tiny
device KV pool, a host tier and a disk tier, so eviction, tier traffic and preemption happen
all the time. Then ``--concurrency`` clients send, until the time or ``--max-requests`` is up:

* ``/v1/chat/completions``, ``/v1/completions`` and ``/generate``, streaming and not, ``n`` of
  1 to 3, prompts that share one of a few long prefixes or are fresh, under several salts;
* a third of the streams are dropped after a few chunks (the client closes the connection);
* some requests carry a client timeout too short for them (the client gives up);
* now and then ``/flush_cache`` (409 while busy is the documented answer), ``/cache/pin`` with
  a short TTL (pinned, then unpinned by time), ``/cache/stats`` and ``/metrics`` while busy.

It reports requests served, errors by kind (caused by the client: drops, timeouts, documented
refusals; caused by the server: any 5xx, an unexpected 4xx, a broken or error-carrying stream,
a connection the server dropped), p50/p99 latency of completed requests, the server's RSS after
warm-up and at the end, and at the end (idle) ``GET /cache/integrity``: leaked pages and
``check_integrity()``. Exit status 1 when a server error, a leak or a broken invariant is seen.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.soak_measure import percentile, read_stream, wait_idle
from radixkv.server.ports import free_port

SALTS = ["tenant-a", "tenant-b", "tenant-c", None]
WORDS = (  # noqa: SIM905 - thirty words, one per line would be 30 lines
    "river mountain cloud lantern harbor meadow copper velvet signal orbit "
    "canyon ember glacier willow thunder compass marble saffron falcon prism "
    "quartz nectar tundra beacon cobalt fern summit delta lagoon cipher"
).split()
SHARED_PREFIXES = [
    "You are a careful assistant for a shipping company. Answer in one short sentence, "
    "never invent tracking numbers, and say so when you do not know. " * 3,
    "System: the following is a conversation about astronomy with a patient teacher who "
    "explains orbits, tides and eclipses with simple everyday examples. " * 3,
    "Context: a recipe collection. Each answer lists at most three ingredients and one "
    "step, in plain words, for a reader cooking in a small kitchen. " * 3,
    "You translate short English phrases into plain French and explain one word of the "
    "translation, briefly, for a beginner learning the language at home. " * 3,
]


# ------------------------------------------------------------------------------ server side


def serve_main(args: argparse.Namespace) -> int:
    """The child process: build the engine with a tiny pool and tiers, serve on loopback."""
    import logging

    import uvicorn

    from radixkv.engine.engine import Engine
    from radixkv.server.app import create_app

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    if args.tiny:
        from bench.tiny_model import tiny_loaded_model

        model: Any = tiny_loaded_model()
        knobs = dict(page_size=4, kv_cache_tokens=1024, host_cache_tokens=512, max_model_len=384)
        knobs.update(dtype="float32", attention_backend="torch")
    else:
        model = args.model
        knobs = dict(page_size=16, kv_cache_tokens=768, host_cache_tokens=2048)
        knobs.update(max_model_len=512)
    if args.remote_cache:  # the fault soak's replicas (written through to Redis by default)
        knobs.update(remote_cache_url=args.remote_cache, kv_mac_key_file=args.kv_mac_key_file)
    if args.dtype:
        knobs.update(dtype=args.dtype)
    engine = Engine(
        model,
        disk_cache_dir=args.disk_dir,
        disk_cache_bytes=(8 << 20) if args.tiny else (64 << 20),  # the disk tier evicts too
        max_running_requests=16,
        chunked_prefill_tokens=256,
        **knobs,
    )
    app = create_app(engine, model_name="soak")
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
    return 0


class ServerProcess:
    """The server as a child process (its RSS is the server's alone)."""

    def __init__(self, tiny: bool, model: str, log_path: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.disk_dir = tempfile.mkdtemp(prefix="radixkv-soak-disk-")
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "bench.soak", "--serve", "--port", str(self.port)]
        cmd += ["--disk-dir", self.disk_dir, "--model", model] + (["--tiny"] if tiny else [])
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.proc = subprocess.Popen(cmd, cwd=root, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited during startup (see {self.log.name})")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy within {timeout} s")

    def rss(self) -> int:
        import psutil

        return int(psutil.Process(self.proc.pid).memory_info().rss)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        import shutil

        shutil.rmtree(self.disk_dir, ignore_errors=True)
        return self.proc.returncode


# ------------------------------------------------------------------------------ client side


@dataclass
class Tally:
    """What the clients saw."""

    served: int = 0  # requests answered in full (2xx, stream to [DONE])
    by_endpoint: Counter[str] = field(default_factory=Counter)
    client_errors: Counter[str] = field(default_factory=Counter)  # caused on purpose
    server_errors: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    admin: Counter[str] = field(default_factory=Counter)

    def server_error(self, kind: str, detail: str) -> None:
        self.server_errors[kind] += 1
        if len(self.examples) < 10:
            self.examples.append(f"{kind}: {detail[:300]}")


def _prompt(rng: random.Random, tiny: bool) -> tuple[str, bool]:
    """A prompt that shares a long prefix (70%) or is fresh; returns (text, shared). The tiny
    model's tokenizer is one token per byte: its prompts are a third as long in text."""
    question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14)))
    if rng.random() < 0.7:
        prefix = rng.choice(SHARED_PREFIXES)
        return (prefix[: len(prefix) // 3] if tiny else prefix) + "Question: " + question, True
    words = rng.randint(8, 25) if tiny else rng.randint(20, 60)
    return "Fresh: " + " ".join(rng.choice(WORDS) for _ in range(words)), False


def _request(rng: random.Random, tiny: bool) -> tuple[str, dict[str, Any], bool]:
    """(path, body, stream) of one generation request."""
    text, _ = _prompt(rng, tiny)
    salt = rng.choice(SALTS)
    n = rng.choice([1, 1, 1, 2, 3])
    stream = rng.random() < 0.5
    max_tokens = rng.randint(4, 24)
    sampling: dict[str, Any] = {"temperature": rng.choice([0.0, 0.7, 1.0]), "n": n}
    if rng.random() < 0.3:
        sampling["top_p"] = 0.9
    if rng.random() < 0.2:
        sampling["seed"] = rng.randint(0, 1000)
    kind = rng.choice(["chat", "completions", "generate"])
    if kind == "chat":
        body = {
            "model": "soak",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "stream": stream,
            **sampling,
        }
        if salt:
            body["cache_salt"] = salt
        return "/v1/chat/completions", body, stream
    if kind == "completions":
        body = {"model": "soak", "prompt": text, "max_tokens": max_tokens, "stream": stream}
        body.update(sampling)
        if salt:
            body["cache_salt"] = salt
        return "/v1/completions", body, stream
    sampling["max_new_tokens"] = max_tokens
    body = {"text": text, "sampling_params": sampling, "stream": stream}
    if salt:
        body["salt"] = salt
    return "/generate", body, stream


async def _one_generation(
    http: httpx.AsyncClient, rng: random.Random, tally: Tally, tiny: bool
) -> None:
    path, body, stream = _request(rng, tiny)
    started = time.monotonic()
    if not stream:
        short = rng.random() < 0.08  # a client that gives up too early
        timeout = rng.uniform(0.05, 0.4) if short else 300.0
        try:
            r = await http.post(path, json=body, timeout=timeout)
        except httpx.TimeoutException:
            if short:
                tally.client_errors["client_timeout"] += 1
            else:
                tally.server_error("timeout", f"{path} {body}")
            return
        except httpx.HTTPError as exc:
            tally.server_error("connection", f"{path}: {type(exc).__name__}: {exc}")
            return
        if r.status_code != 200:
            tally.server_error(f"http_{r.status_code}", f"{path}: {r.text}")
            return
        tally.served += 1
        tally.by_endpoint[path] += 1
        tally.latencies.append(time.monotonic() - started)
        return
    drop_after = rng.randint(1, 4) if rng.random() < 1 / 3 else None
    read = await read_stream(http, path, body, drop_after)
    if read.kind == "dropped" or (read.kind == "without_done" and drop_after is not None):
        tally.client_errors["stream_dropped"] += 1
        return
    if read.kind != "ok":
        name = f"http_{read.status}" if read.kind == "http_error" else f"stream_{read.kind}"
        tally.server_error(name, read.detail)
        return
    tally.served += 1
    tally.by_endpoint[path + " (stream)"] += 1
    tally.latencies.append(time.monotonic() - started)


async def _one_admin(http: httpx.AsyncClient, rng: random.Random, tally: Tally, tiny: bool) -> None:
    what = rng.choice(["flush", "pin", "pin", "stats", "metrics", "bad"])
    try:
        if what == "flush":
            r = await http.post("/flush_cache", timeout=60)
            ok = r.status_code in (200, 409)  # 409: refused while busy (documented)
            tally.admin[f"flush_{r.status_code}"] += 1
        elif what == "pin":
            prefix = rng.choice(SHARED_PREFIXES)
            prefix = prefix[: len(prefix) // 3] if tiny else prefix
            body: dict[str, Any] = {"text": prefix, "ttl": rng.uniform(1, 4)}
            salt = rng.choice(SALTS)
            if salt:
                body["salt"] = salt
            r = await http.post("/cache/pin", json=body, timeout=300)
            # 409: past the pin budget (documented, the answer names it)
            ok = r.status_code == 200 or (r.status_code == 409 and "pin_budget_exceeded" in r.text)
            tally.admin[f"pin_{r.status_code}"] += 1
        elif what == "stats":
            r = await http.get("/cache/stats", timeout=60)
            ok = r.status_code == 200
            tally.admin["stats"] += 1
        elif what == "metrics":
            r = await http.get("/metrics", timeout=60)
            ok = r.status_code == 200
            tally.admin["metrics"] += 1
        else:  # hostile input: must be a 4xx, never a 5xx
            body = rng.choice(
                [
                    {"model": "soak", "prompt": "", "max_tokens": 2},
                    {"model": "soak", "prompt": "hi", "max_tokens": 10**9},
                    {"model": "soak", "prompt": "hi", "temperature": "hot"},
                    {"model": "other", "prompt": "hi"},
                    {"model": "soak", "prompt": [10**9], "max_tokens": 2},
                ]
            )
            r = await http.post("/v1/completions", json=body, timeout=60)
            ok = 400 <= r.status_code < 500 and "error" in r.json()
            tally.client_errors[f"bad_request_{r.status_code}"] += 1 if ok else 0
    except httpx.HTTPError as exc:
        tally.server_error("admin_connection", f"{what}: {type(exc).__name__}: {exc}")
        return
    if not ok:
        tally.server_error(f"admin_{what}_{r.status_code}", r.text)


async def _drive(
    base_url: str,
    seconds: float,
    max_requests: int,
    concurrency: int,
    seed: int,
    tally: Tally,
    tiny: bool,
) -> None:
    deadline = time.monotonic() + seconds
    started = [0]
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, limits=limits) as http:

        async def worker(wid: int) -> None:
            rng = random.Random(seed * 1000 + wid)
            while time.monotonic() < deadline and started[0] < max_requests:
                started[0] += 1
                if rng.random() < 0.06:
                    await _one_admin(http, rng, tally, tiny)
                else:
                    await _one_generation(http, rng, tally, tiny)

        await asyncio.gather(*(worker(i) for i in range(concurrency)))


def run_soak(
    minutes: float = 5.0,
    *,
    tiny: bool = False,
    model: str = "smollm2",
    concurrency: int = 8,
    max_requests: int = 100_000,
    seed: int = 0,
    warmup_fraction: float = 0.2,
    log_path: str | None = None,
) -> dict[str, Any]:
    """Run the soak and return its report (see the module docstring)."""
    log_path = log_path or os.path.join(tempfile.gettempdir(), "radixkv-soak-server.log")
    server = ServerProcess(tiny, model, log_path)
    report: dict[str, Any] = {"model": "tiny-llama" if tiny else model, "minutes": minutes}
    try:
        server.wait_healthy()
        total = minutes * 60.0
        warm = max(5.0, total * warmup_fraction)
        tally = Tally()
        t0 = time.monotonic()
        url = server.base_url
        asyncio.run(_drive(url, warm, max_requests, concurrency, seed, tally, tiny))
        rss_start = server.rss()
        rss_series = [rss_start]
        end = t0 + total
        while time.monotonic() < end and tally.served < max_requests:  # RSS every ~10% of the run
            chunk = min(end - time.monotonic(), max(5.0, total / 10))
            left = max_requests - tally.served
            asyncio.run(_drive(url, chunk, left, concurrency, seed + len(rss_series), tally, tiny))
            rss_series.append(server.rss())
        elapsed = time.monotonic() - t0
        # idle: the engine drains, then the invariants and the page accounting
        stats = wait_idle(server.base_url)
        integrity = httpx.get(f"{server.base_url}/cache/integrity", timeout=60).json()
        rss_end = server.rss()
        health = httpx.get(f"{server.base_url}/health", timeout=10).status_code
        tiers = stats.get("tiers", {})
        report.update(
            {
                "elapsed_s": round(elapsed, 1),
                "concurrency": concurrency,
                "requests_served": tally.served,
                "served_by_endpoint": dict(tally.by_endpoint),
                "client_caused": dict(tally.client_errors),
                "server_errors": dict(tally.server_errors),
                "server_error_examples": tally.examples,
                "admin_calls": dict(tally.admin),
                "latency_p50_s": round(percentile(tally.latencies, 50), 3),
                "latency_p99_s": round(percentile(tally.latencies, 99), 3),
                "rss_after_warmup_mb": round(rss_start / 2**20, 1),
                "rss_end_mb": round(rss_end / 2**20, 1),
                "rss_growth_pct": round(100.0 * (rss_end - rss_start) / rss_start, 2),
                "rss_series_mb": [round(x / 2**20) for x in rss_series],
                "leaked_pages": integrity.get("leaked_pages"),
                "leaked_host_pages": integrity.get("leaked_host_pages"),
                "integrity_ok": integrity.get("ok"),
                "integrity_error": integrity.get("error"),
                "health_at_end": health,
                "preemptions": stats.get("preemptions_total"),
                "cached_tokens_by_tier": stats.get("cached_tokens_by_tier"),
                "host_writes": tiers.get("host_writes"),
                "disk_write_pages": tiers.get("disk_write_pages"),
                "disk_load_pages": tiers.get("disk_load_pages"),
                "host_load_pages": tiers.get("host_load_pages"),
            }
        )
    finally:
        report["server_exit"] = server.stop()
    report["passed"] = bool(
        not report.get("server_errors")
        and report.get("leaked_pages") == 0
        and report.get("leaked_host_pages") == 0
        and report.get("integrity_ok")
        and report.get("health_at_end") == 200
    )
    return report


def print_report(report: dict[str, Any]) -> None:
    for key, value in report.items():
        print(f"{key:>24}: {value}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=5.0, help="how long to drive (default 5)")
    p.add_argument("--tiny", action="store_true", help="the tiny random Llama, not SmolLM2")
    p.add_argument("--model", default="smollm2", help="model of the server (default smollm2)")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent clients (default 8)")
    p.add_argument("--max-requests", type=int, default=100_000, help="stop after this many")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the report here")
    p.add_argument(
        "--faults",
        action="store_true",
        help="replicas with host, disk and Redis tiers behind the router, with Redis, the disk "
        "and a replica failing during the run (bench/soak_faults.py); ends with one JSON line",
    )
    p.add_argument("--replicas", type=int, default=2, help="--faults: replicas (default 2)")
    p.add_argument(
        "--dtype",
        default=None,
        help="the server's dtype (default: the host's; --faults compares greedy answers, which "
        "float32 keeps free of near-tie flips)",
    )
    p.add_argument("--remote-cache", default=None, help=argparse.SUPPRESS)  # the child
    p.add_argument("--kv-mac-key-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--disk-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        return serve_main(args)
    if args.faults:
        from bench.soak_faults import main_faults

        return main_faults(args)
    report = run_soak(
        args.minutes,
        tiny=args.tiny,
        model=args.model,
        concurrency=args.concurrency,
        max_requests=args.max_requests,
        seed=args.seed,
    )
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
