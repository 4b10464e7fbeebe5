"""One mapping for a quantized model's weight bytes, in 2 MiB pages where the OS gives them.

A batch-1 decode step streams every weight once. Read from the file one tensor at a time, a
GGUF model's ~120 quantized tensors (SmolLM2: 0.2-1.1 MB each, 96 MB in all) sit on the malloc
heap in 4 KiB pages: ~24,000 TLB entries a step, against the ~2,000 the core holds, and each
4 KiB boundary ends a hardware prefetch stream. Packed one after another into one anonymous
mapping advised for huge pages (:func:`~radixkv.model.hugepages.huge_zeros`), they take ~50.
(Zen 3 host, 2 threads: a standalone pass of the group GEMV kernel over 120 SmolLM2-shaped
matrices took 3.86 ms in huge pages against 4.31 ms separate; the engine's batch-1 forward gained
far less, 0.965-0.991x, docs/performance.md's 2026-12-08 section.)

:class:`WeightArena` hands out slices in order (:meth:`WeightArena.reserve`), which the loader
reads the file's bytes straight into: no tensor is held twice at load (the memory at load stays
about the file's size). The mapping is committed only where written, so its capacity can be an
upper bound (the file's whole tensor data, whether or not every tensor ends up in it).
"""

from __future__ import annotations

import torch

from radixkv.model.hugepages import huge_worthy, huge_zeros

__all__ = ["WeightArena"]

#: each placed tensor starts on a cache line
ALIGN = 64


class WeightArena:
    """Bump allocation of uint8 ``[rows, row_bytes]`` tensors in one huge-page mapping.

    Invariants: reserved slices are disjoint, in reservation order, each starting ``ALIGN``-
    aligned from the mapping's start, and end at or before ``used`` <= ``capacity``. With a
    capacity too small for huge pages (or zero) the arena is off: :meth:`reserve` returns None
    and the caller allocates as it would without one."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"WeightArena: capacity {capacity} is negative")
        self.capacity = capacity
        self.used = 0
        self.reserved = 0
        self._buffer = huge_zeros((capacity,), torch.uint8) if huge_worthy(capacity) else None

    @property
    def enabled(self) -> bool:
        return self._buffer is not None

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a view of this arena's mapping."""
        return (
            self._buffer is not None
            and t.untyped_storage().data_ptr() == self._buffer.untyped_storage().data_ptr()
        )

    def reserve(self, rows: int, row_bytes: int) -> torch.Tensor | None:
        """The next ``rows * row_bytes`` bytes as a contiguous uint8 ``[rows, row_bytes]`` view
        (zeros until written), or None when the arena is off. Raises when the capacity is
        exhausted (the caller's bound was wrong)."""
        if rows < 0 or row_bytes < 0:
            raise ValueError(f"WeightArena: no tensor has shape [{rows}, {row_bytes}]")
        if self._buffer is None:
            return None
        start = (self.used + ALIGN - 1) // ALIGN * ALIGN
        n = rows * row_bytes
        if start + n > self.capacity:
            raise RuntimeError(
                f"WeightArena: {n} more bytes at {start} exceed its capacity {self.capacity}"
            )
        self.used = start + n
        self.reserved += 1
        return self._buffer[start : start + n].view(rows, row_bytes)

    def check_integrity(self) -> None:
        """The invariants above that the arena can see from itself."""
        assert 0 <= self.used <= self.capacity, (self.used, self.capacity)
        if self._buffer is None:
            assert self.used == 0 and self.reserved == 0
        else:
            assert self._buffer.numel() == self.capacity
