"""Page bookkeeping of running sequences against the radix tree and the block allocator.

One idea: every page is owned exactly once — free in the allocator, held by the tree, or held by
live sequences (by reference count when forked siblings or a borrowing sequence share it). This
module moves pages between those owners; the scheduler decides *when*.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from radixkv.cache.allocator import BlockAllocator, OutOfPagesError
from radixkv.cache.radix_tree import RadixTree

__all__ = ["Admission", "KVManager"]

if TYPE_CHECKING:
    from radixkv.engine.request import Sequence


class Admission(NamedTuple):
    """What :meth:`KVManager.admit` did: cached tokens attached, cached pages left unloaded."""

    cached_tokens: int
    unloaded_pages: int


class KVManager:
    """Matches, locks, grows, publishes and releases the KV pages of sequences."""

    def __init__(
        self,
        allocator: BlockAllocator,
        tree: RadixTree,
        enable_prefix_cache: bool,
        copy_pages: Callable[[list[int], list[int]], None],
        tiers: Any = None,
        on_release: Callable[[Sequence], None] | None = None,
    ) -> None:
        self.allocator = allocator
        self.tree = tree
        self.page_size = allocator.page_size
        self.enable_prefix_cache = enable_prefix_cache
        self.copy_pages = copy_pages
        #: Host/disk tiers (``radixkv.cache.tiers.TieredCache``) or None.
        self.tiers: Any = tiers
        #: Called with each sequence :meth:`release` empties (the virtual KV layout unmaps it).
        self.on_release = on_release

    # -- admission ---------------------------------------------------------------------------
    def match(self, seq: Sequence) -> tuple[list[int], int, object]:
        """The cached prefix usable by ``seq``: at most ``num_tokens - 1`` tokens, so at least one
        token is fed to the model and yields logits. Nothing for a ``skip_cache_read`` sequence."""
        if not self.enable_prefix_cache or seq.skip_cache_read:
            return [], 0, None
        tokens = seq.tokens
        res = self.tree.match_prefix(tokens[: len(tokens) - 1], salt=seq.salt)
        return res.pages, res.num_tokens, res.node

    def peek(self, seq: Sequence) -> tuple[int, object]:
        """Cached tokens ``admit`` would reuse from the device (and the node there), without
        touching the tree: for ordering and deferring waiting sequences."""
        if not self.enable_prefix_cache or seq.skip_cache_read:
            return 0, None
        tokens = seq.tokens
        return self.tree.peek_prefix(tokens[: len(tokens) - 1], salt=seq.salt)

    def admit(self, seq: Sequence, partial: bool = True) -> Admission:
        """Attach the cached prefix to ``seq`` and lock it; returns the cached token count and
        the cached pages left on the host / disk for lack of device room.

        With offload tiers, a match that continues on the host or disk is loaded back into
        device pages first; on first admission ``seq.cached_by_tier`` gets the tokens per tier.
        When the continuation does not fit in the free or evictable device pages, its longest
        prefix that fits is loaded (``partial=True``) or nothing is (``partial=False``); either
        way :attr:`Admission.unloaded_pages` says how many cached pages were left behind.
        """
        unloaded = 0
        if self.tiers is not None and self.enable_prefix_cache and not seq.skip_cache_read:
            tokens = seq.tokens[: seq.num_tokens - 1]
            res = self.tree.match_prefix(tokens, salt=seq.salt)
            self.tree.lock(res.node)
            try:
                # one page stays free for the first chunk of whatever is left to compute
                loaded = self.tiers.load_prefix(
                    tokens, seq.salt, res, reserve_pages=1, partial=partial
                )
            except BaseException:
                self.tree.unlock(res.node)
                raise
            pages, num, node = loaded.pages, loaded.num_tokens, loaded.node
            unloaded = loaded.unloaded_pages
            if seq.cached_tokens is None:
                seq.cached_by_tier = loaded.by_tier
        else:
            pages, num, node = self.match(seq)
            if node is not None:
                self.tree.lock(node)
        seq.lock_node = node
        seq.pages = list(pages)
        seq.num_computed = num
        seq.num_tree_tokens = num
        reused = self._reuse_partial_page(seq, node)
        self._count_device_reuse(seq, reused)
        return Admission(num + reused, unloaded)

    @staticmethod
    def _count_device_reuse(seq: Sequence, tokens: int) -> None:
        """Add ``tokens`` reused on the device (a copied partial page, borrowed pages) to the
        per-tier hit of ``seq``'s first admission (only kept with offload tiers)."""
        if tokens and seq.cached_tokens is None and seq.cached_by_tier:
            by_tier = dict(seq.cached_by_tier)
            by_tier["device"] = by_tier.get("device", 0) + tokens
            seq.cached_by_tier = by_tier

    def _reuse_partial_page(self, seq: Sequence, node: object) -> int:
        """Copy-on-write reuse past the page-aligned match: when a cached page below ``node``
        starts with the next ``r >= MIN_PARTIAL_TOKENS`` tokens of ``seq`` (a conversation's
        turns and a prompt's own part rarely begin on a page boundary: prompts on one system
        prompt share it to the token, the tree to the page), ``seq`` gets a fresh page holding a
        copy of it and ``r`` more tokens computed; rows past ``r`` are overwritten by the tokens
        it computes there. Only with a free page at hand (no eviction here), and at least one
        token is always left to compute. Returns ``r`` (0 when nothing was reused)."""
        if node is None or self.allocator.num_free < 1:  # None: no cache read for seq
            return 0
        num = seq.num_computed
        donor, r = self.tree.reusable_rows(node, seq.tokens, num, salt=seq.salt)
        if r == 0:
            return 0
        (page,) = self.allocator.allocate(1)
        self.copy_pages([donor], [page])
        seq.pages.append(page)
        seq.num_computed = num + r
        return r

    # -- growth ------------------------------------------------------------------------------
    def pages_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Fresh pages ``seq`` needs to hold ``num_new_tokens`` more tokens (copy-on-write of a
        shared partial page included)."""
        total = seq.num_computed + num_new_tokens
        need = max(0, -(-total // self.page_size) - len(seq.pages))
        if self._shared_tail(seq) is not None:
            need += 1
        return need

    def _shared_tail(self, seq: Sequence) -> int | None:
        """Index of the page the next token goes into when that page is shared with a sibling."""
        if seq.num_computed % self.page_size == 0:
            return None
        i = seq.num_computed // self.page_size
        owned = i < len(seq.pages) and i * self.page_size >= seq.num_tree_tokens
        return i if owned and self.allocator.refcount(seq.pages[i]) > 1 else None

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give ``seq`` the pages for ``num_new_tokens`` more tokens. Raises OutOfPagesError."""
        need = self.pages_needed(seq, num_new_tokens)
        if need == 0:
            return
        fresh = self.allocator.allocate(need)
        i = self._shared_tail(seq)
        if i is not None:  # copy-on-write of the partial page shared with forked siblings
            new = fresh.pop()
            self.copy_pages([seq.pages[i]], [new])
            self.allocator.free([seq.pages[i]])
            seq.pages[i] = new
        seq.pages.extend(fresh)

    def ensure_free(self, num_pages: int) -> bool:
        """Evict unlocked cache until ``num_pages`` pages are free; True when they are."""
        short = num_pages - self.allocator.num_free
        if short > 0 and self.enable_prefix_cache:
            self.tree.evict(short * self.page_size)
        return self.allocator.num_free >= num_pages

    # -- publication -------------------------------------------------------------------------
    def publish(self, seq: Sequence) -> None:
        """Insert the computed, page-aligned prefix of ``seq`` into the tree and move its lock there.

        Pages the tree already had (computed twice, e.g. by a concurrent sibling) are freed and
        replaced by the tree's copies, so the page table stays valid and nothing is owned twice.
        """
        if not self.enable_prefix_cache:
            return
        P = self.page_size
        aligned = seq.num_computed // P * P
        if aligned <= seq.num_tree_tokens:
            return
        tokens = seq.tokens[:aligned]
        own = seq.pages[: aligned // P]
        present = self.tree.insert(tokens, own, salt=seq.salt)
        lo, hi = seq.num_tree_tokens // P, present // P
        if hi > lo:
            self.allocator.free(own[lo:hi])
        res = self.tree.match_prefix(tokens, salt=seq.salt)
        assert res.num_tokens == aligned, (res.num_tokens, aligned)
        seq.pages[: aligned // P] = res.pages
        self.tree.lock(res.node)
        if seq.lock_node is not None:
            self.tree.unlock(seq.lock_node)
        seq.lock_node = res.node
        seq.num_tree_tokens = aligned

    def release(self, seq: Sequence, publish: bool) -> None:
        """Give back everything ``seq`` holds (publishing its computed prefix first if asked)."""
        if publish:
            self.publish(seq)
        own = seq.pages[seq.num_tree_tokens // self.page_size :]
        if own:
            self.allocator.free(own)
        if seq.lock_node is not None:
            self.tree.unlock(seq.lock_node)
        seq.lock_node = None
        if self.on_release is not None:
            self.on_release(seq)
        seq.pages = []
        seq.num_computed = 0
        seq.num_tree_tokens = 0

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Make ``child`` share every page of ``parent`` (the tree part by lock, the rest by ref)."""
        child.pages = list(parent.pages)
        child.num_computed = parent.num_computed
        child.num_tree_tokens = parent.num_tree_tokens
        child.lock_node = parent.lock_node
        if child.lock_node is not None:
            self.tree.lock(child.lock_node)
        own = child.pages[child.num_tree_tokens // self.page_size :]
        if own:
            self.allocator.incref(own)

    def borrow(self, seq: Sequence, owner: Sequence, end: int) -> int:
        """In-step prefix sharing: give ``seq`` (just admitted) ``owner``'s pages for its tokens
        up to ``end``, which ``owner`` computes in the step both run in (or computed before), so
        ``seq`` computes only what follows. Returns the tokens borrowed (0: nothing done).

        Preconditions the caller guarantees: ``seq.tokens[:end] == owner.tokens[:end]``, ``end``
        is page aligned, and ``owner``'s KV up to ``end`` is written before ``seq``'s attention
        reads it (every backend stores a layer's new K/V for the whole batch before attending).
        Borrows only when ``seq`` stands on the tree's pages alone (no copied partial page) and
        at or past ``owner``'s tree part, so every borrowed page is one ``owner`` holds by
        reference (counted here once more: :meth:`publish` and :meth:`release` give each owner's
        reference back as they do for forks)."""
        P = self.page_size
        start = seq.num_computed
        if start != seq.num_tree_tokens or start % P or end % P or start >= end:
            return 0
        if owner.num_tree_tokens > start or len(owner.pages) < end // P:
            return 0
        pages = owner.pages[start // P : end // P]
        self.allocator.incref(pages)
        seq.pages.extend(pages)
        seq.num_computed = end
        self._count_device_reuse(seq, end - start)
        return end - start

    # -- checks ------------------------------------------------------------------------------
    def check_integrity(self, live: list[Sequence]) -> None:
        """Every page is free, held by the tree, or held by live sequences — exactly as counted."""
        self.allocator.check_integrity()
        self.tree.check_integrity()
        P = self.page_size
        expected: dict[int, int] = {}
        for page in self.tree.all_pages():
            expected[page] = expected.get(page, 0) + 1
        locks: dict[int, int] = {}
        for seq in live:
            assert seq.num_tree_tokens % P == 0, "tree part of a sequence is not page aligned"
            assert seq.num_computed <= len(seq.pages) * P, "computed tokens beyond the page table"
            tree_pages = seq.pages[: seq.num_tree_tokens // P]
            if seq.num_tree_tokens:
                res = self.tree.match_prefix(seq.tokens[: seq.num_tree_tokens], salt=seq.salt)
                assert res.pages == tree_pages, f"{seq.request_id}: page table disagrees with tree"
            for page in seq.pages[seq.num_tree_tokens // P :]:
                expected[page] = expected.get(page, 0) + 1
            if seq.lock_node is not None:
                locks[id(seq.lock_node)] = locks.get(id(seq.lock_node), 0) + 1
        touched = self.allocator.pages_touched  # pages above it were never handed out
        assert all(0 <= p < touched for p in expected), "an owner holds a never-allocated page"
        for page in range(touched):
            have = self.allocator.refcount(page)
            want = expected.get(page, 0)
            assert have == want, f"page {page}: refcount {have} but {want} owners"
        if not live and self.enable_prefix_cache and self.tree.num_pins == 0:
            assert self.tree.protected_size == 0, "locks remain with no live sequence"


__all__ = ["Admission", "KVManager", "OutOfPagesError"]
