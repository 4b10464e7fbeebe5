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

Residency: ``device`` / ``host`` from the node's ``value`` / ``host_value``; ``disk`` (and
``remote``) when every page of the edge is in that store, looked up by the chained page hashes
of :func:`~radixkv.cache.disk_store.chain_hashes` (only for shown nodes; ``tiers`` must be given).

Cost: one pass over the whole tree (two dict entries per node, no per-node objects) plus work
proportional to the shown nodes and their children; ``bench/bench_tree_view.py`` times it.
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


def _subtree_sizes(root: TreeNode) -> tuple[list[TreeNode], list[int], list[int]]:
    """Every node in pre-order with the tokens and nodes of its subtree, in one pass.

    The walk pops a stack, so the subtree of ``nodes[i]`` is the contiguous run ``nodes[i : i +
    sub_nodes[i]]`` and its children start at ``i + 1``, each sibling right after the previous
    one's subtree (:func:`_child_indices`). Each node is touched once (the walk is bound by
    memory latency on a big tree); the sums are accumulated over plain int lists afterwards.
    """
    nodes: list[TreeNode] = []
    parents: list[int] = []
    tokens: list[int] = []
    add_node, add_parent, add_tokens = nodes.append, parents.append, tokens.append
    stack = [root]
    pstack = [-1]
    pop, ppop = stack.pop, pstack.pop
    i = 0
    while stack:
        node = pop()
        add_node(node)
        add_parent(ppop())
        add_tokens(len(node.key))
        children = node.children
        if children:
            stack += children.values()
            pstack += [i] * len(children)
        i += 1
    sub_nodes = [1] * len(nodes)
    for j in range(len(nodes) - 1, 0, -1):
        p = parents[j]
        tokens[p] += tokens[j]
        sub_nodes[p] += sub_nodes[j]
    return nodes, tokens, sub_nodes


def _child_indices(i: int, num_children: int, sub_nodes: list[int]) -> list[int]:
    """Pre-order indices of the children of node ``i`` (see :func:`_subtree_sizes`)."""
    out = []
    j = i + 1
    for _ in range(num_children):
        out.append(j)
        j += sub_nodes[j]
    return out


class _Stores:
    """The page stores beneath the host tier that residency is looked up in (disk, remote)."""

    def __init__(self, tiers: Any, page_size: int) -> None:
        from radixkv.cache.disk_store import chain_hashes

        self.chain_hashes = chain_hashes
        self.page_size = page_size
        self.fingerprint: bytes = getattr(tiers, "fingerprint", b"\0" * 32) if tiers else b""
        self.stores: dict[str, Any] = {}
        for name in ("disk", "remote"):
            store = getattr(tiers, name, None) if tiers is not None else None
            if store is not None and callable(getattr(store, "contains", None)):
                self.stores[name] = store
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
        for name, store in self.stores.items():
            out[name] = bool(hashes) and all(store.contains(h) for h in hashes)
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
    nodes, sub_tokens, sub_nodes = _subtree_sizes(root)
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

    tick = tree._tick
    out: list[dict[str, Any]] = [
        {
            "id": root.uid,
            "parent": None,
            "kind": "root",
            "tokens": 0,
            "prefix_tokens": 0,
            "subtree_tokens": sub_tokens[0],
            "subtree_nodes": sub_nodes[0],
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
    prefix_of: dict[int, int] = {0: 0}  # pre-order index of a shown node -> its prefix tokens
    order: list[int] = [0]
    kids_of: dict[int, list[int]] = {}
    heap: list[tuple[int, int, int]] = []  # (-score, child index, parent index)

    def offer(i: int) -> None:
        """Push the best children of newly shown node ``i`` (at most the budget left)."""
        node = nodes[i]
        if not node.children:
            return
        kids = kids_of[i] = _child_indices(i, len(node.children), sub_nodes)
        budget = max_nodes - len(prefix_of)
        if budget <= 0:
            return
        if min_tokens:
            kids = [j for j in kids if sub_tokens[j] >= min_tokens]
        scored = [(-(sub_tokens[j] * (1 + nodes[j].hit_count)), j, i) for j in kids]
        for item in heapq.nsmallest(budget, scored) if len(scored) > budget else scored:
            heapq.heappush(heap, item)

    offer(0)
    while heap and len(prefix_of) < max_nodes:
        _, i, pi = heapq.heappop(heap)
        node = nodes[i]
        parent = node.parent
        assert parent is nodes[pi]
        prefix = 0 if node.is_namespace else prefix_of[pi] + len(node.key)
        prefix_of[i] = prefix
        order.append(i)
        out.append(
            {
                "id": node.uid,
                "parent": parent.uid,
                "kind": "namespace" if node.is_namespace else "node",
                "tokens": len(node.key),
                "prefix_tokens": prefix,
                "subtree_tokens": sub_tokens[i],
                "subtree_nodes": sub_nodes[i],
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
        offer(i)

    more_id = 0
    for i in order:
        kids = kids_of.get(i)
        if not kids:
            continue
        folded = [j for j in kids if j not in prefix_of]
        if not folded:
            continue
        more_id -= 1
        fnodes = [nodes[j] for j in folded]
        ftokens = sum(sub_tokens[j] for j in folded)
        out.append(
            {
                "id": more_id,
                "parent": nodes[i].uid,
                "kind": "more",
                "tokens": ftokens,
                "prefix_tokens": prefix_of[i],
                "subtree_tokens": ftokens,
                "subtree_nodes": sum(sub_nodes[j] for j in folded),
                "children": len(folded),
                "text": None,
                "lock_ref": sum(c.lock_ref for c in fnodes),
                "pinned": any(c.pin_expiry is not None for c in fnodes),
                "residency": {
                    "device": any(c.value is not None for c in fnodes),
                    "host": any(c.host_value is not None for c in fnodes),
                    "disk": False,
                    "remote": False,
                },
                "last_access": max(c.last_access for c in fnodes),
                "hit_count": sum(c.hit_count for c in fnodes),
                "namespace": label(fnodes[0].salt) if i else None,
            }
        )
    return {
        "version": SCHEMA_VERSION,
        "page_size": tree.page_size,
        "tick": tick,
        "total_nodes": sub_nodes[0] - 1,
        "total_tokens": sub_tokens[0],
        "device_tokens": tree.total_size,
        "host_tokens": tree.host_size,
        "shown_nodes": len(prefix_of),
        "max_nodes": max_nodes,
        "min_tokens": min_tokens,
        "text": "hide" if decode is None else "show",
        "nodes": out,
    }
