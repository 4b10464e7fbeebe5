"""Page-granular radix tree over token ids: the prefix cache (pure Python, no torch).

Structure
---------
Each non-root :class:`TreeNode` holds an edge ``key`` (a list of token ids whose length is a
positive multiple of ``page_size``) and ``value`` (the list of page ids holding those tokens:
``value[i]`` holds ``key[i*P:(i+1)*P]``). The path from a namespace root to a node spells a cached,
page-aligned token prefix; every page-aligned prefix of a cached prefix is cached too.

Children are keyed by their first page: the first token (``page_size == 1``) or the tuple of the
first ``page_size`` tokens, so siblings never share a first page.

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
last access; ``fifo``: creation order), updated incrementally as nodes change.

Pins are locks with an expiry: ``pin`` locks the matched node once (re-pinning the same node only
extends its expiry); expired pins are unlocked lazily (on ``evict``, ``pin``, ``unpin``,
``reset``, ``check_integrity`` and the size properties) using the injectable ``clock``.

``last_access`` is a logical timestamp (an operation counter), not wall time, so eviction order is
deterministic; the ``clock`` is only used for pin expiry.

Residency (offload tiers)
-------------------------
A node's KV lives on the *device* (``value`` is a page list), on the *host* (``host_value`` is a
list of host page ids of ``host_allocator``), or both. ``value is None`` marks a host-only node;
root and namespace nodes are always device resident (empty ``value``). Invariants:

* every non-root node is resident somewhere (``value`` or ``host_value`` is not None);
* device closure: the parent of a device-resident node is device resident, so the host-only
  nodes form subtrees hanging below device nodes, and a host-only node is never locked;
* ``evictable_size`` / ``protected_size`` / ``total_size`` count *device* tokens only;
  ``host_size`` counts tokens that hold host pages (host-only or both);
* a *device leaf* (the evictable set) is an unlocked, non-namespace device node with no
  device-resident child (``dev_children == 0``); host-only children do not keep it off the set;
* a *host leaf* (the host evictable set, same policy order) is a host-only node with no children
  and ``host_ref == 0`` (``host_protect`` holds it while its KV is being loaded back).

Device eviction calls ``on_evict(node, pages)`` while the node is still attached; when the hook
gave the node host pages (``set_host_value``) it stays in the tree as host-only, otherwise it is
dropped together with its host-only subtree. ``evict_host`` drops host leaves, calling
``on_host_evict(node, host_pages)`` first (the disk tier's write hook). ``match_prefix`` walks
through host-only nodes too and reports them in ``MatchResult.host_nodes``; ``insert`` over a
host-only node *adopts* the caller's device pages for it (the caller recomputed that KV).
Without a host tier every node is device resident and all of this reduces to the plain tree.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sortedcontainers import SortedList

from radixkv.cache.allocator import BlockAllocator, IntegrityError

__all__ = ["EVICTION_POLICIES", "MatchResult", "RadixTree", "TreeNode"]

EVICTION_POLICIES = ("lru", "lfu", "fifo")


@dataclass(frozen=True)
class _Namespace:
    """Child key of ``root`` for a salted namespace (never equal to a token or page tuple)."""

    salt: Hashable


class TreeNode:
    """One edge of the radix tree.

    Fields (read them freely; mutate only through :class:`RadixTree`):

    * ``key``: token ids of this edge (``len(key) == len(value) * page_size``; empty only for the
      root and namespace nodes);
    * ``value``: page ids holding ``key`` (owned by the tree, one allocator reference each);
    * ``parent`` / ``children``: ``children`` maps the first page of a child's key (token or
      tuple) to the child;
    * ``lock_ref``: locks held on this node or any descendant (0 = evictable);
    * ``last_access``: logical time of the last match/insert through this node;
    * ``hit_count``: number of ``match_prefix`` calls that went through this node;
    * ``created``: creation order (a split keeps the original order for the new upper half);
    * ``pin_expiry``: ``None`` when not pinned, else the clock time the pin expires (``inf`` =
      no ttl); a pinned node holds one lock;
    * ``salt``: namespace of the node; ``is_namespace``: True for namespace nodes;
    * ``host_value``: host page ids holding ``key`` (``None`` when not on the host tier);
      ``value`` is ``None`` when the node is host-only;
    * ``dev_children``: number of device-resident children; ``host_ref``: host protections.
    """

    __slots__ = (
        "key",
        "value",
        "parent",
        "children",
        "lock_ref",
        "last_access",
        "hit_count",
        "created",
        "uid",
        "pin_expiry",
        "salt",
        "is_namespace",
        "evict_entry",
        "host_value",
        "host_entry",
        "host_ref",
        "dev_children",
    )

    def __init__(
        self,
        key: list[int],
        value: list[int] | None,
        parent: TreeNode | None,
        uid: int,
        salt: Hashable = None,
    ) -> None:
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[Any, TreeNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.hit_count = 0
        self.created = uid
        self.uid = uid
        self.pin_expiry: float | None = None
        self.salt = salt
        self.is_namespace = False
        # The tuple currently stored in the tree's evictable-leaf SortedList, or None.
        self.evict_entry: tuple | None = None
        self.host_value: list[int] | None = None
        # The tuple currently stored in the tree's host-leaf SortedList, or None.
        self.host_entry: tuple | None = None
        self.host_ref = 0
        self.dev_children = 0

    @property
    def on_device(self) -> bool:
        """True when the node's KV is in device pages (``value`` is not None)."""
        return self.value is not None

    @property
    def on_host(self) -> bool:
        """True when the node's KV is in host pages (``host_value`` is not None)."""
        return self.host_value is not None

    @property
    def num_tokens(self) -> int:
        """Tokens on this edge."""
        return len(self.key)

    def __repr__(self) -> str:
        dev = "-" if self.value is None else len(self.value)
        host = "" if self.host_value is None else f", host_pages={len(self.host_value)}"
        return (
            f"TreeNode(uid={self.uid}, tokens={len(self.key)}, pages={dev}{host}, "
            f"lock_ref={self.lock_ref}, children={len(self.children)})"
        )


@dataclass
class MatchResult:
    """Result of :meth:`RadixTree.match_prefix`.

    ``pages`` hold the first ``num_tokens`` tokens of the query (``num_tokens == len(pages) *
    page_size``). ``node`` is the lock handle: the node whose path from the namespace root is
    exactly the matched prefix (``tree.root`` when nothing matched; locking root is a no-op).
    Everything here is device resident. ``host_nodes`` are the host-only nodes that continue the
    match (in path order, ``host_tokens`` tokens in all); they are not locked by ``lock(node)``.
    """

    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0
    node: TreeNode | None = None
    host_nodes: list[TreeNode] = field(default_factory=list)
    host_tokens: int = 0


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
        #: Hook called as ``on_evict(node, pages)`` before an evicted node's pages are freed.
        self.on_evict: Callable[[TreeNode, list[int]], None] | None = None
        #: Host page pool (set by the host tier); ``None`` = host pages are just dropped.
        self.host_allocator: BlockAllocator | None = None
        #: Hook ``on_host_evict(node, host_pages)`` before a node's host pages are freed.
        self.on_host_evict: Callable[[TreeNode, list[int]], None] | None = None
        #: Hook ``on_insert(node)`` after ``insert`` created a new device node (write-through).
        self.on_insert: Callable[[TreeNode], None] | None = None
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

    @property
    def host_size(self) -> int:
        """Tokens held in host pages (host-only nodes and nodes on both tiers)."""
        return self._host_size

    @property
    def host_evictable_size(self) -> int:
        """Tokens in host leaves (host-only, childless, unprotected): evictable right now."""
        return sum(len(e[-1].key) for e in self._host_leaves)

    @property
    def num_pins(self) -> int:
        """Number of pinned nodes."""
        self._expire_pins()
        return self._num_pins

    # ================================================================== helpers
    def _child_key(self, key: list[int]) -> Any:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _sort_entry(self, node: TreeNode) -> tuple:
        policy = self.eviction_policy
        if policy == "lru":
            return (node.last_access, node.uid, node)
        if policy == "lfu":
            return (node.hit_count, node.last_access, node.uid, node)
        return (node.created, node.uid, node)

    def _add_leaf(self, node: TreeNode) -> None:
        entry = self._sort_entry(node)
        node.evict_entry = entry
        self._leaves.add(entry)

    def _remove_leaf(self, node: TreeNode) -> None:
        self._leaves.remove(node.evict_entry)
        node.evict_entry = None

    def _add_host_leaf(self, node: TreeNode) -> None:
        entry = self._sort_entry(node)
        node.host_entry = entry
        self._host_leaves.add(entry)

    def _remove_host_leaf(self, node: TreeNode) -> None:
        self._host_leaves.remove(node.host_entry)
        node.host_entry = None

    def _maybe_host_leaf(self, node: TreeNode) -> None:
        """Put ``node`` in the host-leaf set when it qualifies and is not there yet."""
        if (
            node.value is None
            and node.host_entry is None
            and not node.children
            and node.host_ref == 0
            and node.parent is not None
        ):
            self._add_host_leaf(node)

    def _namespace(self, salt: Hashable, create: bool) -> TreeNode | None:
        if salt is None:
            return self.root
        key = _Namespace(salt)
        ns = self.root.children.get(key)
        if ns is None and create:
            ns = TreeNode([], [], self.root, next(self._uids), salt)
            ns.is_namespace = True
            self.root.children[key] = ns
            self.root.dev_children += 1
        return ns

    @staticmethod
    def _common_len(key: list[int], tokens: list[int], start: int, limit: int) -> int:
        """Length of the common prefix of ``key`` and ``tokens[start:]``, at most ``limit``.

        Compares 64-token chunks with C-level list equality, then finishes token by token in
        the first differing chunk.
        """
        n = min(len(key), limit)
        i = 0
        step = 64
        while i < n:
            j = i + step
            if j > n:
                j = n
            if key[i:j] != tokens[start + i : start + j]:
                break
            i = j
        else:
            return n
        while i < n and key[i] == tokens[start + i]:
            i += 1
        return i

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
                m = self._common_len(key, tokens, pos, n - pos)
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
        the deepest node wholly inside it. Changes nothing: no access refresh, no hit count, no
        split. For scheduling decisions, which must not skew eviction order."""
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
                m = self._common_len(key, tokens, pos, n - pos)
                return pos + m - m % P, (self.root if node is start else node)
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
            self._evictable_size += n - pos
            self._add_leaf(leaf)
            if self.on_insert is not None:
                self.on_insert(leaf)
        return ret

    # ------------------------------------------------------------------ residency
    def set_device_value(self, node: TreeNode, pages: list[int]) -> None:
        """Make a host-only ``node`` device resident with ``pages`` (the tree takes the caller's
        reference to them). Its parent must be device resident (device closure)."""
        if node.value is not None:
            raise ValueError(f"{node!r} is already on the device")
        if len(pages) * self.page_size != len(node.key):
            raise ValueError(f"{node!r} needs {len(node.key) // self.page_size} pages")
        parent = node.parent
        assert parent is not None
        if parent.value is None:
            raise ValueError(f"parent of {node!r} is not on the device")
        if node.host_entry is not None:
            self._remove_host_leaf(node)
        node.value = pages
        if parent.evict_entry is not None:
            self._remove_leaf(parent)
        parent.dev_children += 1
        self._evictable_size += len(node.key)  # host-only nodes are never locked
        if node.dev_children == 0 and node.lock_ref == 0:
            self._add_leaf(node)

    def set_host_value(self, node: TreeNode, host_pages: list[int]) -> None:
        """Record that ``node``'s KV is also in ``host_pages`` (the tree takes the caller's
        reference to them, of ``host_allocator``)."""
        if node.host_value is not None:
            raise ValueError(f"{node!r} is already on the host")
        if node.value is None or node.is_namespace or node is self.root:
            raise ValueError(f"{node!r} cannot take host pages")
        if len(host_pages) * self.page_size != len(node.key):
            raise ValueError(f"{node!r} needs {len(node.key) // self.page_size} host pages")
        node.host_value = host_pages
        self._host_size += len(node.key)

    def host_protect(self, node: TreeNode) -> None:
        """Keep host-only ``node`` (and so its ancestors) out of host eviction until
        :meth:`host_unprotect` (used while its KV is loaded back)."""
        node.host_ref += 1
        if node.host_entry is not None:
            self._remove_host_leaf(node)

    def host_unprotect(self, node: TreeNode) -> None:
        """Release one :meth:`host_protect`."""
        if node.host_ref <= 0:
            raise ValueError(f"host_unprotect of an unprotected node {node!r}")
        node.host_ref -= 1
        self._maybe_host_leaf(node)

    def _free_host(self, node: TreeNode) -> None:
        """Drop ``node``'s host pages (the hook is the caller's business)."""
        hv = node.host_value
        if hv is None:
            return
        if node.host_entry is not None:
            self._remove_host_leaf(node)
        node.host_value = None
        self._host_size -= len(node.key)
        if self.host_allocator is not None and hv:
            self.host_allocator.free(hv)

    def _drop_host_subtree(self, node: TreeNode) -> None:
        """Drop every (host-only) descendant of ``node``: their prefix is gone from the device
        and the host. ``on_host_evict`` is called for each while the subtree is attached."""
        sub: list[TreeNode] = []
        stack = list(node.children.values())
        while stack:
            x = stack.pop()
            sub.append(x)
            stack.extend(x.children.values())
        if not sub:
            return
        for x in sub:
            if self.on_host_evict is not None and x.host_value is not None:
                self.on_host_evict(x, x.host_value)
        for x in sub:
            self.num_host_evicted_tokens += len(x.key)
            self._free_host(x)
            x.parent = None
            x.children = {}
        node.children = {}

    def evict_host(self, num_tokens: int) -> int:
        """Evict host leaves (host-only, childless, unprotected nodes) in policy order until
        >= ``num_tokens`` host tokens are gone or none is left. Calls ``on_host_evict(node,
        host_pages)`` before freeing the host pages; the nodes leave the tree. Returns the
        number of host tokens evicted."""
        leaves = self._host_leaves
        evicted = 0
        while evicted < num_tokens and leaves:
            node = leaves[0][-1]
            if self.on_host_evict is not None:
                self.on_host_evict(node, node.host_value or [])
            parent = node.parent
            assert parent is not None
            k = len(node.key)
            evicted += k
            self.num_host_evicted_tokens += k
            self._free_host(node)
            self._drop_node(node)
            if parent.is_namespace:
                if not parent.children:
                    self._drop_node(parent)
            elif parent is not self.root:
                self._maybe_host_leaf(parent)
        return evicted

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
            del parent.children[_Namespace(node.salt)]
        else:
            del parent.children[self._child_key(node.key)]
        node.parent = None

    def evict(self, num_tokens: int) -> int:
        """Evict unlocked, unpinned device leaves in policy order until >= ``num_tokens`` device
        tokens are gone or nothing is evictable. Calls ``on_evict(node, pages)`` (node still
        attached) before freeing a node's device pages to the allocator; a node the hook gave
        host pages stays in the tree as host-only, any other node is dropped with its host-only
        subtree. Parents left without device children join the evictable set.
        Returns the number of device tokens evicted."""
        self._expire_pins()
        leaves = self._leaves
        alloc = self.allocator
        root = self.root
        evicted = 0
        while evicted < num_tokens and leaves:
            node = leaves.pop(0)[-1]
            node.evict_entry = None
            parent = node.parent
            assert parent is not None
            pages = node.value
            assert pages is not None
            k = len(node.key)
            evicted += k
            self.num_evicted_tokens += k
            self._evictable_size -= k
            if self.on_evict is not None:
                self.on_evict(node, pages)
            node.value = None
            parent.dev_children -= 1
            if node.host_value is not None:
                self._maybe_host_leaf(node)
            else:
                self._drop_host_subtree(node)
                self._drop_node(node)
            if alloc is not None:
                alloc.free(pages)
            if parent is not root and parent.dev_children == 0 and parent.lock_ref == 0:
                if parent.is_namespace:
                    if not parent.children:
                        self._drop_node(parent)
                else:
                    self._add_leaf(parent)
        return evicted

    # ------------------------------------------------------------------ pins
    def pin(self, tokens: Sequence[int], salt: Hashable = None, ttl: float | None = None) -> int:
        """Pin the cached prefix of ``tokens``: never evicted until ``ttl`` seconds pass (``None``
        = until :meth:`unpin`). Pinning an already pinned node extends its expiry. Returns the
        number of tokens pinned (0 when nothing is cached)."""
        self._expire_pins()
        res = self.match_prefix(tokens, salt)
        node = res.node
        if node is None or node is self.root:
            return 0
        expiry = math.inf if ttl is None else self.clock() + ttl
        if node.pin_expiry is None:
            self.lock(node)
            self._num_pins += 1
            node.pin_expiry = expiry
        elif expiry > node.pin_expiry:
            node.pin_expiry = expiry
        else:
            return res.num_tokens
        if expiry != math.inf:
            heapq.heappush(self._pin_heap, (expiry, node.uid, node))
        return res.num_tokens

    def unpin(self, tokens: Sequence[int], salt: Hashable = None) -> int:
        """Remove every pin on the cached path of ``tokens``; returns the number of pins removed."""
        self._expire_pins()
        if type(tokens) is not list:
            tokens = list(tokens)
        n = len(tokens) - len(tokens) % self.page_size
        start = self._namespace(salt, create=False)
        if start is None or n == 0:
            return 0
        node, _, _ = self._walk(start, tokens, n, hit=False)
        removed = 0
        while node is not start and node is not None:
            parent = node.parent
            if node.pin_expiry is not None:
                self._unpin_node(node)
                removed += 1
            node = parent
        return removed

    def _unpin_node(self, node: TreeNode) -> None:
        node.pin_expiry = None
        self._num_pins -= 1
        self.unlock(node)

    def _expire_pins(self) -> None:
        heap = self._pin_heap
        if not heap:
            return
        now = self.clock()
        while heap and heap[0][0] <= now:
            expiry, _, node = heapq.heappop(heap)
            # Stale entries: the pin was extended or removed since this entry was pushed.
            if node.pin_expiry == expiry:
                self._unpin_node(node)

    def expire_pins(self) -> None:
        """Drop pins whose ttl has passed (otherwise done lazily)."""
        self._expire_pins()

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
        return dropped

    # ------------------------------------------------------------------ inspection
    def all_pages(self) -> list[int]:
        """Every device page owned by the tree (each appears once)."""
        return self._collect("value")

    def all_host_pages(self) -> list[int]:
        """Every host page owned by the tree (each appears once)."""
        return self._collect("host_value")

    def _collect(self, attr: str) -> list[int]:
        out: list[int] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            pages = getattr(node, attr)
            if pages is not None:
                out += pages
            stack.extend(node.children.values())
        return out

    def num_nodes(self) -> int:
        """Number of non-root nodes (namespace nodes included)."""
        count = 0
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count

    def check_integrity(self) -> None:
        """Recompute everything and compare; raise :class:`IntegrityError` on a mismatch.

        Checks: key length == len(value) * page_size and page aligned (non-empty below
        namespaces), child keys and parent links consistent, each page referenced once in the
        tree and held (refcount >= 1) in the allocator, ``lock_ref >= sum(children lock_ref) +
        pinned``, evictable/protected sizes equal the recomputed sums, the evictable-leaf set is
        exactly the set of unlocked non-namespace leaves with up-to-date sort entries, and the
        pin count matches. Residency: every node is on the device or the host, device closure,
        host-only nodes unlocked, ``dev_children`` counts, host pages (length, uniqueness, held in
        ``host_allocator``), ``host_size`` and the host-leaf set.
        """
        self._expire_pins()
        P = self.page_size
        alloc = self.allocator
        halloc = self.host_allocator
        seen_pages: set[int] = set()
        seen_host: set[int] = set()
        evictable = 0
        protected = 0
        host_size = 0
        pins = 0
        expected_leaves: set[int] = set()
        expected_host_leaves: set[int] = set()

        def fail(msg: str) -> None:
            raise IntegrityError(msg)

        if self.root.key or self.root.value or self.root.lock_ref != 0:
            fail("root must have an empty key/value and lock_ref 0")
        stack: list[TreeNode] = [self.root]
        while stack:
            node = stack.pop()
            child_locks = 0
            dev_children = 0
            for ck, child in node.children.items():
                if child.parent is not node:
                    fail(f"{child!r} parent link is wrong")
                if child.is_namespace:
                    if node is not self.root or ck != _Namespace(child.salt):
                        fail(f"namespace node {child!r} misplaced")
                    if child.key or child.value:
                        fail("namespace node must have an empty key")
                else:
                    if not child.key:
                        fail(f"{child!r} has an empty key")
                    if ck != self._child_key(child.key):
                        fail(f"{child!r} stored under child key {ck!r}, expected first page")
                child_locks += child.lock_ref
                if child.value is not None:
                    dev_children += 1
                    if node.value is None:
                        fail(f"{child!r} is on the device but its parent {node!r} is not")
                stack.append(child)
            if node.dev_children != dev_children:
                fail(f"{node!r}: dev_children {node.dev_children} != recomputed {dev_children}")
            if node is self.root:
                continue
            if len(node.key) % P:
                fail(f"{node!r}: key length not a multiple of page_size {P}")
            if node.value is None and node.host_value is None:
                fail(f"{node!r} is resident on neither the device nor the host")
            if node.value is not None:
                if len(node.key) != len(node.value) * P:
                    fail(f"{node!r}: key length {len(node.key)} != {len(node.value)} pages * {P}")
                for p in node.value:
                    if p in seen_pages:
                        fail(f"page {p} referenced twice in the tree")
                    seen_pages.add(p)
                    if alloc is not None and alloc.refcount(p) < 1:
                        fail(f"tree page {p} has allocator refcount {alloc.refcount(p)}")
            if node.host_value is not None:
                if node.is_namespace:
                    fail(f"namespace node {node!r} holds host pages")
                if len(node.key) != len(node.host_value) * P:
                    fail(f"{node!r}: key length != {len(node.host_value)} host pages * {P}")
                host_size += len(node.key)
                for p in node.host_value:
                    if p in seen_host:
                        fail(f"host page {p} referenced twice in the tree")
                    seen_host.add(p)
                    if halloc is not None and halloc.refcount(p) < 1:
                        fail(f"tree host page {p} has host refcount {halloc.refcount(p)}")
            if node.host_ref < 0:
                fail(f"{node!r}: negative host_ref")
            if node.value is None:
                if node.lock_ref != 0 or node.pin_expiry is not None:
                    fail(f"host-only {node!r} is locked or pinned")
                if node.evict_entry is not None:
                    fail(f"host-only {node!r} is in the device evictable set")
                if not node.children and node.host_ref == 0:
                    expected_host_leaves.add(node.uid)
                if node.host_entry is not None and node.host_entry != self._sort_entry(node):
                    fail(f"{node!r}: stale host eviction entry")
                continue
            if node.host_entry is not None:
                fail(f"device-resident {node!r} is in the host evictable set")
            pinned = 1 if node.pin_expiry is not None else 0
            pins += pinned
            if node.lock_ref < child_locks + pinned:
                fail(
                    f"{node!r}: lock_ref {node.lock_ref} < children locks {child_locks} "
                    f"+ pin {pinned}"
                )
            if node.lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
                if node.dev_children == 0 and not node.is_namespace:
                    expected_leaves.add(node.uid)
            if node.evict_entry is not None and node.evict_entry != self._sort_entry(node):
                fail(f"{node!r}: stale eviction entry {node.evict_entry[:-1]}")
        if evictable != self._evictable_size:
            fail(f"evictable_size {self._evictable_size} != recomputed {evictable}")
        if protected != self._protected_size:
            fail(f"protected_size {self._protected_size} != recomputed {protected}")
        if pins != self._num_pins:
            fail(f"num_pins {self._num_pins} != recomputed {pins}")
        actual = [e[-1] for e in self._leaves]
        actual_ids = {x.uid for x in actual}
        if len(actual_ids) != len(actual) or actual_ids != expected_leaves:
            fail(
                f"evictable leaf set mismatch: extra {sorted(actual_ids - expected_leaves)}, "
                f"missing {sorted(expected_leaves - actual_ids)}"
            )
        for x in actual:
            if x.evict_entry is None or x.parent is None:
                fail(f"{x!r} in the evictable set but detached or without an entry")
        self._leaves._check()
        if host_size != self._host_size:
            fail(f"host_size {self._host_size} != recomputed {host_size}")
        hactual = [e[-1] for e in self._host_leaves]
        hids = {x.uid for x in hactual}
        if len(hids) != len(hactual) or hids != expected_host_leaves:
            fail(
                f"host leaf set mismatch: extra {sorted(hids - expected_host_leaves)}, "
                f"missing {sorted(expected_host_leaves - hids)}"
            )
        for x in hactual:
            if x.host_entry is None or x.parent is None:
                fail(f"{x!r} in the host evictable set but detached or without an entry")
        self._host_leaves._check()

    def __repr__(self) -> str:
        return (
            f"RadixTree(page_size={self.page_size}, policy={self.eviction_policy}, "
            f"total={self.total_size}, evictable={self._evictable_size}, "
            f"protected={self._protected_size})"
        )
