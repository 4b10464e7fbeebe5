"""The block allocator as it was before the lazy free list (issue 13): an eager stack of every
page id built up front. Kept as the oracle of allocation order and hit rates: the lazy
:class:`radixkv.cache.allocator.BlockAllocator` must hand out the same ids in the same order, so a
replay through either gives the same cache behaviour. Import it as ``from eager_allocator import
EagerBlockAllocator``."""

from __future__ import annotations

from collections.abc import Iterable

from radixkv.cache.allocator import OutOfPagesError


class EagerBlockAllocator:
    """Same API as ``BlockAllocator``; free ids in a list of all ``num_pages`` ids, counts in a
    list of ``num_pages`` entries."""

    def __init__(self, num_pages: int, page_size: int = 1) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, -1, -1))
        self._refcount = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def pages_touched(self) -> int:
        return self.num_pages

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def refcount(self, page: int) -> int:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"invalid page id {page!r}")
        return self._refcount[page]

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError("negative")
        if n > len(self._free):
            raise OutOfPagesError(f"requested {n}, {len(self._free)} free")
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        out.reverse()
        for p in out:
            self._refcount[p] = 1
        return out

    def incref(self, pages: Iterable[int]) -> None:
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise ValueError(f"invalid page id {p!r}")
            if self._refcount[p] <= 0:
                raise ValueError(f"incref of free page {p}")
            self._refcount[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise ValueError(f"invalid page id {p!r}")
            if self._refcount[p] <= 0:
                raise ValueError(f"double free of page {p}")
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                self._free.append(p)

    def reset(self) -> None:
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._refcount = [0] * self.num_pages

    def check_integrity(self) -> None:
        assert len(set(self._free)) == len(self._free)
        assert all(self._refcount[p] == 0 for p in self._free)
        assert sum(1 for c in self._refcount if c > 0) + len(self._free) == self.num_pages
