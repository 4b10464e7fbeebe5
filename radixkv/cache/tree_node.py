"""The radix tree's node, match result and observer hooks (plain data; mutate only through
``RadixTree`` and the parts it owns).

A :class:`TreeNode` is one edge: ``key`` token ids, ``value`` device pages, ``host_value`` host
pages, lock and eviction bookkeeping. :class:`NamespaceKey` is the child key under ``root`` of a
salted namespace. :class:`TreeEvents` is what the offload tiers hook. :func:`child_key` and
:func:`detach` are the two structural helpers the tree and its host residency share. See
:mod:`radixkv.cache.radix_tree` for the invariants the tree keeps over them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixkv.cache.allocator import BlockAllocator

__all__ = [
    "MatchResult",
    "NamespaceKey",
    "TreeEvents",
    "TreeNode",
    "add_subtree_counts",
    "child_key",
    "collect_pages",
    "common_prefix_len",
    "count_nodes",
    "detach",
    "drop_unlocked",
    "split_edge",
]


@dataclass(frozen=True)
class NamespaceKey:
    """Child key of ``root`` for a salted namespace (never equal to a token or page tuple)."""

    salt: Hashable


class TreeNode:
    """One edge of the radix tree.

    Fields (read them freely; mutate only through :class:`RadixTree` and its parts):

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
    * ``dev_children``: number of device-resident children; ``host_ref``: host protections;
    * ``sub_tokens`` / ``sub_nodes``: tokens on the edges of this node's subtree (its own edge
      included, whatever the tier) and nodes in it (itself included), kept up to date by every
      insert, split and removal (:func:`add_subtree_counts`), so views of a big tree
      (:mod:`radixkv.cache.tree_view`) never walk all of it.
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
        "sub_tokens",
        "sub_nodes",
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
        # The tuple currently stored in the tree's EvictionIndex (device leaves), or None.
        self.evict_entry: tuple | None = None
        self.host_value: list[int] | None = None
        # The tuple currently stored in the tree's HostResidency (host leaves), or None.
        self.host_entry: tuple | None = None
        self.host_ref = 0
        self.dev_children = 0
        self.sub_tokens = len(key)
        self.sub_nodes = 1

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


def add_subtree_counts(node: TreeNode | None, tokens: int, nodes: int) -> None:
    """Add ``tokens`` / ``nodes`` to ``sub_tokens`` / ``sub_nodes`` of ``node`` and every ancestor
    (after a subtree below ``node`` grew or shrank by that much)."""
    while node is not None:
        node.sub_tokens += tokens
        node.sub_nodes += nodes
        node = node.parent


def child_key(key: list[int], page_size: int) -> Any:
    """The key of a child with edge ``key`` in its parent's ``children``: its first page (the
    first token when ``page_size == 1``, else the tuple of the first ``page_size`` tokens)."""
    return key[0] if page_size == 1 else tuple(key[:page_size])


def detach(node: TreeNode, page_size: int) -> None:
    """Take ``node`` (and its subtree) out of its parent's children, device-children count and
    subtree counts. No page or eviction-index handling: that is the caller's."""
    parent = node.parent
    assert parent is not None
    if node.value is not None:
        parent.dev_children -= 1
    if node.is_namespace:
        del parent.children[NamespaceKey(node.salt)]
    else:
        del parent.children[child_key(node.key, page_size)]
    node.parent = None
    add_subtree_counts(parent, -node.sub_tokens, -node.sub_nodes)


def split_edge(child: TreeNode, m: int, page_size: int, uid: int) -> TreeNode:
    """Split ``child``'s edge after ``m`` tokens (0 < m < len(key), page aligned) with a new
    upper node of id ``uid``, which is returned: it takes the first ``m`` tokens and their
    device / host pages, and ``child``'s lock, access and creation marks. The cached prefixes and
    every size stay the same; ``child`` keeps its eviction entries (its sort fields do not
    change)."""
    P = page_size
    parent = child.parent
    assert parent is not None
    value = child.value
    mid = TreeNode(
        child.key[:m], None if value is None else value[: m // P], parent, uid, child.salt
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
    parent.children[child_key(child.key, P)] = mid
    child.key = child.key[m:]
    if value is not None:
        child.value = value[m // P :]
    child.parent = mid
    mid.children[child_key(child.key, P)] = child
    return mid


def drop_unlocked(
    root: TreeNode, allocator: BlockAllocator | None, host_allocator: BlockAllocator | None
) -> tuple[int, int]:
    """Detach every unlocked node under ``root`` (a flush), freeing its device pages to
    ``allocator`` and its host pages to ``host_allocator``; the subtree counts are left to the
    caller. Returns the device and the host tokens dropped."""
    dropped = 0
    dropped_host = 0
    stack = [root]
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
                    if x.value is not None:
                        dropped += len(x.key)
                        if allocator is not None and x.value:
                            allocator.free(x.value)
                    if x.host_value is not None:
                        dropped_host += len(x.key)
                        if host_allocator is not None and x.host_value:
                            host_allocator.free(x.host_value)
            else:
                stack.append(child)
        # every child left is locked, hence device resident
        node.dev_children = len(node.children)
    return dropped, dropped_host


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


def collect_pages(root: TreeNode, attr: str) -> list[int]:
    """The page ids in ``attr`` (``"value"`` or ``"host_value"``) of every node under ``root``."""
    out: list[int] = []
    stack = [root]
    while stack:
        node = stack.pop()
        pages = getattr(node, attr)
        if pages is not None:
            out += pages
        stack.extend(node.children.values())
    return out


def count_nodes(root: TreeNode) -> int:
    """Number of nodes under ``root`` (not counting ``root``)."""
    count = 0
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        count += 1
        stack.extend(node.children.values())
    return count


@dataclass(frozen=True)
class TreeEvents:
    """What a tree's observer (the offload tiers) hooks, handed over by ``RadixTree.observe``.

    ``on_evict(node, pages)``: before an evicted device node's pages are freed (node attached).
    ``host_allocator``: the host page pool host copies live in (``None``: no host copies).
    ``on_host_evict(node, host_pages)``: before a node's host pages are freed.
    ``on_insert(node)``: after ``insert`` created a device node (write-through)."""

    on_evict: Callable[[TreeNode, list[int]], None] | None = None
    host_allocator: BlockAllocator | None = None
    on_host_evict: Callable[[TreeNode, list[int]], None] | None = None
    on_insert: Callable[[TreeNode], None] | None = None


def common_prefix_len(key: list[int], tokens: list[int], start: int, limit: int) -> int:
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
