"""``RadixTree.check_integrity``: recompute every invariant of the tree from scratch.

The checker is the tree's own audit, so it reads the tree's private bookkeeping; :class:`TreeState`
names exactly what it reads (and keeps this module free of an import of ``radix_tree``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from radixkv.cache.allocator import BlockAllocator, IntegrityError
from radixkv.cache.tree_node import NamespaceKey, TreeNode


class TreeState(Protocol):
    """The parts of a :class:`~radixkv.cache.radix_tree.RadixTree` the audit recomputes."""

    root: TreeNode
    page_size: int
    allocator: BlockAllocator
    host_allocator: BlockAllocator | None
    _leaves: Any
    _host_leaves: Any
    _host_size: int
    _evictable_size: int
    _protected_size: int
    _num_pins: int
    _child_key: Callable[[list[int]], Any]
    _sort_entry: Callable[..., Any]
    _expire_pins: Callable[[], Any]


__all__ = ["TreeState", "check_tree_integrity", "recount_subtrees", "subtree_counts"]


def check_tree_integrity(tree: TreeState) -> None:
    """The body of :meth:`RadixTree.check_integrity` (its docstring lists the checks); raises
    :class:`IntegrityError` on the first mismatch."""
    tree._expire_pins()
    P = tree.page_size
    alloc = tree.allocator
    halloc = tree.host_allocator
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
                if ck != tree._child_key(child.key):
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
            if node.host_entry is not None and node.host_entry != tree._sort_entry(node):
                fail(f"{node!r}: stale host eviction entry")
            continue
        if node.host_entry is not None:
            fail(f"device-resident {node!r} is in the host evictable set")
        pinned = 1 if node.pin_expiry is not None else 0
        pins += pinned
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
        if node.evict_entry is not None and node.evict_entry != tree._sort_entry(node):
            fail(f"{node!r}: stale eviction entry {node.evict_entry[:-1]}")
    if evictable != tree._evictable_size:
        fail(f"evictable_size {tree._evictable_size} != recomputed {evictable}")
    if protected != tree._protected_size:
        fail(f"protected_size {tree._protected_size} != recomputed {protected}")
    if pins != tree._num_pins:
        fail(f"num_pins {tree._num_pins} != recomputed {pins}")
    actual = [e[-1] for e in tree._leaves]
    actual_ids = {x.uid for x in actual}
    if len(actual_ids) != len(actual) or actual_ids != expected_leaves:
        fail(
            f"evictable leaf set mismatch: extra {sorted(actual_ids - expected_leaves)}, "
            f"missing {sorted(expected_leaves - actual_ids)}"
        )
    for x in actual:
        if x.evict_entry is None or x.parent is None:
            fail(f"{x!r} in the evictable set but detached or without an entry")
    tree._leaves._check()
    if host_size != tree._host_size:
        fail(f"host_size {tree._host_size} != recomputed {host_size}")
    hactual = [e[-1] for e in tree._host_leaves]
    hids = {x.uid for x in hactual}
    if len(hids) != len(hactual) or hids != expected_host_leaves:
        fail(
            f"host leaf set mismatch: extra {sorted(hids - expected_host_leaves)}, "
            f"missing {sorted(expected_host_leaves - hids)}"
        )
    for x in hactual:
        if x.host_entry is None or x.parent is None:
            fail(f"{x!r} in the host evictable set but detached or without an entry")
    tree._host_leaves._check()
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
