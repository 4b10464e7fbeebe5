"""Page-granular radix tree over token ids: the prefix cache (pure Python, no torch).

Structure
---------
Each non-root :class:`TreeNode` holds an edge ``key`` (a list of token ids whose length is a
positive multiple of ``page_size``) and ``value`` (the list of page ids holding those tokens:
``value[i]`` holds ``key[i*P:(i+1)*P]``). The path from a namespace root to a node spells a cached,
page-aligned token prefix; every page-aligned prefix of a cached prefix is cached too.

Children are keyed by their first page: the first token (``page_size == 1``) or the tuple of the
first ``page_size`` tokens, so siblings never share a first page. Every node also keeps the token
and node counts of its subtree (``sub_tokens`` / ``sub_nodes``, updated on the path to the root by
each insert, split and removal) for views that must not walk a big tree.

Namespaces (``salt``): salt ``None`` lives directly under ``root``. Any other hashable salt keys a
separate, empty-keyed *namespace node* under ``root``; its subtree is a separate tree, so requests
with different salts never share a node or page.

Ownership
---------
The tree owns one allocator reference for every page in its nodes' values. ``insert`` takes
ownership of the pages it stores and returns how many leading tokens were already cached: the
caller keeps ``pages[:ret // P]`` and must release whichever of those it owns (see
``docs/design.md``). ``match_prefix`` takes *no* allocator reference: the matched pages stay the
tree's, and ``lock(result.node)`` keeps them from being evicted until ``unlock``.

Locking
-------
``lock(node)`` adds 1 to ``lock_ref`` of ``node`` and of every ancestor below ``root`` (namespace
nodes included). Hence ``lock_ref(n) >= sum(lock_ref(c) for c in children)`` (strictly more when
``n`` itself is a lock handle or pinned). A node is *protected* when ``lock_ref > 0`` and
*evictable* otherwise; ``protected_size`` / ``evictable_size`` are the token sums of those nodes
and ``total_size`` is their sum. Only evictable *leaves* can be evicted, in policy order (``lru``,
``lfu``, ``fifo``: :mod:`radixkv.cache.eviction`).

``last_access`` is a logical timestamp (an operation counter), not wall time: eviction order is
deterministic; the ``clock`` is only for pin expiry. The offload tiers hook evictions and inserts
through :meth:`RadixTree.observe` (:class:`TreeEvents`), once, at assembly.

Where the pieces live
---------------------
``RadixTree`` is the tree proper (nodes, walk, split, match, insert, lock, flush) and owns four
parts, each the one owner of its state (invariants in its docstring): ``eviction``
(:class:`~radixkv.cache.eviction.EvictionIndex`: device leaves in policy order, the device sizes,
the eviction loop), ``residency`` (:class:`~radixkv.cache.residency.HostResidency`: host leaves,
``host_size``, device <-> host moves, host eviction), ``pins`` (:class:`~radixkv.cache.pins.Pins`)
and ``partial`` (:class:`~radixkv.cache.partial_page.PartialPages`, reads only). They reach the
tree only through what it hands them. Node types and structural helpers are in
:mod:`radixkv.cache.tree_node`; ``check_integrity`` is :mod:`radixkv.cache.tree_integrity`,
through the parts' read-only views.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Hashable, Sequence

from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.eviction import EVICTION_POLICIES, EvictionIndex
from radixkv.cache.partial_page import PartialPages
from radixkv.cache.pins import Pins
from radixkv.cache.residency import HostResidency
from radixkv.cache.tree_integrity import check_tree_integrity, recount_subtrees
from radixkv.cache.tree_node import (
    MatchResult,
    NamespaceKey,
    TreeEvents,
    TreeNode,
    add_subtree_counts,
    child_key,
    collect_pages,
    common_prefix_len,
    count_nodes,
    drop_unlocked,
    split_edge,
)

__all__ = ["EVICTION_POLICIES", "MatchResult", "RadixTree", "TreeEvents", "TreeNode"]


class RadixTree:
    """Page-granular radix tree prefix cache; see the module docstring for the invariants.

    Args:
        allocator: pool the tree's pages belong to; evicted/flushed pages are freed to it.
            ``None`` = simulation mode (evicted pages are just dropped).
        page_size: tokens per page (>= 1); all keys and matches are page aligned.
        eviction_policy: ``"lru"`` (default), ``"lfu"`` or ``"fifo"``.
        clock: time source for pin expiry (seconds); injectable for tests.
    """

    def __init__(
        self,
        allocator: BlockAllocator | None,
        page_size: int = 1,
        eviction_policy: str = "lru",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if allocator is not None and allocator.page_size != page_size:
            raise ValueError(f"page_size {page_size} != allocator.page_size {allocator.page_size}")
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"unknown eviction_policy {eviction_policy!r}; choose one of {EVICTION_POLICIES}"
            )
        self.allocator = allocator
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        self.clock = clock
        #: The observer's device hooks (set once, by :meth:`observe`).
        self.on_evict: Callable[[TreeNode, list[int]], None] | None = None
        self.on_insert: Callable[[TreeNode], None] | None = None
        self._observed = False
        self._uids = itertools.count(1)
        self._tick = 0
        self.root = TreeNode([], [], None, 0)
        self.eviction = EvictionIndex(eviction_policy, self.root, page_size, allocator)
        self.residency = HostResidency(page_size, self.root, self.eviction)
        namespace = functools.partial(self._namespace, create=False)
        walk = functools.partial(self._walk, hit=False)
        self.pins = Pins(
            self.root, page_size, clock, self.lock, self.unlock, self.match_prefix, namespace, walk
        )
        self.partial = PartialPages(self.root, page_size, namespace)

    def observe(self, events: TreeEvents) -> None:
        """Hook the tree's one observer (the offload tiers); a second raises ``RuntimeError``."""
        if self._observed:
            raise RuntimeError("this tree already has an observer (one tier stack per tree)")
        self._observed = True
        self.residency.attach(events.host_allocator, events.on_host_evict)
        self.on_evict, self.on_insert = events.on_evict, events.on_insert

    # ================================================================== sizes
    @property
    def evictable_size(self) -> int:
        """Tokens in unlocked, unpinned nodes (evictable once their descendants are gone)."""
        self.pins.expire()
        return self.eviction.evictable_size

    @property
    def protected_size(self) -> int:
        """Tokens in nodes with ``lock_ref > 0`` (locked by a request or pinned)."""
        self.pins.expire()
        return self.eviction.protected_size

    @property
    def total_size(self) -> int:
        """Tokens cached in the tree (``evictable_size + protected_size``)."""
        return self.eviction.evictable_size + self.eviction.protected_size

    @property
    def host_size(self) -> int:
        """Tokens held in host pages (host-only nodes and nodes on both tiers)."""
        return self.residency.host_size

    @property
    def num_evicted_tokens(self) -> int:
        """Device tokens evicted so far."""
        return self.eviction.num_evicted_tokens

    @property
    def num_host_evicted_tokens(self) -> int:
        """Host tokens evicted so far."""
        return self.residency.num_evicted_tokens

    @property
    def host_allocator(self) -> BlockAllocator | None:
        """The host page pool of the observer's host tier (``None``: no host copies)."""
        return self.residency.allocator

    @property
    def tick(self) -> int:
        """The logical clock ``last_access`` is on (one tick per walk)."""
        return self._tick

    # ================================================================== helpers
    def _namespace(self, salt: Hashable, create: bool) -> TreeNode | None:
        if salt is None:
            return self.root
        key = NamespaceKey(salt)
        ns = self.root.children.get(key)
        if ns is None and create:
            ns = TreeNode([], [], self.root, next(self._uids), salt)
            ns.is_namespace = True
            self.root.children[key] = ns
            self.root.dev_children += 1
            self.root.sub_nodes += 1
        return ns

    def split(self, child: TreeNode, m: int) -> TreeNode:
        """Split ``child`` after ``m`` tokens (0 < m < len(key), page aligned); return the new
        upper node. The cached prefixes, sizes and the evictable-leaf sets do not change."""
        return split_edge(child, m, self.page_size, next(self._uids))

    def _walk(
        self,
        start: TreeNode,
        tokens: list[int],
        n: int,
        hit: bool,
        host_path: list[TreeNode] | None = None,
    ) -> tuple[TreeNode, list[int], int]:
        """Follow ``tokens[:n]`` (n page aligned) from ``start``; split the last node when the
        match ends inside its edge. Touches every node passed. Returns (node, pages, pos):
        the deepest node reached, the device pages of the path and the tokens matched.

        The walk goes on through host-only nodes; those are appended to ``host_path`` (when
        given) and contribute no pages. By device closure they all come after the device part,
        so ``len(pages) * P`` is the device-resident length of the match."""
        P = self.page_size
        self._tick += 1
        tick = self._tick
        node = start
        pos = 0
        pages: list[int] = []
        while pos < n:
            ck = tokens[pos] if P == 1 else tuple(tokens[pos : pos + P])
            child = node.children.get(ck)
            if child is None:
                break
            key = child.key
            end = pos + len(key)
            partial = end > n or tokens[pos:end] != key
            if partial:
                m = common_prefix_len(key, tokens, pos, n - pos)
                m -= m % P  # >= P: the first page matched
                child = split_edge(child, m, P, next(self._uids))
                end = pos + m
            # touch (re-sort the node if it is an evictable leaf)
            if child.evict_entry is not None:
                self.eviction.touch(child, tick, hit)
            elif child.host_entry is not None:
                self.residency.touch(child, tick, hit)
            else:
                child.last_access = tick
                if hit:
                    child.hit_count += 1
            if child.value is not None:
                pages += child.value
            elif host_path is not None:
                host_path.append(child)
            pos = end
            node = child
            if partial:
                break
        return node, pages, pos

    # ================================================================== public API
    def match_prefix(self, tokens: Sequence[int], salt: Hashable = None) -> MatchResult:
        """Longest cached prefix of ``tokens`` (truncated to a page multiple) in namespace ``salt``.

        Refreshes ``last_access`` and ``hit_count`` of the nodes on the matched path. When the
        match ends inside an edge the node is split there (like SGLang): this changes the tree's
        shape but not its contents (the set of cached prefixes and their pages), and it makes
        ``result.node``'s path exactly the matched prefix, so ``lock(result.node)`` protects
        exactly ``result.pages``. Takes no allocator reference.
        """
        if type(tokens) is not list:
            tokens = list(tokens)
        n = len(tokens)
        n -= n % self.page_size
        start = self._namespace(salt, create=False)
        if start is None or n == 0:
            return MatchResult([], 0, self.root)
        host_path: list[TreeNode] = []
        node, pages, pos = self._walk(start, tokens, n, hit=True, host_path=host_path)
        host_tokens = 0
        if host_path:
            host_tokens = pos - len(pages) * self.page_size
            node = host_path[0].parent
            pos -= host_tokens
        if node is start:
            node = self.root
        return MatchResult(pages, pos, node, host_path, host_tokens)

    def peek_prefix(self, tokens: Sequence[int], salt: Hashable = None) -> tuple[int, TreeNode]:
        """Length of the longest device-resident cached prefix of ``tokens`` (page aligned) and
        the node it ends in: the deepest node wholly inside it, or, when it ends partway through
        a node's edge (where ``match_prefix`` would split), that node. Changes nothing: no access
        refresh, no hit count, no split. For scheduling decisions, which must not skew eviction
        order."""
        if type(tokens) is not list:
            tokens = list(tokens)
        P = self.page_size
        n = len(tokens) - len(tokens) % P
        start = self._namespace(salt, create=False)
        if start is None or n == 0:
            return 0, self.root
        node, pos = start, 0
        while pos < n:
            child = node.children.get(tokens[pos] if P == 1 else tuple(tokens[pos : pos + P]))
            if child is None or child.value is None:
                break
            key = child.key
            end = pos + len(key)
            if end > n or tokens[pos:end] != key:
                m = common_prefix_len(key, tokens, pos, n - pos)
                return pos + m - m % P, child  # m >= P: the child is keyed by its first page
            pos, node = end, child
        return pos, (self.root if node is start else node)

    def insert(self, tokens: Sequence[int], pages: Sequence[int], salt: Hashable = None) -> int:
        """Cache ``tokens`` (truncated to a page multiple) held in ``pages`` under ``salt``.

        ``pages[i]`` holds tokens ``[i*P, (i+1)*P)``. Returns ``ret``, the number of leading
        tokens already cached (page aligned). Ownership: the tree takes the caller's reference to
        ``pages[ret // P : len(tokens) // P]``; the caller keeps ``pages[:ret // P]`` (the tree
        already has its own pages for them) and must release the ones it owns.
        """
        if type(tokens) is not list:
            tokens = list(tokens)
        P = self.page_size
        n = len(tokens)
        n -= n % P
        if len(pages) < n // P:
            raise ValueError(f"insert of {n} tokens needs {n // P} pages, got {len(pages)}")
        if n == 0:
            return 0
        start = self._namespace(salt, create=True)
        assert start is not None
        host_path: list[TreeNode] = []
        node, dev_pages, pos = self._walk(start, tokens, n, hit=False, host_path=host_path)
        ret = pos
        if host_path:  # the caller computed KV the tree only has on the host: adopt its pages
            at = len(dev_pages) * P
            ret = at
            for hn in host_path:
                k = len(hn.key)
                self.residency.set_device_value(hn, list(pages[at // P : (at + k) // P]))
                at += k
        if pos < n:
            leaf = TreeNode(
                tokens[pos:n], list(pages[pos // P : n // P]), node, next(self._uids), salt
            )
            leaf.last_access = self._tick
            node.dev_children += 1
            node.children[child_key(leaf.key, P)] = leaf
            add_subtree_counts(node, n - pos, 1)
            self.eviction.inserted(node, leaf)
            if self.on_insert is not None:
                self.on_insert(leaf)
        return ret

    def lock(self, node: TreeNode | None) -> None:
        """Protect ``node`` and its ancestors from eviction (one lock count each)."""
        if node is not None and node.value is None:
            raise ValueError(f"cannot lock {node!r}: it is not on the device")
        self.eviction.lock(node)

    def unlock(self, node: TreeNode | None) -> None:
        """Release one :meth:`lock` of ``node``. Raises ``ValueError`` if it is not locked."""
        if node is not None and node is not self.root and node.lock_ref <= 0:
            raise ValueError(f"unlock of a node that is not locked: {node!r}")
        self.eviction.unlock(node)

    # ------------------------------------------------------------------ eviction, pins
    def evict(self, num_tokens: int) -> int:
        """Evict unlocked, unpinned device leaves in policy order until >= ``num_tokens`` device
        tokens are gone or nothing is evictable (:meth:`EvictionIndex.evict
        <radixkv.cache.eviction.EvictionIndex.evict>`: ``on_evict`` first, a node the hook gave
        host pages stays host-only). Returns the number of device tokens evicted."""
        self.pins.expire()
        return self.eviction.evict(num_tokens, self.on_evict, self.residency.device_evicted)

    def evict_host(self, num_tokens: int) -> int:
        """Evict host leaves in policy order until >= ``num_tokens`` host tokens are gone or none
        is left (:meth:`HostResidency.evict <radixkv.cache.residency.HostResidency.evict>`)."""
        return self.residency.evict(num_tokens)

    def pin(
        self,
        tokens: Sequence[int],
        salt: Hashable = None,
        ttl: float | None = None,
        *,
        budget: int | None = None,
        namespace_budget: int | None = None,
    ) -> int:
        """Pin the cached prefix of ``tokens`` until ``ttl`` seconds pass (``None``: until
        unpinned); returns the tokens pinned (:meth:`Pins.pin <radixkv.cache.pins.Pins.pin>`,
        which raises ``PinBudgetError`` past ``budget`` / ``namespace_budget``)."""
        return self.pins.pin(tokens, salt, ttl, budget=budget, namespace_budget=namespace_budget)

    def unpin(self, tokens: Sequence[int], salt: Hashable = None) -> int:
        """Remove every pin on the cached path of ``tokens``; returns the number of pins removed."""
        return self.pins.unpin(tokens, salt)

    def unpin_all(self) -> int:
        """Remove every pin (a flush that drops pins); returns the number removed."""
        return self.pins.unpin_all()

    def pinned_tokens(self, salt: Hashable = None, *, whole_tree: bool = False) -> int:
        """Tokens held by pins in the namespace of ``salt`` (``whole_tree``: everywhere)."""
        return self.pins.pinned_tokens(salt, whole_tree=whole_tree)

    @property
    def num_pins(self) -> int:
        """Number of pinned nodes."""
        return self.pins.num_pins

    def expire_pins(self) -> None:
        """Drop pins whose ttl has passed (otherwise done lazily)."""
        self.pins.expire()

    # ------------------------------------------------------------------ partial pages
    def partial_page(
        self, node: TreeNode, tokens: Sequence[int], pos: int, limit: int, salt: Hashable = None
    ) -> tuple[int, int]:
        """:meth:`PartialPages.partial_page <radixkv.cache.partial_page.PartialPages.partial_page>`:
        a device page below ``node`` that starts like ``tokens[pos : pos + limit]``."""
        return self.partial.partial_page(node, tokens, pos, limit, salt)

    def reusable_rows(
        self, node: TreeNode, tokens: Sequence[int], pos: int, salt: Hashable = None
    ) -> tuple[int, int]:
        """:meth:`PartialPages.reusable_rows <radixkv.cache.partial_page.PartialPages.reusable_rows>`:
        the partial page the engine and the simulator reuse, or ``(-1, 0)``."""
        return self.partial.reusable_rows(node, tokens, pos, salt)

    # ------------------------------------------------------------------ flush
    def reset(self) -> int:
        """Flush: drop every unlocked node (pinned nodes are locked, so they stay). Pages go back
        to the allocator; ``on_evict`` is *not* called. Returns the number of tokens dropped."""
        self.pins.expire()
        dropped, dropped_host = drop_unlocked(self.root, self.allocator, self.residency.allocator)
        self.eviction.clear(dropped)
        self.residency.clear(dropped_host)
        recount_subtrees(self.root)
        return dropped

    # ------------------------------------------------------------------ inspection
    def all_pages(self) -> list[int]:
        """Every device page owned by the tree (each appears once)."""
        return collect_pages(self.root, "value")

    def all_host_pages(self) -> list[int]:
        """Every host page owned by the tree (each appears once)."""
        return collect_pages(self.root, "host_value")

    def num_nodes(self) -> int:
        """Number of non-root nodes (namespace nodes included)."""
        return count_nodes(self.root)

    def check_integrity(self) -> None:
        """Recompute everything and compare; raise :class:`IntegrityError` on a mismatch (the
        checks: :func:`~radixkv.cache.tree_integrity.check_tree_integrity`)."""
        check_tree_integrity(self)

    def __repr__(self) -> str:
        return (
            f"RadixTree(page_size={self.page_size}, policy={self.eviction_policy}, "
            f"total={self.total_size}, evictable={self.eviction.evictable_size}, "
            f"protected={self.eviction.protected_size})"
        )
