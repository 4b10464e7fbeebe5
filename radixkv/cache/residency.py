"""Host residency of the radix tree's nodes (the offload tiers' side of the tree).

A node's KV lives on the *device* (``value`` is a page list), on the *host* (``host_value`` is a
list of host page ids of ``host_allocator``), or both. ``value is None`` marks a host-only node;
root and namespace nodes are always device resident (empty ``value``). Invariants:

* every non-root node is resident somewhere (``value`` or ``host_value`` is not None);
* device closure: the parent of a device-resident node is device resident, so the host-only
  nodes form subtrees hanging below device nodes, and a host-only node is never locked;
* ``evictable_size`` / ``protected_size`` / ``total_size`` count *device* tokens only;
  ``host_size`` counts tokens that hold host pages (host-only or both);
* a *host leaf* (the host evictable set, same policy order as the device one) is a host-only
  node with no children and ``host_ref == 0`` (``protect`` holds it while its KV is being
  loaded back).

Device eviction calls ``on_evict(node, pages)`` while the node is still attached; when the hook
gave the node host pages (:meth:`HostResidency.set_host_value`) it stays in the tree as
host-only, otherwise it is dropped together with its host-only subtree. :meth:`HostResidency.evict`
drops host leaves, calling ``on_host_evict(node, host_pages)`` first (the disk tier's write hook).
``match_prefix`` walks through host-only nodes too and reports them in
``MatchResult.host_nodes``; ``insert`` over a host-only node *adopts* the caller's device pages
for it (the caller recomputed that KV). Without a host tier every node is device resident and
all of this reduces to the plain tree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from sortedcontainers import SortedList

from radixkv.cache.eviction import EvictionIndex, check_entry_order
from radixkv.cache.tree_node import TreeNode, add_subtree_counts, detach

if TYPE_CHECKING:
    from radixkv.cache.allocator import BlockAllocator

__all__ = ["HostResidency"]


class HostResidency:
    """Moving a tree's nodes between device and host pages, and host eviction.

    Owns: the ``SortedList`` of the host leaves' sort entries (the device index's policy),
    ``host_size``, ``num_evicted_tokens`` (host tokens evicted so far), and the host hooks
    ``allocator`` / ``on_evict`` (set once by :meth:`attach`, from ``RadixTree.observe``). A node
    loaded back to the device joins the tree's :class:`EvictionIndex` through its methods.

    Invariants (the module docstring's, recomputed by ``RadixTree.check_integrity`` and compared
    with :meth:`leaves`, :attr:`host_size` and :meth:`check_order`): the set holds exactly the
    host leaves, each node's ``host_entry`` is its entry there (``None`` when not in it) and
    equals ``eviction.entry(node)``; ``host_size`` is the sum of ``len(key)`` over nodes with
    ``host_value``; every host page of a node is held (one reference) in ``allocator``.
    """

    def __init__(self, page_size: int, root: TreeNode, eviction: EvictionIndex) -> None:
        self.page_size = page_size
        self.root = root
        self.eviction = eviction
        self.entry = eviction.entry
        self._leaves = SortedList()
        self._size = 0
        self.num_evicted_tokens = 0
        self.allocator: BlockAllocator | None = None
        self.on_evict: Callable[[TreeNode, list[int]], None] | None = None

    def attach(
        self,
        allocator: BlockAllocator | None,
        on_evict: Callable[[TreeNode, list[int]], None] | None,
    ) -> None:
        """The host page pool host copies live in, and the hook called before a node's host
        pages are freed (the disk tier's write)."""
        self.allocator, self.on_evict = allocator, on_evict

    # ------------------------------------------------------------------ views
    @property
    def host_size(self) -> int:
        """Tokens held in host pages (host-only nodes and nodes on both tiers)."""
        return self._size

    @property
    def evictable_size(self) -> int:
        """Tokens in host leaves (host-only, childless, unprotected): evictable right now."""
        return sum(len(e[-1].key) for e in self._leaves)

    def leaves(self) -> list[TreeNode]:
        """The host leaves, in eviction order (a copy)."""
        return [e[-1] for e in self._leaves]

    def check_order(self) -> None:
        """:func:`~radixkv.cache.eviction.check_entry_order` over the host leaves (raises
        ``AssertionError``)."""
        check_entry_order(self._leaves, "host_entry")

    # ------------------------------------------------------------------ host-leaf set
    def _add(self, node: TreeNode) -> None:
        entry = self.entry(node)
        node.host_entry = entry
        self._leaves.add(entry)

    def _remove(self, node: TreeNode) -> None:
        self._leaves.remove(node.host_entry)
        node.host_entry = None

    def touch(self, node: TreeNode, tick: int, hit: bool) -> None:
        """Record an access to host leaf ``node`` at ``tick`` and re-sort it."""
        self._remove(node)
        node.last_access = tick
        if hit:
            node.hit_count += 1
        self._add(node)

    def maybe_leaf(self, node: TreeNode) -> None:
        """Put ``node`` in the host-leaf set when it qualifies and is not there yet."""
        if (
            node.value is None
            and node.host_entry is None
            and not node.children
            and node.host_ref == 0
            and node.parent is not None
        ):
            self._add(node)

    def clear(self, dropped_tokens: int) -> None:
        """A flush detached every host-only node and freed its host pages: empty the set;
        ``dropped_tokens`` host tokens are gone."""
        for entry in self._leaves:
            entry[-1].host_entry = None
        self._leaves.clear()
        self._size -= dropped_tokens

    # ------------------------------------------------------------------ moves
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
            self._remove(node)
        node.value = pages
        self.eviction.discard(parent)
        parent.dev_children += 1
        self.eviction.cached(node)  # host-only nodes are never locked

    def set_host_value(self, node: TreeNode, host_pages: list[int]) -> None:
        """Record that ``node``'s KV is also in ``host_pages`` (the tree takes the caller's
        reference to them, of ``allocator``)."""
        if node.host_value is not None:
            raise ValueError(f"{node!r} is already on the host")
        if node.value is None or node.is_namespace or node is self.root:
            raise ValueError(f"{node!r} cannot take host pages")
        if len(host_pages) * self.page_size != len(node.key):
            raise ValueError(f"{node!r} needs {len(node.key) // self.page_size} host pages")
        node.host_value = host_pages
        self._size += len(node.key)

    def protect(self, node: TreeNode) -> None:
        """Keep host-only ``node`` (and so its ancestors) out of host eviction until
        :meth:`unprotect` (used while its KV is loaded back)."""
        node.host_ref += 1
        if node.host_entry is not None:
            self._remove(node)

    def unprotect(self, node: TreeNode) -> None:
        """Release one :meth:`protect`."""
        if node.host_ref <= 0:
            raise ValueError(f"unprotect of a host node that is not protected: {node!r}")
        node.host_ref -= 1
        self.maybe_leaf(node)

    def _free(self, node: TreeNode) -> None:
        """Drop ``node``'s host pages (the hook is the caller's business)."""
        hv = node.host_value
        if hv is None:
            return
        if node.host_entry is not None:
            self._remove(node)
        node.host_value = None
        self._size -= len(node.key)
        if self.allocator is not None and hv:
            self.allocator.free(hv)

    def device_evicted(self, node: TreeNode) -> None:
        """Device eviction took ``node``'s pages (``value`` is ``None`` now): it stays in the
        tree as host-only when it holds host pages, else it leaves with its host-only subtree."""
        if node.host_value is not None:
            self.maybe_leaf(node)
        else:
            self.drop_subtree(node)
            detach(node, self.page_size)

    def drop_subtree(self, node: TreeNode) -> None:
        """Drop every (host-only) descendant of ``node``: their prefix is gone from the device
        and the host. ``on_evict`` is called for each while the subtree is attached."""
        sub: list[TreeNode] = []
        stack = list(node.children.values())
        while stack:
            x = stack.pop()
            sub.append(x)
            stack.extend(x.children.values())
        if not sub:
            return
        for x in sub:
            if self.on_evict is not None and x.host_value is not None:
                self.on_evict(x, x.host_value)
        for x in sub:
            self.num_evicted_tokens += len(x.key)
            self._free(x)
            x.parent = None
            x.children = {}
        node.children = {}
        add_subtree_counts(node, len(node.key) - node.sub_tokens, 1 - node.sub_nodes)

    def evict(self, num_tokens: int) -> int:
        """Evict host leaves (host-only, childless, unprotected nodes) in policy order until
        >= ``num_tokens`` host tokens are gone or none is left. Calls ``on_evict(node,
        host_pages)`` before freeing the host pages; the nodes leave the tree. Returns the
        number of host tokens evicted."""
        leaves = self._leaves
        P = self.page_size
        evicted = 0
        while evicted < num_tokens and leaves:
            node = leaves[0][-1]
            if self.on_evict is not None:
                self.on_evict(node, node.host_value or [])
            parent = node.parent
            assert parent is not None
            k = len(node.key)
            evicted += k
            self.num_evicted_tokens += k
            self._free(node)
            detach(node, P)
            if parent.is_namespace:
                if not parent.children:
                    detach(parent, P)
            elif parent is not self.root:
                self.maybe_leaf(parent)
        return evicted
