"""The data of a simulator report: hit rate over the replay and the final radix tree.

:class:`Timeline` is a ``replay`` observer: after every request it counts request hits, and every
``every`` requests it records a sample in the dashboard's sample schema
(:mod:`radixkv.server.stats_history`; ``requests`` is the x axis of a replay, ``t`` is the wall
time); before the replay flushes the tree it snapshots it with
:func:`~radixkv.cache.tree_view.tree_view`. :func:`simulation_report` runs one observed replay
and returns the document ``radixkv simulate --html`` inlines into the dashboard page.

Snippets: a trace given as ``text`` is tokenized by :func:`~radixkv.sim.simulator.hash_tokenize`
(one id per word); :func:`hash_vocabulary` inverts it for the words of the trace, so the tree
shows words. Output ids made up for requests without outputs show as ``·``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from radixkv.cache.radix_tree import RadixTree
from radixkv.cache.tree_view import tree_view
from radixkv.sim.simulator import PreparedRequest, hash_tokenize, replay

__all__ = ["Timeline", "hash_vocabulary", "simulation_report", "vocabulary_decoder"]


def hash_vocabulary(trace: Iterable[dict[str, Any]]) -> dict[int, str]:
    """``hash_tokenize`` id -> word for every word of the trace's ``text`` / ``output_text``."""
    vocab: dict[int, str] = {}
    for req in trace:
        for field in ("text", "output_text"):
            text = req.get(field)
            if isinstance(text, str):
                for w, t in zip(text.split(), hash_tokenize(text)):
                    vocab.setdefault(t, w)
    return vocab


def vocabulary_decoder(vocab: dict[int, str]) -> Callable[[Sequence[int]], str]:
    """Token ids -> text: known words joined by spaces, other ids as ``<id>``, ``·`` for the
    simulator's made-up output ids (negative)."""

    def decode(ids: Sequence[int]) -> str:
        return " ".join(vocab.get(t) or ("·" if t < 0 else f"<{t}>") for t in ids)

    return decode


class Timeline:
    """A ``replay`` observer: samples every ``every`` requests and the final tree view."""

    def __init__(
        self,
        total: int,
        every: int,
        *,
        max_nodes: int = 300,
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        self.total = total
        self.every = max(1, every)
        self.max_nodes = max_nodes
        self.decode = decode
        self.samples: list[dict[str, Any]] = []
        self.tree: dict[str, Any] | None = None
        self.requests_hit = 0
        self._hits = 0

    def after_request(
        self,
        done: int,
        prompt_tokens: int,
        hits: int,
        by_tier: dict[str, int],
        tree: RadixTree,
        tiers: Any,
    ) -> None:
        """Called by ``replay`` after request number ``done`` (1-based) with its running sums."""
        if hits > self._hits:
            self.requests_hit += 1
        self._hits = hits
        if done % self.every and done != self.total:
            return
        P = tree.page_size
        alloc = tree.allocator
        tier_occ: dict[str, Any] = {
            "device": {
                "used": alloc.num_used * P if alloc is not None else tree.total_size,
                "cached": tree.total_size,
                "capacity": alloc.num_pages * P if alloc is not None else 0,
            }
        }
        counters = getattr(tiers, "counters", {}) if tiers is not None else {}
        host = getattr(tiers, "host", None)
        if host is not None:
            tier_occ["host"] = {"used": host.num_used * P, "capacity": host.num_pages * P}
        disk = getattr(tiers, "disk", None)
        if disk is not None:
            d = disk.stats()
            tier_occ["disk"] = {
                "used_bytes": d["bytes"],
                "capacity_bytes": d["capacity_bytes"],
                "files": d["files"],
            }
        self.samples.append(
            {
                "seq": len(self.samples) + 1,
                "t": time.time(),
                "prompt_tokens": prompt_tokens,
                "cached_tokens": hits,
                "cached_by_tier": {
                    k: by_tier.get(k, 0) for k in ("device", "host", "disk", "remote")
                },
                "requests": done,
                "requests_hit": self.requests_hit,
                "generated_tokens": 0,  # a simulation runs no model: no token is generated
                "running": 0,
                "waiting": 0,
                "tiers": tier_occ,
                "evicted_tokens": {
                    "device": tree.num_evicted_tokens,
                    "host": tree.num_host_evicted_tokens,
                },
                "loads": {k: counters.get(f"{k}_loads", 0) for k in ("host", "disk", "remote")},
                "load_pages": {
                    k: counters.get(f"{k}_load_pages", 0) for k in ("host", "disk", "remote")
                },
            }
        )

    def before_flush(self, tree: RadixTree, tiers: Any) -> None:
        """Called by ``replay`` after the last request, before the tree is flushed."""
        self.tree = tree_view(tree, max_nodes=self.max_nodes, decode=self.decode, tiers=tiers)


def simulation_report(
    requests: list[PreparedRequest],
    capacity_tokens: int,
    *,
    page_size: int = 1,
    policy: str = "lru",
    host_capacity_tokens: int = 0,
    disk_capacity_tokens: int = 0,
    remote_capacity_tokens: int = 0,
    samples: int = 200,
    max_nodes: int = 300,
    decode: Callable[[Sequence[int]], str] | None = None,
    title: str = "radixkv simulation",
    summary: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Replay ``requests`` once more with a :class:`Timeline` and return the report document
    ``{"title", "stats", "history", "tree"}`` of :func:`radixkv.server.dashboard.render_page`
    (about ``samples`` samples; ``summary`` goes into ``stats``)."""
    timeline = Timeline(
        len(requests), max(1, len(requests) // max(1, samples)), max_nodes=max_nodes, decode=decode
    )
    res = replay(
        requests,
        capacity_tokens,
        page_size,
        policy,
        host_capacity_tokens,
        disk_capacity_tokens,
        remote_capacity_tokens,
        observer=timeline,
    )
    stats = {
        "model": title,
        "capacity_tokens": capacity_tokens,
        "page_size": page_size,
        "policy": policy,
        "requests_total": res["requests"],
        "prompt_tokens_total": res["prompt_tokens"],
        "cached_tokens_total": res["cached_tokens"],
        "hit_rate": res["cached_tokens"] / res["prompt_tokens"] if res["prompt_tokens"] else 0.0,
        **(summary or {}),
    }
    return {"title": title, "stats": stats, "history": timeline.samples, "tree": timeline.tree}
