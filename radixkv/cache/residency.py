"""Host residency bookkeeping of the radix tree (the offload tiers' side of the tree).

A node's KV lives on the *device* (``value`` is a page list), on the *host* (``host_value`` is a
list of host page ids of ``host_allocator``), or both. ``value is None`` marks a host-only node;
root and namespace nodes are always device resident (empty ``value``). Invariants:

* every non-root node is resident somewhere (``value`` or ``host_value`` is not None);
* device closure: the parent of a device-resident node is device resident, so the host-only
  nodes form subtrees hanging below device nodes, and a host-only node is never locked;
* ``evictable_size`` / ``protected_size`` / ``total_size`` count *device* tokens only;
  ``host_size`` counts tokens that hold host pages (host-only or both);
* a *host leaf* (the host evictable set, same policy order as the device one) is a host-only
  node with no children and ``host_ref == 0`` (``host_protect`` holds it while its KV is being
  loaded back).

Device eviction calls ``on_evict(node, pages)`` while the node is still attached; when the hook
gave the node host pages (``set_host_value``) it stays in the tree as host-only, otherwise it is
dropped together with its host-only subtree. ``evict_host`` drops host leaves, calling
``on_host_evict(node, host_pages)`` first (the disk tier's write hook). ``match_prefix`` walks
through host-only nodes too and reports them in ``MatchResult.host_nodes``; ``insert`` over a
host-only node *adopts* the caller's device pages for it (the caller recomputed that KV).
Without a host tier every node is device resident and all of this reduces to the plain tree.

:class:`HostResidency` is a mixin of :class:`radixkv.cache.radix_tree.RadixTree`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from sortedcontainers import SortedList

from radixkv.cache.tree_node import TreeNode, add_subtree_counts

if TYPE_CHECKING:
    from radixkv.cache.allocator import BlockAllocator

__all__ = ["HostResidency"]


class HostResidency:
    """Mixin: moving a ``RadixTree`` node's KV between device and host pages, host eviction."""

    page_size: int
    root: TreeNode
    host_allocator: BlockAllocator | None
    on_host_evict: Callable[[TreeNode, list[int]], None] | None
    num_host_evicted_tokens: int
    _host_leaves: SortedList
    _host_size: int
    _evictable_size: int

    @property
    def host_size(self) -> int:
        """Tokens held in host pages (host-only nodes and nodes on both tiers)."""
        return self._host_size

    @property
    def host_evictable_size(self) -> int:
        """Tokens in host leaves (host-only, childless, unprotected): evictable right now."""
        return sum(len(e[-1].key) for e in self._host_leaves)

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
        add_subtree_counts(node, len(node.key) - node.sub_tokens, 1 - node.sub_nodes)

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
