"""A bounded, JSON-able snapshot of the radix tree for people to look at (the dashboard).

:func:`tree_view` walks a :class:`~radixkv.cache.radix_tree.RadixTree` once and returns at most
``max_nodes`` of its nodes, the heaviest and hottest first, with everything else folded into
"N more nodes / T tokens" summary nodes. The caller must hold the tree still while it runs (the
server calls it on the engine thread, between two steps): it reads the nodes' fields and never
mutates anything.

Schema (``version`` 1; keys are only ever added, never renamed or retyped, and a change of meaning
bumps ``version``)::

    {
      "version": 1,
      "page_size": int,          # tokens per page
      "tick": int,               # the tree's logical clock (``last_access`` is on this scale)
      "total_nodes": int,        # nodes in the tree, root excluded (namespace nodes included)
      "total_tokens": int,       # tokens on every edge, whatever the tier
      "device_tokens": int,      # tree.total_size (device-resident tokens)
      "host_tokens": int,        # tree.host_size (tokens holding host pages)
      "shown_nodes": int,        # real nodes in "nodes" (root included), <= max_nodes
      "max_nodes": int, "min_tokens": int,
      "text": "show" | "hide",   # "hide": every "text" below is null
      "nodes": [node, ...]       # parents before children; nodes[0] is the root
    }

    node = {
      "id": int,                 # the node's uid (stable while the node lives; a split gives
                                 # the new upper half a new uid); root 0; summaries negative
      "parent": int | null,      # id of the parent (null for the root)
      "kind": "root" | "namespace" | "node" | "more",
      "tokens": int,             # tokens on this edge ("more": tokens of everything folded)
      "prefix_tokens": int,      # tokens from the namespace root to the end of this edge
      "subtree_tokens": int,     # tokens of this node and all its descendants
      "subtree_nodes": int,      # this node and all its descendants ("more": nodes folded)
      "children": int,           # children in the tree ("more": folded subtrees)
      "text": str | null,        # decoded start of the edge (null when hidden or no decoder)
      "lock_ref": int,           # locks held on it or below ("more": sum over folded subtrees)
      "pinned": bool,
      "residency": {"device": bool, "host": bool, "disk": bool, "remote": bool},
      "last_access": int,        # logical tick of the last match/insert ("more": the latest)
      "hit_count": int,          # matches through it ("more": sum over folded subtrees)
      "namespace": str | null    # short keyed hash of the salt, never the salt (null: no salt)
    }

Selection: the root is always shown. Best first from the root, a node's children compete for
the remaining budget by score ``subtree_tokens * (1 + hit_count)`` (big and hot first); a child
whose subtree holds fewer than ``min_tokens`` tokens is never shown on its own. Every shown node
whose children are not all shown gets one ``"more"`` child summarising the rest, so ``nodes``
holds at most ``2 * max_nodes`` entries. Shown nodes always form a connected tree from the root.

Residency: ``device`` / ``host`` from the node's ``value`` / ``host_value``; ``disk`` when every
page of the edge is in the disk store, looked up by the chained page hashes of
:func:`~radixkv.cache.disk_store.chain_hashes` (only for shown nodes; ``tiers`` must be given);
``remote`` when every page was written to (or is queued for, or was read from) the remote store
by this process within its ``recent_ttl`` (Redis itself is never asked: it is shared and evicts
on its own).

Cost: proportional to the shown nodes and their children, not to the tree: subtree sizes come
from the ``sub_tokens`` / ``sub_nodes`` counts the tree keeps on every node
(:class:`~radixkv.cache.tree_node.TreeNode`); ``bench/bench_tree_view.py`` times it on 100,000
nodes.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

from radixkv.cache.tree_node import TreeNode

if TYPE_CHECKING:
    from radixkv.cache.radix_tree import RadixTree

__all__ = ["NODE_FIELDS", "SCHEMA_VERSION", "TOP_FIELDS", "salt_label", "tree_view"]

SCHEMA_VERSION = 1

TOP_FIELDS = (
    "version",
    "page_size",
    "tick",
    "total_nodes",
    "total_tokens",
    "device_tokens",
    "host_tokens",
    "shown_nodes",
    "max_nodes",
    "min_tokens",
    "text",
    "nodes",
)
"""Keys of the document :func:`tree_view` returns (schema version 1)."""

NODE_FIELDS = (
    "id",
    "parent",
    "kind",
    "tokens",
    "prefix_tokens",
    "subtree_tokens",
    "subtree_nodes",
    "children",
    "text",
    "lock_ref",
    "pinned",
    "residency",
    "last_access",
    "hit_count",
    "namespace",
)
"""Keys of every entry of ``nodes`` (schema version 1)."""

SALT_LABEL_CHARS = 12


def salt_label(salt: Hashable, key: bytes | None = None) -> str:
    """A short label for ``salt`` that does not reveal it: the first 12 hex digits of
    HMAC-SHA256(key, salt) (plain SHA-256 of a domain-separated salt when ``key`` is None).

    With a secret ``key`` (the server draws one per process) a guessed salt cannot be confirmed
    from the label; labels are stable for one key."""
    data = salt if isinstance(salt, bytes) else str(salt).encode("utf-8", "surrogatepass")
    if key is None:
        digest = hashlib.sha256(b"radixkv-salt\0" + data).hexdigest()
    else:
        digest = hmac.new(key, data, hashlib.sha256).hexdigest()
    return digest[:SALT_LABEL_CHARS]


class _Stores:
    """The page stores beneath the host tier that residency is looked up in (disk, remote)."""

    def __init__(self, tiers: Any, page_size: int) -> None:
        from radixkv.cache.disk_store import chain_hashes

        self.chain_hashes = chain_hashes
        self.page_size = page_size
        self.fingerprint: bytes = getattr(tiers, "fingerprint", b"\0" * 32) if tiers else b""
        self.stores: dict[str, Callable[[bytes], bool]] = {}
        for name in ("disk", "remote"):
            store = getattr(tiers, name, None) if tiers is not None else None
            if store is None:
                continue
            if callable(getattr(store, "contains", None)):
                self.stores[name] = store.contains
            elif callable(getattr(store, "known", None)):
                # a remote store is not asked over the network: a page it does not want is
                # queued or was written recently by this process (or is in a simulated LRU)
                self.stores[name] = store.known
        self._last: dict[int, bytes] = {}  # node uid -> hash of its last page

    def residency(self, node: TreeNode, parent: TreeNode) -> dict[str, bool]:
        out = {"disk": False, "remote": False}
        if not self.stores or node.is_namespace:
            return out
        prev = None if parent.parent is None or parent.is_namespace else self._last.get(parent.uid)
        if prev is None and not (parent.parent is None or parent.is_namespace):
            return out  # parent's chain unknown (should not happen: parents come first)
        hashes = self.chain_hashes(self.fingerprint, node.key, self.page_size, node.salt, prev=prev)
        if hashes:
            self._last[node.uid] = hashes[-1]
        for name, has in self.stores.items():
            out[name] = bool(hashes) and all(has(h) for h in hashes)
        return out


def tree_view(
    tree: RadixTree,
    *,
    max_nodes: int = 500,
    min_tokens: int = 0,
    decode: Callable[[Sequence[int]], str] | None = None,
    snippet_tokens: int = 48,
    snippet_chars: int = 120,
    salt_key: bytes | None = None,
    tiers: Any = None,
) -> dict[str, Any]:
    """Snapshot ``tree`` as the JSON-able document of the module docstring.

    Args:
        tree: the radix tree; it must not change while this runs.
        max_nodes: real nodes shown, root included (>= 1).
        min_tokens: subtrees with fewer tokens are folded into their parent's summary (>= 0).
        decode: token ids -> text for the ``text`` snippets; ``None`` hides all text.
        snippet_tokens / snippet_chars: how much of each edge is decoded / kept.
        salt_key: key of the salt labels (:func:`salt_label`).
        tiers: the :class:`~radixkv.cache.tiers.TieredCache` (for disk / remote residency).

    Raises ``ValueError`` naming the argument when ``max_nodes`` or ``min_tokens`` is out of
    range.
    """
    if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
        raise ValueError(f"max_nodes must be an integer >= 1, got {max_nodes!r}")
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise ValueError(f"min_tokens must be an integer >= 0, got {min_tokens!r}")
    root = tree.root
    stores = _Stores(tiers, tree.page_size)
    labels: dict[Any, str] = {}

    def label(salt: Hashable) -> str | None:
        if salt is None:
            return None
        got = labels.get(salt)
        if got is None:
            got = labels[salt] = salt_label(salt, salt_key)
        return got

    def text_of(node: TreeNode) -> str | None:
        if decode is None or not node.key:
            return None
        text = decode(node.key[:snippet_tokens])
        if len(node.key) > snippet_tokens or len(text) > snippet_chars:
            text = text[:snippet_chars] + "…"
        return text

    tick = tree.tick
    out: list[dict[str, Any]] = [
        {
            "id": root.uid,
            "parent": None,
            "kind": "root",
            "tokens": 0,
            "prefix_tokens": 0,
            "subtree_tokens": root.sub_tokens,
            "subtree_nodes": root.sub_nodes,
            "children": len(root.children),
            "text": None,
            "lock_ref": root.lock_ref,
            "pinned": False,
            "residency": {"device": True, "host": False, "disk": False, "remote": False},
            "last_access": tick,
            "hit_count": 0,
            "namespace": None,
        }
    ]
    prefix_of: dict[TreeNode, int] = {root: 0}  # shown node -> its prefix tokens
    order: list[TreeNode] = [root]
    # A shown node's children, best first, as (-score, uid, child); its shown children are always
    # a prefix of that list (siblings are offered one at a time, in order), the rest is folded.
    ranked: dict[TreeNode, list[tuple[int, int, TreeNode]]] = {}
    small: dict[TreeNode, list[TreeNode]] = {}  # children under min_tokens (always folded)
    taken: dict[TreeNode, int] = {}  # how many of ranked[node] are shown
    heap: list[tuple[int, int, TreeNode, TreeNode]] = []  # (-score, uid, child, parent)

    def offer(node: TreeNode) -> None:
        """Rank the children of newly shown ``node`` and offer the best one."""
        children = node.children
        if not children:
            return
        kids: Any = children.values()
        if min_tokens:
            small[node] = [c for c in kids if c.sub_tokens < min_tokens]
            kids = [c for c in kids if c.sub_tokens >= min_tokens]
        best = sorted([(-(c.sub_tokens * (1 + c.hit_count)), c.uid, c) for c in kids])
        ranked[node] = best
        taken[node] = 0
        if best:
            heapq.heappush(heap, (*best[0], node))

    offer(root)
    while heap and len(prefix_of) < max_nodes:
        _, _, node, parent = heapq.heappop(heap)
        i = taken[parent] = taken[parent] + 1
        siblings = ranked[parent]
        if i < len(siblings):  # the next best sibling competes now
            heapq.heappush(heap, (*siblings[i], parent))
        prefix = 0 if node.is_namespace else prefix_of[parent] + len(node.key)
        prefix_of[node] = prefix
        order.append(node)
        out.append(
            {
                "id": node.uid,
                "parent": parent.uid,
                "kind": "namespace" if node.is_namespace else "node",
                "tokens": len(node.key),
                "prefix_tokens": prefix,
                "subtree_tokens": node.sub_tokens,
                "subtree_nodes": node.sub_nodes,
                "children": len(node.children),
                "text": text_of(node),
                "lock_ref": node.lock_ref,
                "pinned": node.pin_expiry is not None,
                "residency": {
                    "device": node.value is not None,
                    "host": node.host_value is not None,
                    **stores.residency(node, parent),
                },
                "last_access": node.last_access,
                "hit_count": node.hit_count,
                "namespace": label(node.salt),
            }
        )
        offer(node)

    more_id = 0
    for node in order:
        if not node.children:
            continue
        folded = [e[2] for e in ranked[node][taken[node] :]]
        folded += small.get(node, ())
        if not folded:
            continue
        more_id -= 1
        tokens = nodes = locks = hits = last = 0
        pinned = device = host = False
        for c in folded:
            tokens += c.sub_tokens
            nodes += c.sub_nodes
            locks += c.lock_ref
            hits += c.hit_count
            if c.last_access > last:
                last = c.last_access
            pinned = pinned or c.pin_expiry is not None
            device = device or c.value is not None
            host = host or c.host_value is not None
        out.append(
            {
                "id": more_id,
                "parent": node.uid,
                "kind": "more",
                "tokens": tokens,
                "prefix_tokens": prefix_of[node],
                "subtree_tokens": tokens,
                "subtree_nodes": nodes,
                "children": len(folded),
                "text": None,
                "lock_ref": locks,
                "pinned": pinned,
                "residency": {"device": device, "host": host, "disk": False, "remote": False},
                "last_access": last,
                "hit_count": hits,
                "namespace": label(folded[0].salt) if node is not root else None,
            }
        )
    return {
        "version": SCHEMA_VERSION,
        "page_size": tree.page_size,
        "tick": tick,
        "total_nodes": root.sub_nodes - 1,
        "total_tokens": root.sub_tokens,
        "device_tokens": tree.total_size,
        "host_tokens": tree.host_size,
        "shown_nodes": len(prefix_of),
        "max_nodes": max_nodes,
        "min_tokens": min_tokens,
        "text": "hide" if decode is None else "show",
        "nodes": out,
    }
