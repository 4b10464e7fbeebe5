"""``RadixTree.check_integrity``: recompute every invariant of the tree from scratch.

The audit walks the nodes and compares what it recounts with what the tree's parts keep, read
through their public read-only views (``eviction.leaves()`` / ``evictable_size`` /
``protected_size``, ``residency.leaves()`` / ``host_size``, ``pins.count``); :class:`TreeState`
names exactly what it reads (and keeps this module free of an import of ``radix_tree``).
"""

from __future__ import annotations

from typing import Protocol

from radixkv.cache.allocator import BlockAllocator, IntegrityError
from radixkv.cache.eviction import EvictionIndex
from radixkv.cache.pins import Pins
from radixkv.cache.residency import HostResidency
from radixkv.cache.tree_node import NamespaceKey, TreeNode, child_key


class TreeState(Protocol):
    """What the audit reads of a :class:`~radixkv.cache.radix_tree.RadixTree`."""

    @property
    def root(self) -> TreeNode: ...
    @property
    def page_size(self) -> int: ...
    @property
    def allocator(self) -> BlockAllocator | None: ...
    @property
    def eviction(self) -> EvictionIndex: ...
    @property
    def residency(self) -> HostResidency: ...
    @property
    def pins(self) -> Pins: ...


__all__ = ["TreeState", "check_tree_integrity", "recount_subtrees", "subtree_counts"]


def check_tree_integrity(tree: TreeState) -> None:
    """The body of :meth:`RadixTree.check_integrity`; raises :class:`IntegrityError` on the first
    mismatch.

    Checks: key length == len(value) * page_size and page aligned (non-empty below namespaces),
    child keys and parent links consistent, each page referenced once in the tree and held
    (refcount >= 1) in the allocator, ``lock_ref >= sum(children lock_ref) + pinned``,
    evictable/protected sizes equal the recomputed sums, the evictable-leaf set is exactly the set
    of unlocked non-namespace leaves with up-to-date sort entries, and the pin count matches,
    ``sub_tokens`` / ``sub_nodes`` equal the recomputed subtree sums. Residency: every node is on
    the device or the host, device closure, host-only nodes unlocked, ``dev_children`` counts,
    host pages (length, uniqueness, held in the host allocator), ``host_size`` and the host-leaf
    set.
    """
    eviction, residency, pins = tree.eviction, tree.residency, tree.pins
    pins.expire()
    P = tree.page_size
    alloc = tree.allocator
    halloc = residency.allocator
    entry = eviction.entry
    seen_pages: set[int] = set()
    seen_host: set[int] = set()
    evictable = 0
    protected = 0
    host_size = 0
    num_pins = 0
    expected_leaves: set[int] = set()
    expected_host_leaves: set[int] = set()

    def fail(msg: str) -> None:
        raise IntegrityError(msg)

    if tree.root.key or tree.root.value or tree.root.lock_ref != 0:
        fail("root must have an empty key/value and lock_ref 0")
    stack: list[TreeNode] = [tree.root]
    while stack:
        node = stack.pop()
        child_locks = 0
        dev_children = 0
        for ck, child in node.children.items():
            if child.parent is not node:
                fail(f"{child!r} parent link is wrong")
            if child.is_namespace:
                if node is not tree.root or ck != NamespaceKey(child.salt):
                    fail(f"namespace node {child!r} misplaced")
                if child.key or child.value:
                    fail("namespace node must have an empty key")
            else:
                if not child.key:
                    fail(f"{child!r} has an empty key")
                if ck != child_key(child.key, P):
                    fail(f"{child!r} stored under child key {ck!r}, expected first page")
            child_locks += child.lock_ref
            if child.value is not None:
                dev_children += 1
                if node.value is None:
                    fail(f"{child!r} is on the device but its parent {node!r} is not")
            stack.append(child)
        if node.dev_children != dev_children:
            fail(f"{node!r}: dev_children {node.dev_children} != recomputed {dev_children}")
        if node is tree.root:
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
            if node.host_entry is not None and node.host_entry != entry(node):
                fail(f"{node!r}: stale host eviction entry")
            continue
        if node.host_entry is not None:
            fail(f"device-resident {node!r} is in the host evictable set")
        pinned = 1 if node.pin_expiry is not None else 0
        num_pins += pinned
        if node.lock_ref < child_locks + pinned:
            fail(
                f"{node!r}: lock_ref {node.lock_ref} < children locks {child_locks} + pin {pinned}"
            )
        if node.lock_ref > 0:
            protected += len(node.key)
        else:
            evictable += len(node.key)
            if node.dev_children == 0 and not node.is_namespace:
                expected_leaves.add(node.uid)
        if node.evict_entry is not None and node.evict_entry != entry(node):
            fail(f"{node!r}: stale eviction entry {node.evict_entry[:-1]}")
    if evictable != eviction.evictable_size:
        fail(f"evictable_size {eviction.evictable_size} != recomputed {evictable}")
    if protected != eviction.protected_size:
        fail(f"protected_size {eviction.protected_size} != recomputed {protected}")
    if num_pins != pins.count:
        fail(f"num_pins {pins.count} != recomputed {num_pins}")
    actual = eviction.leaves()
    actual_ids = {x.uid for x in actual}
    if len(actual_ids) != len(actual) or actual_ids != expected_leaves:
        fail(
            f"evictable leaf set mismatch: extra {sorted(actual_ids - expected_leaves)}, "
            f"missing {sorted(expected_leaves - actual_ids)}"
        )
    for x in actual:
        if x.evict_entry is None or x.parent is None:
            fail(f"{x!r} in the evictable set but detached or without an entry")
    eviction.check_order()
    if host_size != residency.host_size:
        fail(f"host_size {residency.host_size} != recomputed {host_size}")
    hactual = residency.leaves()
    hids = {x.uid for x in hactual}
    if len(hids) != len(hactual) or hids != expected_host_leaves:
        fail(
            f"host leaf set mismatch: extra {sorted(hids - expected_host_leaves)}, "
            f"missing {sorted(expected_host_leaves - hids)}"
        )
    for x in hactual:
        if x.host_entry is None or x.parent is None:
            fail(f"{x!r} in the host evictable set but detached or without an entry")
    residency.check_order()
    for node, (tokens, nodes) in subtree_counts(tree.root).items():
        if node.sub_tokens != tokens or node.sub_nodes != nodes:
            fail(
                f"{node!r}: sub_tokens/sub_nodes {node.sub_tokens}/{node.sub_nodes}, "
                f"recomputed {tokens}/{nodes}"
            )


def subtree_counts(root: TreeNode) -> dict[TreeNode, tuple[int, int]]:
    """Tokens and nodes of every subtree under ``root``, recomputed (pre-order, then summed in
    reverse): what ``sub_tokens`` / ``sub_nodes`` must hold."""
    order: list[TreeNode] = []
    stack = [root]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(node.children.values())
    tokens = {n: len(n.key) for n in order}
    nodes = dict.fromkeys(order, 1)
    for node in reversed(order):
        if node is not root and node.parent is not None:
            tokens[node.parent] += tokens[node]
            nodes[node.parent] += nodes[node]
    return {n: (tokens[n], nodes[n]) for n in order}


def recount_subtrees(root: TreeNode) -> None:
    """Set ``sub_tokens`` / ``sub_nodes`` of every node under ``root`` from scratch (after a
    flush, which drops whole subtrees at once)."""
    for node, (tokens, nodes) in subtree_counts(root).items():
        node.sub_tokens = tokens
        node.sub_nodes = nodes
