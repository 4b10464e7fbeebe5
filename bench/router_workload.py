"""``bench/bench_router.py``'s pieces: the shared-prefix workload, the streaming client that
times the first token, the replicas' counters, percentiles and the host's ISA."""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import httpx

__all__ = [
    "drive",
    "host_isa",
    "percentile",
    "replica_counters",
    "system_prompt",
    "workload",
]

_WORDS = [  # fmt: skip
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
    """``groups`` x ``questions`` prompts (system + "\\n\\n" + question), shuffled (seeded)."""
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


async def _stream_one(
    client: httpx.AsyncClient, base: str, model: str, prompt: str, max_tokens: int
) -> dict[str, Any]:
    """One streaming completion: seconds to the first chunk that carries a generated token
    (its text may be empty when the token ends inside a UTF-8 character), the total, and the
    usage of the final chunk (``stream_options.include_usage``)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] | None = None
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{base}: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    if ttft is None:
        raise RuntimeError(f"{base}: a stream without a token")
    return {"ttft": ttft, "seconds": time.perf_counter() - t0, "usage": usage}


async def _drive(base: str, model: str, prompts: list[str], max_tokens: int, conc: int):
    sem = asyncio.Semaphore(conc)
    limits = httpx.Limits(max_connections=conc + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def one(p: str) -> dict[str, Any]:
            async with sem:
                return await _stream_one(client, base, model, p, max_tokens)

        return await asyncio.gather(*(one(p) for p in prompts))


def drive(
    base: str, model: str, prompts: list[str], max_tokens: int, concurrency: int
) -> list[dict[str, Any]]:
    """Send ``prompts`` to ``base`` as streaming completions, ``concurrency`` at a time; one
    row per request (see :func:`_stream_one`)."""
    return asyncio.run(_drive(base, model, prompts, max_tokens, concurrency))


def replica_counters(urls: list[str], headers: dict[str, str] | None = None) -> dict[str, Any]:
    """Each replica's running totals (``/cache/stats``): requests, prompt tokens, cached tokens
    and remote-tier tokens. Differences of two snapshots are what a case did, whichever router
    sent the requests (sgl-router does not say which replica answered)."""
    out = {}
    for u in urls:
        s = httpx.get(u + "/cache/stats", headers=headers, timeout=30).json()
        tiers = s.get("cached_tokens_by_tier") or {}
        out[u] = {
            "requests": int(s.get("requests_total", 0)),
            "prompt": int(s.get("prompt_tokens_total", 0)),
            "cached": int(s.get("cached_tokens_total", 0)),
            "remote": int(tiers.get("remote", 0)) if isinstance(tiers, dict) else 0,
        }
    return out


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linear between ranks (0.0 for none)."""
    if not values:
        return 0.0
    xs = sorted(values)
    at = (len(xs) - 1) * q / 100.0
    lo = int(at)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (at - lo)


def host_isa(cpuinfo: str | None = None) -> str:
    """The CPU's model name and its widest SIMD level that matters to the kernels
    (``avx512_bf16`` > ``avx512f`` > ``avx2``), from ``/proc/cpuinfo``."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return "unknown"
    name, flags = "unknown CPU", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and name == "unknown CPU":
            name = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    isa = next((f for f in ("avx512_bf16", "avx512f", "avx2") if f in flags), "no avx2")
    return f"{name}, {isa}"
