"""Where the router sends a request: per-replica approximate prefix trees and the policies.

The router never sees token ids of its replicas' tokenizer, so (like SGLang's router) it matches
**characters**: a request's *routing key* is its prompt text (``/v1/completions``, ``/generate``
``text``), its rendered messages (``/v1/chat/completions``: ``role``, NUL, content, SOH per
message, so one conversation's turns extend each other) or its token ids when it sends ids; a
character is its code point. Keys live in a namespace per kind, *tenant* (the cache salt the
router derived from the caller's API key under ``--salt-from-api-key``, else None) and client
salt (``cache_salt`` / ``salt``), since the replicas never share a prefix across tenants or
salts either: one tenant's keys never match in another tenant's namespace, whatever salt it
sends.

Each replica has a :class:`ReplicaPrefixIndex`: a :class:`~radixkv.cache.radix_tree.RadixTree`
in simulation mode (page size 1, no allocator) over those code points, holding the keys of the
requests that replica answered, bounded by ``capacity`` characters (LRU eviction). It is
approximate: the replica may have evicted a prefix the router still remembers, and it learns
nothing of what the replica caches by itself.

:class:`CacheAwarePolicy` is SGLang's ``cache_aware`` rule: when the in-flight load is
imbalanced (``max - min > balance_abs_threshold`` and ``max > min * balance_rel_threshold``) send
to the least loaded replica; otherwise to the replica with the longest cached prefix when it
covers more than ``cache_threshold`` of the key, else to the replica whose tree is smallest (a
new prefix goes where there is most room), ties to the least loaded. The policies only *read*
the trees (:meth:`ReplicaPrefixIndex.match`); the router inserts the key into the chosen
replica's tree once that replica answered 2xx, so a refused or failed request leaves no trace.
:class:`RoundRobinPolicy` cycles through the healthy replicas.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixkv.cache.allocator import IntegrityError
from radixkv.cache.radix_tree import RadixTree

__all__ = [
    "POLICIES",
    "CacheAwarePolicy",
    "ReplicaPrefixIndex",
    "ReplicaState",
    "RoundRobinPolicy",
    "RouteKey",
    "make_policy",
    "route_key",
]

POLICIES = ("cache_aware", "round_robin")


@dataclass(frozen=True)
class RouteKey:
    """What a request is matched on: ``units`` (code points or token ids) in ``namespace``."""

    units: tuple[int, ...]
    namespace: Hashable

    def __len__(self) -> int:
        return len(self.units)


def _text_units(text: str) -> tuple[int, ...]:
    return tuple(ord(c) for c in text)


def _message_text(messages: Sequence[Any]) -> str:
    parts: list[str] = []
    for m in messages:
        if not isinstance(m, Mapping):
            continue
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        parts.append(f"{m.get('role', '')}\x00{content or ''}\x01")
    return "".join(parts)


def route_key(path: str, body: Any, tenant: str | None = None) -> RouteKey:
    """The routing key of a request body sent to ``path`` by ``tenant`` (its cache salt, None
    without tenancy); an empty key when there is no prompt the router understands (such a
    request still goes somewhere, by load)."""
    if not isinstance(body, Mapping):
        return RouteKey((), ("none", tenant, None))
    salt = body.get("cache_salt") if path.startswith("/v1/") else body.get("salt")
    salt = salt if isinstance(salt, str) else None
    prompt: Any = None
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if isinstance(messages, list):
            return RouteKey(_text_units(_message_text(messages)), ("chat", tenant, salt))
    elif path.endswith("/completions"):
        prompt = body.get("prompt")
    elif path.endswith("/generate"):
        prompt = body.get("text") if body.get("text") is not None else body.get("input_ids")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch: route by its first prompt
    if isinstance(prompt, str):
        return RouteKey(_text_units(prompt), ("text", tenant, salt))
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return RouteKey(tuple(prompt), ("ids", tenant, salt))
    return RouteKey((), ("none", tenant, salt))


class ReplicaPrefixIndex:
    """The keys sent to one replica, as a radix tree bounded by ``capacity`` units (LRU).

    Invariants (:meth:`check_integrity`): the tree passes its own check and holds at most
    ``capacity`` units.
    """

    def __init__(self, capacity: int = 1 << 20) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.tree = RadixTree(None, page_size=1, eviction_policy="lru")
        self._next_id = 0  # the tree wants distinct page ids: hand out fresh ones

    def match(self, key: RouteKey) -> int:
        """Units of ``key`` already sent here (no LRU refresh)."""
        if not key.units:
            return 0
        n, _ = self.tree.peek_prefix(key.units, salt=key.namespace)
        return n

    def insert(self, key: RouteKey) -> None:
        """Remember ``key`` (refreshing its prefix), evicting least recently used keys."""
        if not key.units:
            return
        units = key.units[: self.capacity]
        start, self._next_id = self._next_id, self._next_id + len(units)
        self.tree.insert(units, range(start, self._next_id), salt=key.namespace)
        over = self.tree.total_size - self.capacity
        if over > 0:
            self.tree.evict(over)

    @property
    def size(self) -> int:
        return self.tree.total_size

    def clear(self) -> None:
        self.tree.reset()

    def check_integrity(self) -> None:
        self.tree.check_integrity()
        if self.tree.total_size > self.capacity:
            raise IntegrityError(f"router tree holds {self.tree.total_size} > {self.capacity}")


@dataclass
class ReplicaState:
    """The router's view of one replica."""

    url: str
    index: ReplicaPrefixIndex = field(default_factory=ReplicaPrefixIndex)
    healthy: bool = True
    in_flight: int = 0
    requests: int = 0
    matched_units: int = 0
    key_units: int = 0
    errors: int = 0


class RoundRobinPolicy:
    """The next healthy replica in turn."""

    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def select(
        self, replicas: Sequence[ReplicaState], key: RouteKey, exclude: Iterable[int] = ()
    ) -> tuple[int | None, int]:
        """``(replica index, matched units)``; index ``None`` when no replica can take it."""
        skip = set(exclude)
        live = [i for i, r in enumerate(replicas) if r.healthy and i not in skip]
        if not live:
            return None, 0
        i = live[next(self._turn) % len(live)]
        return i, replicas[i].index.match(key)


class CacheAwarePolicy:
    """SGLang's cache-aware rule (see the module docstring)."""

    name = "cache_aware"

    def __init__(
        self,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.0001,
    ) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1.0:
            raise ValueError("balance thresholds: abs >= 0 and rel >= 1.0")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def select(
        self, replicas: Sequence[ReplicaState], key: RouteKey, exclude: Iterable[int] = ()
    ) -> tuple[int | None, int]:
        """``(replica index, matched units)``; index ``None`` when no replica can take it."""
        skip = set(exclude)
        live = [i for i, r in enumerate(replicas) if r.healthy and i not in skip]
        if not live:
            return None, 0
        loads = [replicas[i].in_flight for i in live]
        lo, hi = min(loads), max(loads)
        matches = {i: replicas[i].index.match(key) for i in live}
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            i = min(live, key=lambda j: (replicas[j].in_flight, -matches[j]))
            return i, matches[i]
        best = max(live, key=lambda j: (matches[j], -replicas[j].in_flight))
        if key.units and matches[best] > self.cache_threshold * len(key.units):
            return best, matches[best]
        i = min(live, key=lambda j: (replicas[j].index.size, replicas[j].in_flight))
        return i, matches[i]


def make_policy(name: str, **knobs: Any) -> CacheAwarePolicy | RoundRobinPolicy:
    """The policy called ``name`` (one of :data:`POLICIES`)."""
    if name == "cache_aware":
        return CacheAwarePolicy(**knobs)
    if name == "round_robin":
        return RoundRobinPolicy()
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
