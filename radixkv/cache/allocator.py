"""Fixed-size pool of KV pages with reference counts (pure Python, no torch).

A :class:`BlockAllocator` hands out integer page ids ``0..num_pages-1``. Each page holds
``page_size`` tokens of KV. Pages are reference counted so that the prefix tree and any number of
live requests can share one page; a page returns to the free pool when its count drops to 0.

Memory and time grow with the pages *used*, not the pages configured: the pool is a lazily
extended free list. Ids below the high-water mark ``pages_touched`` have been handed out at least
once; their counts live in a list of that length, and those that came back wait in a stack of
returned ids. Ids at or above the mark were never handed out: they are free and cost nothing, so
a pool of 10^8 pages is as cheap to build and use as one of 10^3.

Allocation order is that of an eager stack holding ``num_pages-1 .. 0``: returned ids first,
most recently returned first, then fresh ids in ascending order (a fresh pool hands out 0, 1,
2, ...).

Invariants (checked by :meth:`BlockAllocator.check_integrity`):

* ``0 <= pages_touched <= num_pages`` and the count list has exactly ``pages_touched`` entries;
* every id in the returned stack is ``< pages_touched``, appears once and has refcount 0;
* every touched id with refcount 0 is in the returned stack; no count is negative;
* ids ``>= pages_touched`` are free (refcount 0) and in no structure;
* ``num_free + num_used == num_pages``, with ``num_free = num_pages - pages_touched +
  len(returned stack)``.

Every operation is O(1) per page touched; nothing scans the pool.
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

    __slots__ = ("num_pages", "page_size", "_free", "_refcount", "_next")

    def __init__(self, num_pages: int, page_size: int = 1) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._next = 0  # high-water mark: ids >= _next were never handed out
        self._free: list[int] = []  # returned ids (all < _next), popped from the end
        self._refcount: list[int] = []  # counts of ids < _next

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Number of pages with refcount 0."""
        return self.num_pages - self._next + len(self._free)

    @property
    def num_used(self) -> int:
        """Number of pages with refcount >= 1."""
        return self._next - len(self._free)

    @property
    def pages_touched(self) -> int:
        """High-water mark: every page id ever handed out is below it; ids at or above it have
        never been used (refcount 0). Checks iterate ``range(pages_touched)``, not the pool."""
        return self._next

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole pool can hold (``num_pages * page_size``)."""
        return self.num_pages * self.page_size

    def can_allocate(self, n: int) -> bool:
        """True when ``allocate(n)`` would succeed."""
        return 0 <= n <= self.num_free

    def refcount(self, page: int) -> int:
        """Current reference count of ``page`` (0 = free)."""
        self._check_id(page)
        return self._refcount[page] if page < self._next else 0

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
        nfree = self.num_pages - self._next + len(free)
        if n > nfree:
            raise OutOfPagesError(
                f"out of KV pages: requested {n} page(s) of {self.page_size} token(s), "
                f"only {nfree} of {self.num_pages} free; free or evict pages first"
            )
        rc = self._refcount
        k = len(free)
        if n <= k:
            out = free[-n:]
            del free[-n:]
            out.reverse()
            for p in out:
                rc[p] = 1
            return out
        out = free[::-1]
        free.clear()
        for p in out:
            rc[p] = 1
        start = self._next
        fresh = n - k
        self._next = start + fresh
        out += range(start, start + fresh)
        rc += [1] * fresh
        return out

    def incref(self, pages: Iterable[int]) -> None:
        """Add one reference to each listed page; every page must already be in use."""
        rc = self._refcount
        n = self._next
        for p in pages:
            if not 0 <= p < n:
                self._check_id(p)
                raise ValueError(f"incref of free page {p}: allocate it first")
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
        n = self._next
        for p in pages:
            if not 0 <= p < n:
                self._check_id(p)
                raise ValueError(f"double free of page {p} (refcount already 0)")
            c = rc[p] - 1
            if c < 0:
                raise ValueError(f"double free of page {p} (refcount already 0)")
            rc[p] = c
            if c == 0:
                free.append(p)

    def reset(self) -> None:
        """Return every page to the pool (all references dropped)."""
        self._next = 0
        self._free = []
        self._refcount = []

    # ------------------------------------------------------------------ checks
    def _check_id(self, page: int) -> None:
        if not isinstance(page, int) or not 0 <= page < self.num_pages:
            raise ValueError(f"invalid page id {page!r}: expected an int in [0, {self.num_pages})")

    def check_integrity(self) -> None:
        """Verify the invariants in the module docstring; raise :class:`IntegrityError` if not.
        Costs O(pages touched), not O(num_pages)."""
        top = self._next
        if not 0 <= top <= self.num_pages:
            raise IntegrityError(f"high-water mark {top} outside [0, {self.num_pages}]")
        if len(self._refcount) != top:
            raise IntegrityError(f"{len(self._refcount)} counts for {top} touched pages")
        seen: set[int] = set()
        for p in self._free:
            if not 0 <= p < top:
                raise IntegrityError(f"free stack holds page id {p} outside [0, {top})")
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
        if used + self.num_free != self.num_pages:
            raise IntegrityError(
                f"used ({used}) + free ({self.num_free}) != num_pages ({self.num_pages})"
            )

    def __repr__(self) -> str:
        return (
            f"BlockAllocator(num_pages={self.num_pages}, page_size={self.page_size}, "
            f"free={self.num_free}, touched={self._next})"
        )
