"""Fixed-size pool of KV pages with reference counts (pure Python, no torch).

A :class:`BlockAllocator` hands out integer page ids ``0..num_pages-1``. Each page holds
``page_size`` tokens of KV. Pages are reference counted so that the prefix tree and any number of
live requests can share one page; a page returns to the free pool when its count drops to 0.

Invariants (checked by :meth:`BlockAllocator.check_integrity`):

* a free page has refcount 0 and appears exactly once in the free stack;
* a used page has refcount >= 1 and is not in the free stack;
* ``num_free + num_used == num_pages``.

Every operation is O(1) per page touched: the free pool is a Python list used as a stack and the
counts live in a flat list indexed by page id, so nothing scans the pool.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["BlockAllocator", "IntegrityError", "OutOfPagesError"]


class OutOfPagesError(RuntimeError):
    """Raised by :meth:`BlockAllocator.allocate` when fewer pages are free than requested."""


class IntegrityError(AssertionError):
    """Raised by ``check_integrity()`` methods when an internal invariant is violated."""


class BlockAllocator:
    """Reference-counted pool of ``num_pages`` pages of ``page_size`` tokens each.

    ``allocate(n)`` returns ``n`` distinct free pages with refcount 1 (ownership passes to the
    caller). ``incref(pages)`` adds an owner to used pages; ``free(pages)`` drops one owner per
    listed page (a page listed twice loses two references). Freeing a page whose count is already
    0 raises :class:`ValueError` (a double free), so ownership bugs surface immediately.
    """

    __slots__ = ("num_pages", "page_size", "_free", "_refcount")

    def __init__(self, num_pages: int, page_size: int = 1) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        # Stack of free ids; popped from the end. Reversed so a fresh pool hands out 0, 1, 2, ...
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._refcount: list[int] = [0] * num_pages

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Number of pages with refcount 0."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Number of pages with refcount >= 1."""
        return self.num_pages - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole pool can hold (``num_pages * page_size``)."""
        return self.num_pages * self.page_size

    def can_allocate(self, n: int) -> bool:
        """True when ``allocate(n)`` would succeed."""
        return 0 <= n <= len(self._free)

    def refcount(self, page: int) -> int:
        """Current reference count of ``page`` (0 = free)."""
        self._check_id(page)
        return self._refcount[page]

    # ------------------------------------------------------------------ mutation
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free pages; each returned page has refcount 1 and belongs to the caller.

        Raises :class:`OutOfPagesError` (nothing allocated) when fewer than ``n`` pages are free.
        """
        free = self._free
        if n <= 0:
            if n < 0:
                raise ValueError(f"cannot allocate a negative number of pages ({n})")
            return []
        if n > len(free):
            raise OutOfPagesError(
                f"out of KV pages: requested {n} page(s) of {self.page_size} token(s), "
                f"only {len(free)} of {self.num_pages} free; free or evict pages first"
            )
        out = free[-n:]
        del free[-n:]
        out.reverse()
        rc = self._refcount
        for p in out:
            rc[p] = 1
        return out

    def incref(self, pages: Iterable[int]) -> None:
        """Add one reference to each listed page; every page must already be in use."""
        rc = self._refcount
        n = self.num_pages
        for p in pages:
            if not 0 <= p < n:
                self._check_id(p)
            if rc[p] <= 0:
                raise ValueError(f"incref of free page {p}: allocate it first")
            rc[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference per listed page; pages reaching 0 return to the free pool.

        Raises :class:`ValueError` on a double free (refcount already 0) or a bad page id;
        pages processed before the bad one stay freed.
        """
        rc = self._refcount
        free = self._free
        n = self.num_pages
        for p in pages:
            if not 0 <= p < n:
                self._check_id(p)
            c = rc[p] - 1
            if c < 0:
                raise ValueError(f"double free of page {p} (refcount already 0)")
            rc[p] = c
            if c == 0:
                free.append(p)

    def reset(self) -> None:
        """Return every page to the pool (all references dropped)."""
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._refcount = [0] * self.num_pages

    # ------------------------------------------------------------------ checks
    def _check_id(self, page: int) -> None:
        if not isinstance(page, int) or not 0 <= page < self.num_pages:
            raise ValueError(f"invalid page id {page!r}: expected an int in [0, {self.num_pages})")

    def check_integrity(self) -> None:
        """Verify the invariants in the module docstring; raise :class:`IntegrityError` if not."""
        seen: set[int] = set()
        for p in self._free:
            if not 0 <= p < self.num_pages:
                raise IntegrityError(f"free stack holds invalid page id {p}")
            if p in seen:
                raise IntegrityError(f"page {p} appears twice in the free stack")
            seen.add(p)
            if self._refcount[p] != 0:
                raise IntegrityError(f"free page {p} has refcount {self._refcount[p]} != 0")
        used = 0
        for p, c in enumerate(self._refcount):
            if c < 0:
                raise IntegrityError(f"page {p} has negative refcount {c}")
            if c == 0 and p not in seen:
                raise IntegrityError(f"page {p} has refcount 0 but is not in the free stack")
            if c > 0:
                used += 1
        if used + len(self._free) != self.num_pages:
            raise IntegrityError(
                f"used ({used}) + free ({len(self._free)}) != num_pages ({self.num_pages})"
            )

    def __repr__(self) -> str:
        return (
            f"BlockAllocator(num_pages={self.num_pages}, page_size={self.page_size}, "
            f"free={self.num_free})"
        )
