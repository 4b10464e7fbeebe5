"""Replay a request trace through the real prefix cache to measure hit rates (no model, no torch).

Per request (in trace order) the replay does what the engine does with the cache:

1. ``match_prefix(prompt, salt)``: the matched tokens (page aligned) are the request's hits,
   plus the first 4-15 tokens of a cached page below the match that starts like the rest of the
   prompt (the engine copies that page's rows: ``RadixTree.reusable_rows``);
2. ``lock`` the matched node;
3. pages for the uncached rest of ``prompt + output`` are allocated, evicting (policy order)
   when the pool is short; if even eviction cannot free enough (everything else is locked or the
   request is larger than the pool) only the part that fits gets cached;
4. ``insert(prompt + output)`` (full pages only; a trailing partial page is freed), free the
   duplicate pages the insert reports, ``unlock``.

The output appended to a prompt is ``output_ids`` when the trace has them, else the tokenized
``output_text``, else ``output_len`` fresh token ids unique to the request (negative ids, so they
never collide with real tokens and never hit).

Text requests (``"text"`` instead of ``"input_ids"``) go through :func:`hash_tokenize`: split on
whitespace, each word becomes ``1000 + crc32(word) % 1_000_000``. It is deterministic and keeps
the prefix property of whitespace-joined text, which is all a cache simulation needs.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.radix_tree import EVICTION_POLICIES, RadixTree

__all__ = [
    "RESULT_KEYS",
    "PreparedRequest",
    "hash_tokenize",
    "prepare_trace",
    "replay",
    "simulate",
    "unbounded_capacity",
]

RESULT_KEYS = (
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "token_hit_rate",
    "optimal_hit_rate",
    "evictions",
    "tokens_per_second",
)


def hash_tokenize(text: str) -> list[int]:
    """Deterministic whitespace/hash tokenizer: one id per whitespace-separated word."""
    return [1000 + zlib.crc32(w.encode("utf-8")) % 1_000_000 for w in text.split()]


@dataclass
class PreparedRequest:
    """A trace request as token lists: ``seq = prompt + output`` (what gets cached)."""

    prompt: list[int]
    seq: list[int]
    salt: Hashable


def prepare_trace(trace: Iterable[dict[str, Any]]) -> list[PreparedRequest]:
    """Tokenize a trace and fix every request's output tokens (see the module docstring).

    Raises ``ValueError`` naming the request when it has neither ``input_ids`` nor ``text``.
    """
    out: list[PreparedRequest] = []
    fresh = -1
    for i, req in enumerate(trace):
        if "input_ids" in req:
            prompt = [int(t) for t in req["input_ids"]]
        elif "text" in req:
            prompt = hash_tokenize(req["text"])
        else:
            rid = req.get("id", i)
            raise ValueError(f"request {rid!r} (line {i + 1}) has neither 'input_ids' nor 'text'")
        if req.get("output_ids") is not None:
            output = [int(t) for t in req["output_ids"]]
        elif req.get("output_text") is not None:
            output = hash_tokenize(req["output_text"])
        else:
            n = int(req.get("output_len", 0) or 0)
            output = list(range(fresh, fresh - n, -1))
            fresh -= n
        out.append(PreparedRequest(prompt, prompt + output if output else prompt, req.get("salt")))
    return out


def _sim_tiers(
    tree: RadixTree,
    alloc: BlockAllocator,
    host_tokens: int,
    disk_tokens: int,
    remote_tokens: int = 0,
) -> Any:
    """Bookkeeping-only host/disk/remote tiers (no KV data, no torch, no server) under ``tree``."""
    from radixkv.cache.disk_store import HEADER, DiskStore
    from radixkv.cache.host_pool import HostPool
    from radixkv.cache.tiers import TieredCache

    P = tree.page_size
    host = HostPool(host_tokens // P, P) if host_tokens >= P else None
    disk = None
    if disk_tokens >= P:  # a simulated page file is P bytes of payload plus the header
        disk = DiskStore(None, disk_tokens // P * (HEADER.size + P), b"\0" * 32)
    remote = None
    if remote_tokens >= P:
        from radixkv.cache.remote_store import RemoteStore

        remote = RemoteStore(None, b"\0" * 32, capacity_pages=remote_tokens // P)
    return TieredCache(tree, alloc, None, host, disk, min_load_tokens=0, remote=remote)


def replay(
    requests: list[PreparedRequest],
    capacity_tokens: int,
    page_size: int = 1,
    policy: str = "lru",
    host_capacity_tokens: int = 0,
    disk_capacity_tokens: int = 0,
    remote_capacity_tokens: int = 0,
    check: bool = False,
    observer: Any = None,
) -> dict[str, Any]:
    """Replay prepared requests through a fresh RadixTree + BlockAllocator of
    ``capacity_tokens // page_size`` pages. Returns requests, prompt_tokens, cached_tokens,
    evictions (tokens evicted), seconds (wall time of the loop), cached_by_tier (hit tokens
    served from the device, host and disk tiers). Checks that no page leaked.

    With ``host_capacity_tokens`` / ``disk_capacity_tokens`` the evicted prefixes move to
    bookkeeping-only host / disk tiers (write-back) and hits there are loaded back, exactly as
    in the engine (:class:`radixkv.cache.tiers.TieredCache`, without data and load threshold).
    ``remote_capacity_tokens`` adds a remote tier (an LRU of that many tokens standing in for
    Redis' ``allkeys-lru``), written when pages leave the device.

    ``check=True`` runs ``check_integrity()`` of the tree, the allocator and the tiers after the
    last request (before the final flush). Time and memory grow with the pages the trace uses,
    not with ``capacity_tokens`` (the allocator's free list is extended lazily).

    ``observer`` (e.g. :class:`radixkv.sim.report.Timeline`) is called as
    ``observer.after_request(done, prompt_tokens, hits, by_tier, tree, tiers)`` after each request
    (running sums so far) and ``observer.before_flush(tree, tiers)`` before the final flush."""
    P = page_size
    alloc = BlockAllocator(max(capacity_tokens, 0) // P, P)
    tree = RadixTree(alloc, P, policy)
    tiers = None
    if host_capacity_tokens >= P or disk_capacity_tokens >= P or remote_capacity_tokens >= P:
        tiers = _sim_tiers(
            tree, alloc, host_capacity_tokens, disk_capacity_tokens, remote_capacity_tokens
        )
    by_tier = {"device": 0, "host": 0, "disk": 0}
    if remote_capacity_tokens >= P:
        by_tier["remote"] = 0
    match, reusable_rows = tree.match_prefix, tree.reusable_rows
    lock, unlock, insert, evict = tree.lock, tree.unlock, tree.insert, tree.evict
    allocate, free = alloc.allocate, alloc.free
    hits = 0
    prompt_tokens = 0
    evicted = 0
    done = 0
    t0 = time.perf_counter()
    for req in requests:
        seq = req.seq
        prompt_tokens += len(req.prompt)
        m = match(req.prompt, req.salt)
        node = m.node
        lock(node)
        mpages = m.pages
        if tiers is not None:
            loaded = tiers.load_prefix(req.prompt, req.salt, m)
            node, mpages = loaded.node, loaded.pages
            for tier, n in loaded.by_tier.items():
                by_tier[tier] += n
            hits += loaded.num_tokens
        else:
            by_tier["device"] += m.num_tokens
            hits += m.num_tokens
        mp = len(mpages)
        # the engine copies a partly matching next page's rows (KVManager._reuse_partial_page)
        r = reusable_rows(node, req.prompt, mp * P, req.salt)[1]
        by_tier["device"] += r
        hits += r
        need = (len(seq) + P - 1) // P - mp
        nfree = alloc.num_free
        if need > nfree:
            evicted += evict((need - nfree) * P)
            nfree = alloc.num_free
            if need > nfree:
                need = nfree
        new = allocate(need)
        full = len(seq) // P
        if full > mp + need:
            full = mp + need
            seq = seq[: full * P]
        ret = insert(seq, mpages + new if mp else new, req.salt)
        # Duplicates: pages we allocated for tokens the tree already had (pages[:mp] are the
        # tree's own, locked and never incref'ed). Then the trailing partial / unused pages.
        if ret // P > mp:
            free(new[: ret // P - mp])
        if full - mp < len(new):
            free(new[full - mp :])
        unlock(node)
        if observer is not None:
            done += 1
            observer.after_request(done, prompt_tokens, hits, by_tier, tree, tiers)
    seconds = time.perf_counter() - t0
    if observer is not None:
        observer.before_flush(tree, tiers)
    if check:
        alloc.check_integrity()
        tree.check_integrity()
        if tiers is not None:
            tiers.check_integrity()
    tree.reset()
    if alloc.num_free != alloc.num_pages:  # a leak is a bug
        raise RuntimeError(f"page leak: {alloc.num_used} pages still used after the replay")
    if tiers is not None and tiers.host is not None and tiers.host.num_used:
        raise RuntimeError(f"host page leak: {tiers.host.num_used} pages still used")
    return {
        "requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": hits,
        "evictions": evicted,
        "seconds": seconds,
        "cached_by_tier": by_tier,
    }


def unbounded_capacity(requests: list[PreparedRequest], page_size: int) -> int:
    """Capacity (tokens) that holds every token of every request: no eviction ever happens."""
    return sum((len(r.seq) + page_size - 1) // page_size for r in requests) * page_size


def simulate(
    trace: Iterable[dict[str, Any]] | list[PreparedRequest],
    capacity_tokens: int | None,
    page_size: int = 1,
    policy: str = "lru",
    host_capacity_tokens: int = 0,
    disk_capacity_tokens: int = 0,
    remote_capacity_tokens: int = 0,
) -> dict[str, Any]:
    """Replay ``trace`` (request dicts or :class:`PreparedRequest`) with ``capacity_tokens`` of KV
    (``None`` = unbounded) and report the cache behaviour.

    Returns a dict with exactly: ``requests``, ``prompt_tokens``, ``cached_tokens`` (hit tokens),
    ``token_hit_rate`` (cached / prompt), ``optimal_hit_rate`` (same trace, unbounded capacity),
    ``evictions`` (tokens evicted), ``tokens_per_second`` (prompt tokens / wall seconds of the
    bounded replay). With a host or disk tier (``host_capacity_tokens`` /
    ``disk_capacity_tokens`` > 0) it also has ``cached_tokens_by_tier`` (``{"device", "host",
    "disk"}`` hit tokens, summing to ``cached_tokens``) and ``hit_rate_by_tier``; with
    ``remote_capacity_tokens`` > 0 the tiers include ``"remote"``.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if policy not in EVICTION_POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {EVICTION_POLICIES}")
    reqs = list(trace)
    if reqs and not isinstance(reqs[0], PreparedRequest):
        reqs = prepare_trace(reqs)
    unbounded = unbounded_capacity(reqs, page_size)
    cap = unbounded if capacity_tokens is None else capacity_tokens
    if capacity_tokens is not None and capacity_tokens < 0:
        raise ValueError(f"capacity_tokens must be >= 0, got {capacity_tokens}")
    if host_capacity_tokens < 0 or disk_capacity_tokens < 0 or remote_capacity_tokens < 0:
        raise ValueError("host/disk/remote capacities must be >= 0")
    tiered = (
        host_capacity_tokens >= page_size
        or disk_capacity_tokens >= page_size
        or remote_capacity_tokens >= page_size
    )
    bounded = replay(
        reqs,
        cap,
        page_size,
        policy,
        host_capacity_tokens,
        disk_capacity_tokens,
        remote_capacity_tokens,
    )
    optimal = (
        bounded if cap >= unbounded and not tiered else replay(reqs, unbounded, page_size, policy)
    )
    pt = bounded["prompt_tokens"]
    extra: dict[str, Any] = {}
    if tiered:
        extra["cached_tokens_by_tier"] = bounded["cached_by_tier"]
        extra["hit_rate_by_tier"] = {
            t: (n / pt if pt else 0.0) for t, n in bounded["cached_by_tier"].items()
        }
    return {
        "requests": bounded["requests"],
        "prompt_tokens": pt,
        "cached_tokens": bounded["cached_tokens"],
        "token_hit_rate": bounded["cached_tokens"] / pt if pt else 0.0,
        "optimal_hit_rate": optimal["cached_tokens"] / pt if pt else 0.0,
        "evictions": bounded["evictions"],
        "tokens_per_second": pt / bounded["seconds"] if bounded["seconds"] > 0 else 0.0,
        **extra,
    }
