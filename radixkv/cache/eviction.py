"""The device side of eviction: which nodes may be evicted, in which order, and how many device
tokens are evictable or protected (:class:`EvictionIndex`, one per :class:`RadixTree`).

Only *leaves* can be evicted: a device leaf is an attached, unlocked, non-namespace,
device-resident node with no device-resident child (``dev_children == 0``). The leaves are kept
in a sortedcontainers ``SortedList`` of sort entries ordered by policy and kept up to date
incrementally as nodes change (never rebuilt):

* ``lru``: ``(last_access, uid, node)``, least recently matched/inserted first;
* ``lfu``: ``(hit_count, last_access, uid, node)``, fewest hits first, then least recent;
* ``fifo``: ``(created, uid, node)``, oldest first (a split keeps the original order).

A node's current entry is stored on it (``evict_entry``; ``host_entry`` for the host leaves of
:class:`~radixkv.cache.residency.HostResidency`, which orders them with the same
:func:`sort_entry_fn`) so it can be removed in O(log n) before its sort fields change.
``last_access`` is a logical tick, so the order is deterministic. :meth:`EvictionIndex.evict` is
the device eviction loop (``RadixTree.evict``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from sortedcontainers import SortedList

from radixkv.cache.tree_node import TreeNode, detach

if TYPE_CHECKING:
    from radixkv.cache.allocator import BlockAllocator

__all__ = ["EVICTION_POLICIES", "EvictionIndex", "check_entry_order", "sort_entry_fn"]

EVICTION_POLICIES = ("lru", "lfu", "fifo")


def _lru(node: TreeNode) -> tuple:
    return (node.last_access, node.uid, node)


def _lfu(node: TreeNode) -> tuple:
    return (node.hit_count, node.last_access, node.uid, node)


def _fifo(node: TreeNode) -> tuple:
    return (node.created, node.uid, node)


_SORT_ENTRY: dict[str, Callable[[TreeNode], tuple]] = {"lru": _lru, "lfu": _lfu, "fifo": _fifo}


def sort_entry_fn(policy: str) -> Callable[[TreeNode], tuple]:
    """The sort entry of a node under ``policy`` (one of :data:`EVICTION_POLICIES`)."""
    return _SORT_ENTRY[policy]


def check_entry_order(entries: Iterable[tuple], field: str) -> None:
    """Raise ``AssertionError`` unless ``entries`` (a leaf set, in its iteration order) ascend
    strictly by their sort fields and each is the entry stored on its node as ``field``
    (``evict_entry`` / ``host_entry``). Whether an entry is stale (its node's sort fields
    changed) is ``check_tree_integrity``'s own check."""
    prev: tuple | None = None
    for e in entries:
        node = e[-1]
        assert getattr(node, field) is e, f"{node!r}: its {field} is not its entry in the set"
        # the uid makes the fields unique, so the node itself is never compared
        assert prev is None or prev[:-1] < e[:-1], f"{node!r} out of order in the leaf set"
        prev = e


class EvictionIndex:
    """The device evictable-leaf order of one tree and its device token counts.

    Owns: the ``SortedList`` of the device leaves' sort entries, ``evictable_size``,
    ``protected_size`` and ``num_evicted_tokens``. Every change to them goes through a method
    here; the tree calls them as nodes are inserted, locked, unlocked, touched, loaded back
    (:class:`~radixkv.cache.residency.HostResidency`), evicted (:meth:`evict`) and flushed.
    ``root``, ``page_size`` and ``allocator`` are the tree's, given at construction.

    Invariants (``RadixTree.check_integrity`` recomputes them and compares with :meth:`leaves`,
    :attr:`evictable_size`, :attr:`protected_size`, :meth:`check_order`):

    * the set holds exactly the device leaves (module docstring), once each; a node's
      ``evict_entry`` is its entry in the set (``None`` when not in it) and equals
      ``entry(node)`` (a node is re-sorted, :meth:`touch`, whenever its sort fields change);
    * ``evictable_size`` is the sum of ``len(key)`` over unlocked device-resident nodes,
      ``protected_size`` over locked ones (``lock_ref > 0``); host-only nodes count in neither;
    * ``num_evicted_tokens`` only grows: device tokens evicted by :meth:`evict` so far.
    """

    def __init__(
        self, policy: str, root: TreeNode, page_size: int, allocator: BlockAllocator | None
    ) -> None:
        self.policy = policy
        self.root = root
        self.page_size = page_size
        self.allocator = allocator
        #: The policy's sort entry of a node (:func:`sort_entry_fn`).
        self.entry = sort_entry_fn(policy)
        self._leaves = SortedList()
        self._evictable = 0
        self._protected = 0
        self.num_evicted_tokens = 0

    # ------------------------------------------------------------------ views
    @property
    def evictable_size(self) -> int:
        """Device tokens in unlocked nodes."""
        return self._evictable

    @property
    def protected_size(self) -> int:
        """Device tokens in locked nodes."""
        return self._protected

    def __len__(self) -> int:
        return len(self._leaves)

    def leaves(self) -> list[TreeNode]:
        """The device leaves, in eviction order (a copy)."""
        return [e[-1] for e in self._leaves]

    def check_order(self) -> None:
        """:func:`check_entry_order` over the device leaves (raises ``AssertionError``)."""
        check_entry_order(self._leaves, "evict_entry")

    # ------------------------------------------------------------------ leaf set
    def add(self, node: TreeNode) -> None:
        """``node`` became a device leaf."""
        entry = self.entry(node)
        node.evict_entry = entry
        self._leaves.add(entry)

    def discard(self, node: TreeNode) -> None:
        """``node`` is no device leaf any more (it may not have been one)."""
        if node.evict_entry is not None:
            self._leaves.remove(node.evict_entry)
            node.evict_entry = None

    def touch(self, node: TreeNode, tick: int, hit: bool) -> None:
        """Record an access to leaf ``node`` at ``tick`` (a hit counts in ``hit_count``) and
        re-sort it."""
        leaves = self._leaves
        leaves.remove(node.evict_entry)
        node.last_access = tick
        if hit:
            node.hit_count += 1
        entry = self.entry(node)
        node.evict_entry = entry
        leaves.add(entry)

    def clear(self, dropped_tokens: int) -> None:
        """A flush detached every unlocked node: empty the set; ``dropped_tokens`` evictable
        device tokens are gone."""
        for entry in self._leaves:
            entry[-1].evict_entry = None
        self._leaves.clear()
        self._evictable -= dropped_tokens

    # ------------------------------------------------------------------ counts
    def cached(self, node: TreeNode) -> None:
        """Unlocked ``node`` became device resident (loaded back from the host): its tokens are
        evictable, and it is indexed when it is a leaf."""
        self._evictable += len(node.key)
        if node.dev_children == 0 and node.lock_ref == 0:
            self.add(node)

    def inserted(self, parent: TreeNode, leaf: TreeNode) -> None:
        """New device ``leaf`` (unlocked) was attached below ``parent``, which is no leaf now."""
        if parent.evict_entry is not None:
            self._leaves.remove(parent.evict_entry)
            parent.evict_entry = None
        self._evictable += len(leaf.key)
        entry = self.entry(leaf)
        leaf.evict_entry = entry
        self._leaves.add(entry)

    def lock(self, node: TreeNode | None) -> None:
        """One more lock (``lock_ref``) on ``node`` and each ancestor below the root; a node
        taking its first lock moves its tokens to ``protected_size`` and leaves the set."""
        root = self.root
        leaves = self._leaves
        while node is not None and node is not root:
            if node.lock_ref == 0:
                k = len(node.key)
                self._evictable -= k
                self._protected += k
                if node.evict_entry is not None:
                    leaves.remove(node.evict_entry)
                    node.evict_entry = None
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode | None) -> None:
        """One lock less on ``node`` and each ancestor below the root; a node losing its last
        lock makes its tokens evictable again and joins the set when it is a leaf."""
        root = self.root
        while node is not None and node is not root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                k = len(node.key)
                self._evictable += k
                self._protected -= k
                if node.dev_children == 0 and not node.is_namespace:
                    self.add(node)
            node = node.parent

    # ------------------------------------------------------------------ eviction
    def evict(
        self,
        num_tokens: int,
        on_evict: Callable[[TreeNode, list[int]], None] | None,
        evicted_to_host: Callable[[TreeNode], None],
    ) -> int:
        """Evict leaves in policy order until >= ``num_tokens`` device tokens are gone or none is
        left. Calls ``on_evict(node, pages)`` (node still attached; the tiers' hook) before
        freeing a node's device pages to the allocator; a node with host pages or host-only
        children then goes to ``evicted_to_host(node)`` (:meth:`HostResidency.device_evicted
        <radixkv.cache.residency.HostResidency.device_evicted>`: it stays host-only or leaves
        with its host-only subtree), any other just leaves the tree. Parents left without device
        children join the set. Returns the number of device tokens evicted."""
        leaves = self._leaves
        alloc = self.allocator
        root = self.root
        P = self.page_size
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
            self._evictable -= k
            if on_evict is not None:
                on_evict(node, pages)
            node.value = None
            parent.dev_children -= 1
            if node.host_value is None and not node.children:
                detach(node, P)  # nothing of it on the host: it just leaves the tree
            else:
                evicted_to_host(node)
            if alloc is not None:
                alloc.free(pages)
            if parent is not root and parent.dev_children == 0 and parent.lock_ref == 0:
                if parent.is_namespace:
                    if not parent.children:
                        detach(parent, P)
                else:
                    self.add(parent)
        return evicted
