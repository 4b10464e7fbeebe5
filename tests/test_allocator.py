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
