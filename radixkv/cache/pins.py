"""Pins of the radix tree: locks with an expiry.

``pin`` locks the matched node once (re-pinning the same node only extends its expiry, ``inf`` =
no ttl); expired pins are unlocked lazily (on ``evict``, ``pin``, ``unpin``, ``reset``,
``check_integrity`` and the size properties) using the tree's injectable ``clock``. Finite
expiries sit in a heap; an entry whose node's expiry changed since it was pushed is stale and
skipped. :class:`Pins` is the tree's ``pins`` part; ``RadixTree.pin``, ``unpin``, ``unpin_all``,
``pinned_tokens``, ``num_pins`` and ``expire_pins`` are its methods.

Budgets: a pin holds its node's whole path (the lock reaches every ancestor), so the tokens pins
hold are the union of those paths (:meth:`Pins.pinned_tokens`). ``pin(..., budget=B,
namespace_budget=N)`` refuses (:class:`PinBudgetError`, nothing changed) a new pin that would
take the pinned tokens of the whole tree past ``B`` or of its namespace (salt) past ``N``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Sequence

from radixkv.cache.tree_node import MatchResult, TreeNode

__all__ = ["PinBudgetError", "Pins"]


class PinBudgetError(ValueError):
    """A pin would exceed the pinned-token budget (of the tree or of its namespace)."""


class Pins:
    """The pinned nodes of one tree.

    Owns: the heap of finite expiries ``(expiry, uid, node)`` and the pin count. The expiry
    itself is on the node (``pin_expiry``) so the tree's audit can recount the pins. Uses the
    tree only through what it is given: ``root``, ``page_size``, ``clock``, and the tree's
    ``lock`` / ``unlock``, ``match`` (``match_prefix``), ``namespace`` (salt -> namespace node
    or ``None``, never creating one) and ``walk`` (``(start, tokens, n)`` -> the deepest node of
    the cached path, touched without counting a hit).

    Invariants (``RadixTree.check_integrity`` recounts them and compares with :attr:`count`):
    ``count`` is the number of nodes with ``pin_expiry is not None``, each of which holds
    exactly one lock (taken with ``lock``, given back with ``unlock``); every finite expiry has
    an entry in the heap (entries whose node's expiry changed since are stale).
    """

    def __init__(
        self,
        root: TreeNode,
        page_size: int,
        clock: Callable[[], float],
        lock: Callable[[TreeNode], None],
        unlock: Callable[[TreeNode], None],
        match: Callable[[Sequence[int], Hashable], MatchResult],
        namespace: Callable[[Hashable], TreeNode | None],
        walk: Callable[[TreeNode, list[int], int], tuple[TreeNode, list[int], int]],
    ) -> None:
        self.root = root
        self.page_size = page_size
        self.clock = clock
        self._lock, self._unlock, self._match = lock, unlock, match
        self._namespace, self._walk = namespace, walk
        self._heap: list[tuple[float, int, TreeNode]] = []
        self._count = 0

    @property
    def count(self) -> int:
        """Pinned nodes (expired ones included until :meth:`expire` runs)."""
        return self._count

    @property
    def num_pins(self) -> int:
        """Number of pinned nodes (after dropping the expired ones)."""
        self.expire()
        return self._count

    def pin(
        self,
        tokens: Sequence[int],
        salt: Hashable = None,
        ttl: float | None = None,
        *,
        budget: int | None = None,
        namespace_budget: int | None = None,
    ) -> int:
        """Pin the cached prefix of ``tokens``: never evicted until ``ttl`` seconds pass (``None``
        = until :meth:`unpin`). Pinning an already pinned node extends its expiry. Returns the
        number of tokens pinned (0 when nothing is cached). A new pin that would take the
        tokens held by pins past ``budget`` (whole tree) or ``namespace_budget`` (the salt's
        namespace) raises :class:`PinBudgetError` and changes nothing."""
        self.expire()
        res = self._match(tokens, salt)
        node = res.node
        if node is None or node is self.root:
            return 0
        if node.pin_expiry is None:
            self._check_budget(node, salt, budget, namespace_budget)
        expiry = math.inf if ttl is None else self.clock() + ttl
        if node.pin_expiry is None:
            self._lock(node)
            self._count += 1
            node.pin_expiry = expiry
        elif expiry > node.pin_expiry:
            node.pin_expiry = expiry
        else:
            return res.num_tokens
        if expiry != math.inf:
            heapq.heappush(self._heap, (expiry, node.uid, node))
        return res.num_tokens

    def unpin(self, tokens: Sequence[int], salt: Hashable = None) -> int:
        """Remove every pin on the cached path of ``tokens``; returns the number of pins removed."""
        self.expire()
        if type(tokens) is not list:
            tokens = list(tokens)
        n = len(tokens) - len(tokens) % self.page_size
        start = self._namespace(salt)
        if start is None or n == 0:
            return 0
        node: TreeNode | None = self._walk(start, tokens, n)[0]
        removed = 0
        while node is not start and node is not None:
            parent = node.parent
            if node.pin_expiry is not None:
                self._unpin_node(node)
                removed += 1
            node = parent
        return removed

    def unpin_all(self) -> int:
        """Remove every pin (a flush that drops pins); returns the number removed."""
        self.expire()
        pinned = self._pinned_nodes(self.root)
        for node in pinned:
            self._unpin_node(node)
        self._heap.clear()
        return len(pinned)

    def pinned_tokens(self, salt: Hashable = None, *, whole_tree: bool = False) -> int:
        """Tokens held by pins: the union of the pinned nodes' paths, in the namespace of
        ``salt`` (``whole_tree``: over every namespace)."""
        self.expire()
        start = self.root if whole_tree else self._namespace(salt)
        if start is None:
            return 0
        return _path_union_tokens(self._pinned_nodes(start), start)

    def expire(self) -> None:
        """Unpin the nodes whose ttl has passed."""
        heap = self._heap
        if not heap:
            return
        now = self.clock()
        while heap and heap[0][0] <= now:
            expiry, _, node = heapq.heappop(heap)
            # Stale entries: the pin was extended or removed since this entry was pushed.
            if node.pin_expiry == expiry:
                self._unpin_node(node)

    def _check_budget(
        self, node: TreeNode, salt: Hashable, budget: int | None, namespace_budget: int | None
    ) -> None:
        for limit, start, where in (
            (budget, self.root, "the server"),
            (namespace_budget, self._namespace(salt), "this namespace"),
        ):
            if limit is None or start is None:
                continue
            pinned = self._pinned_nodes(start)  # one walk of the subtree per budget
            held = _path_union_tokens(pinned, start)
            after = _path_union_tokens([*pinned, node], start)
            if after > limit:
                raise PinBudgetError(
                    f"pinning this prefix would hold {after} tokens in pins for {where} (now "
                    f"{held}), over its budget of {limit} tokens; unpin something first"
                )

    def _pinned_nodes(self, start: TreeNode) -> list[TreeNode]:
        out: list[TreeNode] = []
        stack = [start]
        while stack:
            node = stack.pop()
            if node.pin_expiry is not None:
                out.append(node)
            stack.extend(node.children.values())
        return out

    def _unpin_node(self, node: TreeNode) -> None:
        node.pin_expiry = None
        self._count -= 1
        self._unlock(node)


def _path_union_tokens(nodes: Sequence[TreeNode], start: TreeNode) -> int:
    """Tokens on the union of the paths from ``start`` down to each of ``nodes``."""
    seen: set[int] = set()
    total = 0
    for node in nodes:
        x: TreeNode | None = node
        while x is not None and x is not start and x.uid not in seen:
            seen.add(x.uid)
            total += len(x.key)
            x = x.parent
    return total
