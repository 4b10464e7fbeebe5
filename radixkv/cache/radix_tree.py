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
and ``total_size`` is their sum. Only evictable *leaves* can be evicted; they are kept in a
sortedcontainers ``SortedList`` ordered by policy (``lru``: last access; ``lfu``: hit count then
last access; ``fifo``: creation order), updated incrementally as nodes change
(:mod:`radixkv.cache.eviction`).

``last_access`` is a logical timestamp (an operation counter), not wall time: eviction order is
deterministic; the ``clock`` is only for pin expiry. The offload tiers hook evictions and inserts
through :meth:`RadixTree.observe` (:class:`TreeEvents`), once, at assembly.

Where the pieces live
---------------------
``RadixTree`` is the tree proper (walk, split, match, insert, lock, flush) plus three mixins, one
idea each: :mod:`radixkv.cache.eviction` (the evictable-leaf index per policy and ``evict``),
:mod:`radixkv.cache.residency` (host residency for the offload tiers: ``set_host_value``,
``host_protect``, ``evict_host``; its docstring states the residency invariants),
:mod:`radixkv.cache.pins` (``pin`` / ``unpin``: locks with an expiry). The plain data types are in
:mod:`radixkv.cache.tree_node`, ``check_integrity`` in :mod:`radixkv.cache.tree_integrity`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from sortedcontainers import SortedList

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
    collect_pages,
    common_prefix_len,
    count_nodes,
)

__all__ = ["EVICTION_POLICIES", "MatchResult", "RadixTree", "TreeEvents", "TreeNode"]


class RadixTree(EvictionIndex, HostResidency, Pins, PartialPages):
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
        self.on_evict = self.on_host_evict = self.on_insert = None  # set once, by observe()
        self.host_allocator: BlockAllocator | None = None
        self._observed = False
        #: Device tokens evicted so far; host tokens evicted so far.
        self.num_evicted_tokens = 0
        self.num_host_evicted_tokens = 0
        self._uids = itertools.count(1)
        self._tick = 0
        self.root = TreeNode([], [], None, 0)
        self._leaves: SortedList = SortedList()
        self._host_leaves: SortedList = SortedList()
        self._host_size = 0
        self._evictable_size = 0
        self._protected_size = 0
        self._pin_heap: list[tuple[float, int, TreeNode]] = []
        self._num_pins = 0

    def observe(self, events: TreeEvents) -> None:
        """Hook the tree's one observer (the offload tiers); a second raises ``RuntimeError``."""
        if self._observed:
            raise RuntimeError("this tree already has an observer (one tier stack per tree)")
        self._observed, self.host_allocator = True, events.host_allocator
        self.on_evict, self.on_host_evict = events.on_evict, events.on_host_evict
        self.on_insert = events.on_insert

    # ================================================================== sizes
    @property
    def evictable_size(self) -> int:
        """Tokens in unlocked, unpinned nodes (evictable once their descendants are gone)."""
        self._expire_pins()
        return self._evictable_size

    @property
    def protected_size(self) -> int:
        """Tokens in nodes with ``lock_ref > 0`` (locked by a request or pinned)."""
        self._expire_pins()
        return self._protected_size

    @property
    def total_size(self) -> int:
        """Tokens cached in the tree (``evictable_size + protected_size``)."""
        return self._evictable_size + self._protected_size

    # ================================================================== helpers
    def _child_key(self, key: list[int]) -> Any:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

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

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Split ``child`` after ``m`` tokens (0 < m < len(key), page aligned); return the new
        upper node. The cached prefixes, sizes and the evictable-leaf set do not change."""
        P = self.page_size
        parent = child.parent
        assert parent is not None
        value = child.value
        mid = TreeNode(
            child.key[:m],
            None if value is None else value[: m // P],
            parent,
            next(self._uids),
            child.salt,
        )
        mid.lock_ref = child.lock_ref
        mid.last_access = child.last_access
        mid.hit_count = child.hit_count
        mid.created = child.created
        mid.dev_children = 0 if value is None else 1
        mid.sub_tokens = child.sub_tokens
        mid.sub_nodes = child.sub_nodes + 1
        child.sub_tokens -= m
        add_subtree_counts(parent, 0, 1)
        if child.host_value is not None:
            mid.host_value = child.host_value[: m // P]
            child.host_value = child.host_value[m // P :]
        parent.children[self._child_key(child.key)] = mid
        child.key = child.key[m:]
        if value is not None:
            child.value = value[m // P :]
        child.parent = mid
        mid.children[self._child_key(child.key)] = child
        return mid

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
                child = self._split(child, m)
                end = pos + m
            # touch (re-sort the node if it is an evictable leaf)
            if child.evict_entry is not None:
                self._remove_leaf(child)
                child.last_access = tick
                if hit:
                    child.hit_count += 1
                self._add_leaf(child)
            elif child.host_entry is not None:
                self._remove_host_leaf(child)
                child.last_access = tick
                if hit:
                    child.hit_count += 1
                self._add_host_leaf(child)
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
                self.set_device_value(hn, list(pages[at // P : (at + k) // P]))
                at += k
        if pos < n:
            leaf = TreeNode(
                tokens[pos:n], list(pages[pos // P : n // P]), node, next(self._uids), salt
            )
            leaf.last_access = self._tick
            if node.evict_entry is not None:
                self._remove_leaf(node)
            node.dev_children += 1
            node.children[self._child_key(leaf.key)] = leaf
            add_subtree_counts(node, n - pos, 1)
            self._evictable_size += n - pos
            self._add_leaf(leaf)
            if self.on_insert is not None:
                self.on_insert(leaf)
        return ret

    def lock(self, node: TreeNode | None) -> None:
        """Protect ``node`` and its ancestors from eviction (one lock count each)."""
        root = self.root
        if node is not None and node.value is None:
            raise ValueError(f"cannot lock {node!r}: it is not on the device")
        while node is not None and node is not root:
            if node.lock_ref == 0:
                k = len(node.key)
                self._evictable_size -= k
                self._protected_size += k
                if node.evict_entry is not None:
                    self._remove_leaf(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode | None) -> None:
        """Release one :meth:`lock` of ``node``. Raises ``ValueError`` if it is not locked."""
        root = self.root
        if node is not None and node is not root and node.lock_ref <= 0:
            raise ValueError(f"unlock of a node that is not locked: {node!r}")
        while node is not None and node is not root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                k = len(node.key)
                self._evictable_size += k
                self._protected_size -= k
                if node.dev_children == 0 and not node.is_namespace:
                    self._add_leaf(node)
            node = node.parent

    def _drop_node(self, node: TreeNode) -> None:
        """Detach an unlocked leaf from its parent (no page handling)."""
        parent = node.parent
        assert parent is not None
        if node.value is not None:
            parent.dev_children -= 1
        if node.is_namespace:
            del parent.children[NamespaceKey(node.salt)]
        else:
            del parent.children[self._child_key(node.key)]
        node.parent = None
        add_subtree_counts(parent, -node.sub_tokens, -node.sub_nodes)

    # ------------------------------------------------------------------ flush
    def reset(self) -> int:
        """Flush: drop every unlocked node (pinned nodes are locked, so they stay). Pages go back
        to the allocator; ``on_evict`` is *not* called. Returns the number of tokens dropped."""
        self._expire_pins()
        alloc = self.allocator
        halloc = self.host_allocator
        dropped = 0
        dropped_host = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for ck, child in list(node.children.items()):
                if child.lock_ref == 0:
                    del node.children[ck]
                    sub = [child]
                    while sub:
                        x = sub.pop()
                        sub.extend(x.children.values())
                        x.parent = None
                        x.evict_entry = None
                        x.host_entry = None
                        if x.value is not None:
                            dropped += len(x.key)
                            if alloc is not None and x.value:
                                alloc.free(x.value)
                        if x.host_value is not None:
                            dropped_host += len(x.key)
                            if halloc is not None and x.host_value:
                                halloc.free(x.host_value)
                else:
                    stack.append(child)
            # every child left is locked, hence device resident
            node.dev_children = len(node.children)
        self._leaves.clear()
        self._host_leaves.clear()
        self._evictable_size -= dropped
        self._host_size -= dropped_host
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
        """Recompute everything and compare; raise :class:`IntegrityError` on a mismatch.

        Checks: key length == len(value) * page_size and page aligned (non-empty below
        namespaces), child keys and parent links consistent, each page referenced once in the
        tree and held (refcount >= 1) in the allocator, ``lock_ref >= sum(children lock_ref) +
        pinned``, evictable/protected sizes equal the recomputed sums, the evictable-leaf set is
        exactly the set of unlocked non-namespace leaves with up-to-date sort entries, and the
        pin count matches, ``sub_tokens`` / ``sub_nodes`` equal the recomputed subtree sums.
        Residency: every node is on the device or the host, device closure,
        host-only nodes unlocked, ``dev_children`` counts, host pages (length, uniqueness, held in
        ``host_allocator``), ``host_size`` and the host-leaf set.
        """
        check_tree_integrity(self)

    def __repr__(self) -> str:
        return (
            f"RadixTree(page_size={self.page_size}, policy={self.eviction_policy}, "
            f"total={self.total_size}, evictable={self._evictable_size}, "
            f"protected={self._protected_size})"
        )
