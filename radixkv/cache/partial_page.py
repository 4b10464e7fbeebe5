"""Partial-page matches of the radix tree: a cached page that starts like a prompt's next tokens.

The tree matches whole pages, but prompts on one system prompt (or a conversation's turns) share
it to the token: the match stops at the last whole shared page, and the next page of the prompt
that shared it first begins with the tokens the two still share. :meth:`PartialPages.partial_page`
finds that page, so a request can copy its first rows instead of computing them
(:meth:`radixkv.engine.kv_manager.KVManager.admit`; the simulator counts them the same way).
:class:`PartialPages` is the tree's ``partial`` part; ``RadixTree.partial_page`` and
``RadixTree.reusable_rows`` are its methods.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from radixkv.cache.tree_node import TreeNode, common_prefix_len

__all__ = ["MIN_PARTIAL_TOKENS", "PARTIAL_PAGE_SCAN", "PartialPages"]

#: Fewest tokens of a partly matching cached page worth reusing by copying the page (every
#: layer's K and V) instead of computing them.
MIN_PARTIAL_TOKENS = 4
#: :meth:`PartialPages.partial_page` looks at the children of a node with at most this many (a
#: node under a shared system prompt has one per conversation; the root of a busy tree, many).
PARTIAL_PAGE_SCAN = 256


class PartialPages:
    """:meth:`partial_page` over a tree's nodes. Reads only, and owns no state: ``root``,
    ``page_size`` and ``namespace`` (salt -> the namespace node, or ``None`` when there is
    none; never creates one) are the tree's, given at construction."""

    __slots__ = ("root", "page_size", "namespace")

    def __init__(
        self, root: TreeNode, page_size: int, namespace: Callable[[Hashable], TreeNode | None]
    ) -> None:
        self.root = root
        self.page_size = page_size
        self.namespace = namespace

    def partial_page(
        self, node: TreeNode, tokens: Sequence[int], pos: int, limit: int, salt: Hashable = None
    ) -> tuple[int, int]:
        """A device page that starts like ``tokens[pos : pos + limit]`` (``limit < page_size``),
        below a match that ended at ``node`` (``pos`` tokens): ``(page, r)``, the first page of
        the child of ``node`` whose key shares the longest run ``r`` with those tokens, or
        ``(-1, 0)``. Its first ``r`` rows hold exactly the KV of ``tokens[pos : pos + r]`` after
        the prefix matched so far, so a request may copy them instead of computing them
        (:meth:`KVManager.admit`). Scans at most ``PARTIAL_PAGE_SCAN`` children; changes
        nothing."""
        if node is self.root:
            node = self.namespace(salt) or self.root
            if node is self.root and salt is not None:
                return -1, 0
        if len(node.children) > PARTIAL_PAGE_SCAN or limit < 1:
            return -1, 0
        if type(tokens) is not list:
            tokens = list(tokens)
        if pos >= len(tokens):
            return -1, 0
        first = tokens[pos]
        best, best_r = -1, 0
        for ck, child in node.children.items():  # keys: a child's first page, as a tuple
            if type(ck) is not tuple or ck[0] != first or child.value is None:
                continue
            r = common_prefix_len(child.key, tokens, pos, min(limit, len(tokens) - pos))
            if r > best_r:
                best, best_r = child.value[0], r
        return best, best_r

    def reusable_rows(
        self, node: TreeNode, tokens: Sequence[int], pos: int, salt: Hashable = None
    ) -> tuple[int, int]:
        """:meth:`partial_page` under the rule the engine and the simulator share: at most
        ``page_size - 1`` rows, one token of ``tokens`` always left to compute, and only runs
        of ``MIN_PARTIAL_TOKENS`` or more; ``(-1, 0)`` otherwise."""
        limit = min(self.page_size - 1, len(tokens) - 1 - pos)
        if limit < MIN_PARTIAL_TOKENS:
            return -1, 0
        page, r = self.partial_page(node, tokens, pos, limit, salt)
        return (page, r) if r >= MIN_PARTIAL_TOKENS else (-1, 0)
