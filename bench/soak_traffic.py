"""The fault soak's clients (bench/soak_faults.py): the plain soak's generation mix through the
router, slow readers, greedy check requests compared with answers from before any fault, pins
churning on the replicas, and the RSS of the processes that are never killed, sampled.

Every request's outcome is filed under a fault window it overlapped
(:class:`FaultClock`). Outcome kinds: ``ok``; ``check_same`` / ``check_tie`` / ``check_wrong``;
caused by the client on purpose (``client_timeout``, ``stream_dropped``); documented pin answers
(``pin_409`` ...); ``error_*`` (an answer that names its cause: JSON with an ``error`` object, or
a stream's error event); ``unclear_*`` (a connection cut, a stream without its end, a timeout the
client did not ask for, an error without a JSON body).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.soak import SHARED_PREFIXES, _request
from bench.soak_measure import read_stream

__all__ = [
    "FaultClock",
    "Outcomes",
    "Traffic",
    "check_prompts",
    "compare_greedy",
    "drive",
    "greedy",
]

CHECK_QUESTIONS = [
    "What should I say first?",
    "Give one example.",
    "Name a common mistake.",
    "Summarise the rule.",
]
CHECK_MAX_TOKENS = 12


@dataclass
class Outcomes:
    """Every request's outcome, filed by a fault window it overlapped (``none``: no fault)."""

    by_window: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    latencies: list[float] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)
    wrong: list[dict[str, Any]] = field(default_factory=list)
    rss_series: dict[str, list[float]] = field(default_factory=dict)

    def add(self, window: str, kind: str, detail: str = "") -> None:
        self.by_window[window][kind] += 1
        if kind.startswith(("unclear", "error")) and len(self.examples) < 12:
            self.examples.append(f"[{window}] {kind}: {detail[:240]}")


class FaultClock:
    """The fault windows (set by the fault thread, read by the clients): each is a name and the
    span from injection until the component is back."""

    #: when a request overlaps several windows, it is filed under the first of these it meets
    PRECEDENCE = ("replica_killed", "redis_down", "disk_full")

    def __init__(self) -> None:
        self.spans: list[list[Any]] = []  # [name, opened, closed or None]
        self.events: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        self._lock = threading.Lock()

    def begin(self, name: str) -> None:
        with self._lock:
            self.spans.append([name, time.monotonic(), None])

    def end(self) -> None:
        with self._lock:
            if self.spans and self.spans[-1][2] is None:
                self.spans[-1][2] = time.monotonic()

    def now(self) -> str:
        """The window open now, or ``none``."""
        with self._lock:
            open_ = [s[0] for s in self.spans[-1:] if s[2] is None]
        return open_[0] if open_ else "none"

    def during(self, started: float) -> str:
        """The window a request that ran from ``started`` until now belongs to: one it
        overlapped (by :data:`PRECEDENCE`; a slow reader may learn of a replica kill long after
        the replica is back), else ``none``."""
        with self._lock:
            hit = {
                n for n, a, b in self.spans if a <= time.monotonic() and (b is None or b >= started)
            }
        return next((n for n in self.PRECEDENCE if n in hit), "none")

    def mark(self, what: str, **detail: Any) -> None:
        with self._lock:
            self.events.append(
                {"t_s": round(time.monotonic() - self.t0, 1), "event": what, **detail}
            )


def _clear_error(status: int, text: str) -> bool:
    """An error answer a client can act on: JSON with an ``error`` object naming the cause."""
    with contextlib.suppress(ValueError):
        body = json.loads(text)
        return isinstance(body, dict) and isinstance(body.get("error"), dict)
    return False


async def _generation(http: httpx.AsyncClient, rng: random.Random, tiny: bool) -> tuple[str, str]:
    """One request of the plain soak's mix; returns (outcome kind, detail)."""
    path, body, stream = _request(rng, tiny)
    if not stream:
        short = rng.random() < 0.08
        try:
            r = await http.post(path, json=body, timeout=rng.uniform(0.05, 0.4) if short else 300)
        except httpx.TimeoutException:
            return ("client_timeout" if short else "unclear_timeout"), path
        except httpx.HTTPError as exc:
            return "unclear_connection", f"{path}: {type(exc).__name__}: {exc}"
        if r.status_code == 200:
            return "ok", path
        kind = "error_clear" if _clear_error(r.status_code, r.text) else "unclear_body"
        return f"{kind}_{r.status_code}", f"{path}: {r.text}"
    drop_after = rng.randint(1, 4) if rng.random() < 1 / 3 else None
    return await _read_stream(http, path, body, drop_after, pause=0.0)


#: The fault soak's names for how a stream ended (read_stream's kinds).
_STREAM_OUTCOMES = {
    "ok": "ok",
    "error_event": "error_clear_stream_event",
    "dropped": "stream_dropped",
    "connection": "unclear_stream_connection",
    "without_done": "unclear_stream_without_done",
}


async def _read_stream(
    http: httpx.AsyncClient, path: str, body: dict[str, Any], drop_after: int | None, pause: float
) -> tuple[str, str]:
    read = await read_stream(http, path, body, drop_after, pause)
    if read.kind == "http_error":
        kind = "error_clear" if _clear_error(read.status, read.text) else "unclear_body"
        return f"{kind}_{read.status}", read.detail
    return _STREAM_OUTCOMES[read.kind], read.detail


def check_prompts(tiny: bool) -> list[str]:
    """The greedy check prompts: each shared prefix with each question (cache and tier paths)."""
    cut = 3 if tiny else 1
    return [p[: len(p) // cut] + "Question: " + q for p in SHARED_PREFIXES for q in CHECK_QUESTIONS]


async def greedy(http: httpx.AsyncClient, prompt: str) -> dict[str, Any] | tuple[str, str]:
    """A greedy completion with the top-2 logprobs of each token, or (outcome kind, detail)."""
    body = {
        "model": "soak",
        "prompt": prompt,
        "max_tokens": CHECK_MAX_TOKENS,
        "temperature": 0.0,
        "logprobs": 2,
        "ignore_eos": True,
    }
    try:
        r = await http.post("/v1/completions", json=body, timeout=300)
    except httpx.HTTPError as exc:
        return "unclear_connection", f"check: {type(exc).__name__}: {exc}"
    if r.status_code != 200:
        kind = "error_clear" if _clear_error(r.status_code, r.text) else "unclear_body"
        return f"{kind}_{r.status_code}", f"check: {r.text}"
    return r.json()["choices"][0]["logprobs"]


def _margin(logprobs: dict[str, Any], i: int) -> float:
    """Top-1 minus top-2 logprob at position ``i`` (inf when only one is known)."""
    top = sorted(logprobs["top_logprobs"][i].values(), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def compare_greedy(want: dict[str, Any], got: dict[str, Any], tie_margin: float) -> str:
    """``same``, ``tie`` (the first difference falls where either answer's top two tokens are
    within ``tie_margin`` nats: a rounding difference may flip it) or ``wrong``."""
    a, b = want["tokens"], got["tokens"]
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return "tie" if min(_margin(want, i), _margin(got, i)) < tie_margin else "wrong"
    return "same" if len(a) == len(b) else "wrong"


@dataclass
class Traffic:
    """What the clients send and to whom."""

    router: str
    replicas: list[str]
    concurrency: int
    seed: int
    tiny: bool
    #: prompt -> its greedy answer (``logprobs`` of /v1/completions) from before any fault
    reference: dict[str, dict[str, Any]]
    tie_margin: float
    #: name -> RSS in MiB of a process that is never killed, sampled every ``rss_every`` s
    rss: dict[str, Callable[[], float]] = field(default_factory=dict)
    rss_every: float = 60.0


def pin_text(rng: random.Random, tiny: bool) -> str:
    """A shared prefix's head, short enough for a namespace's pin budget on the soak's pools."""
    prefix = rng.choice(SHARED_PREFIXES)
    return prefix[: len(prefix) // (9 if tiny else 3)]


async def drive(t: Traffic, deadline: float, clock: FaultClock, out: Outcomes) -> None:
    """Send traffic until ``deadline`` (monotonic), filing outcomes in ``out``."""
    limits = httpx.Limits(
        max_connections=t.concurrency + 8, max_keepalive_connections=t.concurrency
    )
    prompts = list(t.reference)
    async with (
        httpx.AsyncClient(base_url=t.router, limits=limits) as http,
        httpx.AsyncClient() as direct,
    ):

        async def worker(wid: int) -> None:
            rng = random.Random(t.seed * 1000 + wid)
            while time.monotonic() < deadline:
                started = time.monotonic()
                roll = rng.random()
                if roll < 0.12:  # a greedy check
                    prompt = rng.choice(prompts)
                    got = await greedy(http, prompt)
                    if isinstance(got, tuple):
                        out.add(clock.during(started), *got)
                        continue
                    verdict = compare_greedy(t.reference[prompt], got, t.tie_margin)
                    out.add(clock.during(started), f"check_{verdict}")
                    if verdict == "wrong":
                        want = t.reference[prompt]["tokens"]
                        out.wrong.append(
                            {"prompt": prompt[-60:], "want": want, "got": got["tokens"]}
                        )
                elif roll < 0.18:  # a slow reader (not in the latencies)
                    path, body, _ = _request(rng, t.tiny)
                    body["stream"] = True
                    read = await _read_stream(http, path, body, None, pause=0.3)
                    out.add(clock.during(started), *read)
                    continue
                else:
                    kind, detail = await _generation(http, rng, t.tiny)
                    out.add(clock.during(started), kind, detail)
                    if kind != "ok":
                        continue
                out.latencies.append(time.monotonic() - started)

        async def pin_churn() -> None:
            rng = random.Random(t.seed + 7)
            while time.monotonic() < deadline:
                await asyncio.sleep(rng.uniform(0.5, 2.0))
                url, started = rng.choice(t.replicas), time.monotonic()
                what = "pin" if rng.random() < 0.7 else "unpin"
                body: dict[str, Any] = {"text": pin_text(rng, t.tiny)}
                if what == "pin":
                    body["ttl"] = rng.uniform(1, 5)
                try:
                    r = await direct.post(f"{url}/cache/{what}", json=body, timeout=120)
                except httpx.HTTPError as exc:
                    out.add(
                        clock.during(started),
                        "error_pin_unreachable",
                        f"{url}: {type(exc).__name__}",
                    )
                    continue
                documented = r.status_code == 200 or (
                    r.status_code in (404, 409, 503) and _clear_error(r.status_code, r.text)
                )
                kind = f"{what}_{r.status_code}"
                out.add(clock.during(started), kind if documented else f"error_{kind}", r.text)

        async def rss_sampler() -> None:
            while t.rss and time.monotonic() < deadline:
                for name, read in t.rss.items():
                    with contextlib.suppress(Exception):
                        out.rss_series.setdefault(name, []).append(read())
                await asyncio.sleep(min(t.rss_every, max(0.0, deadline - time.monotonic())))

        workers = (worker(i) for i in range(t.concurrency))
        await asyncio.gather(pin_churn(), rss_sampler(), *workers)
