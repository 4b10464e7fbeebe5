from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.cache.allocator import BlockAllocator, IntegrityError, OutOfPagesError


def test_allocate_free_roundtrip() -> None:
    a = BlockAllocator(8, page_size=4)
    assert a.num_free == 8 and a.num_used == 0 and a.capacity_tokens == 32
    pages = a.allocate(3)
    assert pages == [0, 1, 2]
    assert a.num_free == 5 and a.num_used == 3
    assert all(a.refcount(p) == 1 for p in pages)
    a.check_integrity()
    a.free(pages)
    assert a.num_free == 8
    assert all(a.refcount(p) == 0 for p in pages)
    a.check_integrity()


def test_refcount_sharing() -> None:
    a = BlockAllocator(4)
    (p,) = a.allocate(1)
    a.incref([p])
    a.incref([p])
    assert a.refcount(p) == 3
    a.free([p])
    a.free([p])
    assert a.refcount(p) == 1 and a.num_free == 3
    a.check_integrity()
    a.free([p])
    assert a.refcount(p) == 0 and a.num_free == 4
    a.check_integrity()


def test_free_same_page_twice_in_one_call() -> None:
    a = BlockAllocator(2)
    (p,) = a.allocate(1)
    a.incref([p])
    a.free([p, p])
    assert a.num_free == 2
    a.check_integrity()


def test_out_of_pages() -> None:
    a = BlockAllocator(3, page_size=16)
    a.allocate(2)
    assert a.can_allocate(1) and not a.can_allocate(2)
    with pytest.raises(OutOfPagesError, match="requested 2 page"):
        a.allocate(2)
    assert isinstance(OutOfPagesError("x"), RuntimeError)
    # nothing was taken by the failed call
    assert a.num_free == 1
    a.check_integrity()


def test_double_free_and_bad_ids() -> None:
    a = BlockAllocator(2)
    pages = a.allocate(1)
    a.free(pages)
    with pytest.raises(ValueError, match="double free"):
        a.free(pages)
    with pytest.raises(ValueError, match="invalid page id"):
        a.free([5])
    with pytest.raises(ValueError, match="invalid page id"):
        a.free([-1])
    with pytest.raises(ValueError, match="incref of free page"):
        a.incref([0])
    with pytest.raises(ValueError):
        a.allocate(-1)
    assert a.allocate(0) == []
    a.check_integrity()


def test_integrity_detects_corruption() -> None:
    a = BlockAllocator(4)
    a.allocate(2)
    a._refcount[0] = 0  # used page lost its count without returning to the pool
    with pytest.raises(IntegrityError):
        a.check_integrity()
    b = BlockAllocator(4)
    b.free(b.allocate(2))
    b._free.append(b._free[0])  # duplicated free id
    with pytest.raises(AssertionError):
        b.check_integrity()


def test_reset() -> None:
    a = BlockAllocator(5)
    a.allocate(4)
    a.reset()
    assert a.num_free == 5
    a.check_integrity()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["alloc", "incref", "free"]), st.integers(0, 5)), max_size=40
    )
)
def test_random_ops_against_model(ops: list[tuple[str, int]]) -> None:
    a = BlockAllocator(10)
    model: dict[int, int] = {}
    for op, n in ops:
        if op == "alloc":
            if n > 10 - len(model):
                with pytest.raises(OutOfPagesError):
                    a.allocate(n)
            else:
                for p in a.allocate(n):
                    assert p not in model
                    model[p] = 1
        elif model:
            p = sorted(model)[n % len(model)]
            if op == "incref":
                a.incref([p])
                model[p] += 1
            else:
                a.free([p])
                model[p] -= 1
                if model[p] == 0:
                    del model[p]
        a.check_integrity()
        assert a.num_used == len(model)
        assert all(a.refcount(p) == c for p, c in model.items())


# ---------------------------------------------------------------- lazy free list (issue 13)
@settings(max_examples=150, deadline=None)
@given(
    st.integers(0, 40),
    st.lists(
        st.tuples(st.sampled_from(["alloc", "incref", "free", "bad", "reset"]), st.integers(0, 45)),
        max_size=60,
    ),
)
def test_lazy_matches_eager_allocator(num_pages: int, ops: list[tuple[str, int]]) -> None:
    """Same ids in the same order, same counts, same errors as the eager stack it replaced."""
    from eager_allocator import EagerBlockAllocator

    lazy, eager = BlockAllocator(num_pages), EagerBlockAllocator(num_pages)
    held: list[int] = []
    for op, n in ops:
        if op == "alloc":
            if n > eager.num_free:
                with pytest.raises(OutOfPagesError):
                    lazy.allocate(n)
                with pytest.raises(OutOfPagesError):
                    eager.allocate(n)
            else:
                got = lazy.allocate(n)
                assert got == eager.allocate(n)
                held += got
        elif op == "reset":
            lazy.reset()
            eager.reset()
            held = []
        elif op == "bad":  # a free of a free page (touched or not) or an id out of range
            p = n - 2
            if 0 <= p < num_pages and eager.refcount(p) > 0:
                continue
            for a in (lazy, eager):
                with pytest.raises(ValueError):
                    a.free([p])
                with pytest.raises(ValueError):
                    a.incref([p])
        elif held:
            p = held[n % len(held)]
            if op == "incref":
                lazy.incref([p])
                eager.incref([p])
                held.append(p)
            else:
                lazy.free([p])
                eager.free([p])
                held.remove(p)
        lazy.check_integrity()
        assert (lazy.num_free, lazy.num_used) == (eager.num_free, eager.num_used)
        assert [lazy.refcount(p) for p in range(num_pages)] == eager._refcount


def test_huge_pool_costs_what_is_used() -> None:
    """A pool of 10^9 pages is built and used in O(pages used) time and memory."""
    import time
    import tracemalloc

    tracemalloc.start()
    t = time.perf_counter()
    a = BlockAllocator(10**9, page_size=16)
    pages = a.allocate(1000)
    a.free(pages[:10])
    assert a.allocate(3) == pages[:10][::-1][:3]
    a.check_integrity()
    seconds = time.perf_counter() - t
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert a.pages_touched == 1000 and a.num_used == 993 and a.num_free == 10**9 - 993
    assert a.refcount(10**9 - 1) == 0
    assert peak < 1 << 20, f"{peak} bytes for 1000 used pages"
    assert seconds < 1.0
    with pytest.raises(ValueError, match="double free"):
        a.free([5 * 10**8])
    with pytest.raises(ValueError, match="invalid page id"):
        a.free([10**9])
    a.reset()
    assert a.pages_touched == 0 and a.num_free == 10**9
    a.check_integrity()
