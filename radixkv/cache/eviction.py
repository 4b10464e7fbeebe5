"""The incremental evictable-leaf index of the radix tree, per eviction policy.

Only *leaves* can be evicted: a device leaf is an unlocked, non-namespace, device-resident node
with no device-resident child (``dev_children == 0``); a host leaf is a host-only node with no
children and ``host_ref == 0``. Each set is a sortedcontainers ``SortedList`` of sort entries
ordered by policy and kept up to date incrementally as nodes change (never rebuilt):

* ``lru``: ``(last_access, uid, node)``, least recently matched/inserted first;
* ``lfu``: ``(hit_count, last_access, uid, node)``, fewest hits first, then least recent;
* ``fifo``: ``(created, uid, node)``, oldest first (a split keeps the original order).

A node's current entry is stored on it (``evict_entry`` / ``host_entry``) so it can be removed
in O(log n) before its sort fields change. ``last_access`` is a logical tick, so the order is
deterministic. :class:`EvictionIndex` is a mixin of :class:`radixkv.cache.radix_tree.RadixTree`;
it also holds the device eviction loop (:meth:`EvictionIndex.evict`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from sortedcontainers import SortedList

from radixkv.cache.tree_node import TreeNode

if TYPE_CHECKING:
    from radixkv.cache.allocator import BlockAllocator

__all__ = ["EVICTION_POLICIES", "EvictionIndex"]

EVICTION_POLICIES = ("lru", "lfu", "fifo")


class EvictionIndex:
    """Mixin: the device and host evictable-leaf sets of a ``RadixTree`` and device eviction.

    Invariant (checked by ``check_integrity``): ``_leaves`` holds exactly the device leaves and
    ``_host_leaves`` exactly the host leaves, each with an entry equal to ``_sort_entry(node)``.
    """

    eviction_policy: str
    allocator: BlockAllocator | None
    root: TreeNode
    on_evict: Callable[[TreeNode, list[int]], None] | None
    num_evicted_tokens: int
    _leaves: SortedList
    _host_leaves: SortedList
    _evictable_size: int

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
