"""WeightArena (radixkv/model/weight_arena.py): quantized weights' bytes packed in one mapping,
and the GGUF reader that reads into it."""

from __future__ import annotations

import pytest
import torch

from radixkv.model.hugepages import huge_worthy
from radixkv.model.weight_arena import ALIGN, WeightArena

CAPACITY = 16 << 20  # large enough for the huge-page mapping: the arena is on


def test_reserved_slices_are_aligned_disjoint_zeroed_views_in_order() -> None:
    assert huge_worthy(CAPACITY)
    arena = WeightArena(CAPACITY)
    assert arena.enabled
    shapes = [(10, 100), (1, 77), (8, 512)]
    views = [arena.reserve(*shape) for shape in shapes]
    base = views[0].data_ptr()
    spans = []
    for shape, v in zip(shapes, views, strict=True):
        assert v is not None and tuple(v.shape) == shape and v.is_contiguous()
        assert v.dtype == torch.uint8 and arena.holds(v) and not v.any()
        offset = v.data_ptr() - base
        assert offset % ALIGN == 0
        spans.append((offset, offset + v.numel()))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # disjoint, in order
    assert arena.used == spans[-1][1] and arena.reserved == 3
    # writing one slice changes no other
    views[1].fill_(7)
    assert not views[0].any() and not views[2].any()
    assert not arena.holds(torch.zeros(4, dtype=torch.uint8))
    arena.check_integrity()


def test_a_full_arena_says_so_and_keeps_what_it_holds() -> None:
    arena = WeightArena(CAPACITY)
    first = arena.reserve(1, CAPACITY - 100)
    first.fill_(3)
    with pytest.raises(RuntimeError, match="exceed its capacity"):
        arena.reserve(2, 100)
    assert arena.reserved == 1 and arena.used == CAPACITY - 100
    assert bool((first == 3).all())
    arena.check_integrity()


def test_a_small_arena_is_off() -> None:
    arena = WeightArena(1 << 20)
    assert not arena.enabled and arena.reserve(4, 1024) is None
    assert arena.used == 0
    arena.check_integrity()


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        WeightArena(-1)
    with pytest.raises(ValueError, match="no tensor has shape"):
        WeightArena(CAPACITY).reserve(-1, 8)
