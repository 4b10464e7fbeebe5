"""Transparent huge pages for large CPU tensors (the KV pool, the weights).

A decode step reads every running request's KV pages, scattered over a pool of hundreds of MB,
and streams all the weights: with 4 KiB pages nearly every KV page read misses the TLB. On Linux
with THP in ``madvise`` mode (the common default) a region only gets 2 MiB pages if it is
advised *before* it is first touched, so these helpers allocate, advise, then fill.

:func:`huge_zeros` does not fill: large CPU tensors live in an anonymous ``mmap``, which the OS
guarantees reads as zeros and backs with memory only where it is first written, so a KV pool of
several GB costs nothing at start-up (``torch.zeros`` wrote all of it: ~1 s per 3 GB here) and
still never holds garbage that a masked read could turn into NaN.

The price of lazy zeros is paid on first write instead: in this VM a step writing a fresh 2 MiB
page of the pool stalls for milliseconds (the guest's fault, compaction, the host backing the
memory). :func:`populate` commits a range ahead of use without changing its contents
(``MADV_POPULATE_WRITE``, Linux 5.14+), which :mod:`radixkv.model.prefault` does for the KV pool
while the server is idle.

Elsewhere (other OSes, THP ``never``, CUDA tensors) they just allocate normally.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import sys

import torch

__all__ = ["huge_zeros", "huge_copy", "huge_worthy", "advise_huge", "populate"]

log = logging.getLogger(__name__)

_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23
_PAGE = 4096
_HUGE = 2 << 20
_MIN_BYTES = 4 * _HUGE  # smaller tensors are not worth it
_libc: ctypes.CDLL | None = None


def huge_worthy(nbytes: int) -> bool:
    """Whether a CPU region of ``nbytes`` is large enough for these helpers to map it for huge
    pages (smaller ones get plain memory)."""
    return nbytes >= _MIN_BYTES


def advise_huge(t: torch.Tensor) -> bool:
    """``madvise(MADV_HUGEPAGE)`` the 2 MiB-aligned interior of ``t``'s storage (CPU, Linux).

    Returns whether the call was made and succeeded. Pages already touched are not converted
    (the kernel's khugepaged may do it later), so call this before writing to ``t``.
    """
    if t.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    nbytes = t.untyped_storage().nbytes()
    if nbytes < _MIN_BYTES:
        return False
    start = t.untyped_storage().data_ptr()
    lo = (start + _HUGE - 1) // _HUGE * _HUGE
    hi = (start + nbytes) // _HUGE * _HUGE
    if hi <= lo:
        return False
    return _madvise(lo, hi - lo, _MADV_HUGEPAGE)


def _madvise(start: int, length: int, advice: int) -> bool:
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        rc = _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice)
    except (OSError, AttributeError) as exc:  # no libc symbol: nothing to do
        log.debug("madvise unavailable: %s", exc)
        return False
    return rc == 0


def populate(t: torch.Tensor, offset: int, nbytes: int) -> bool:
    """Commit bytes ``[offset, offset + nbytes)`` of ``t``'s storage as if written, leaving
    their contents as they are (``MADV_POPULATE_WRITE``), so a later first write does not fault.

    Safe while other threads read and write the range (no byte changes). Returns False where
    unsupported (not Linux, an older kernel, a CUDA tensor) or for an empty range.
    """
    if t.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    storage = t.untyped_storage()
    start = storage.data_ptr() + max(0, offset)
    end = storage.data_ptr() + min(storage.nbytes(), offset + nbytes)
    lo = (
        start // _PAGE * _PAGE
    )  # populating changes no byte, so a page shared with a neighbour is fine
    if end <= lo:
        return False
    return _madvise(lo, end - lo, _MADV_POPULATE_WRITE)


def huge_zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``torch.zeros`` whose CPU memory is advised for huge pages before it is first touched.

    A large CPU tensor is a view of an anonymous ``mmap`` (zero by the OS's guarantee, memory
    committed page by page on first write; the tensor keeps the mapping alive); anything else
    is ``torch.zeros``."""
    device = torch.device(device)
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if device.type != "cpu" or nbytes < _MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.frombuffer(_anonymous_private(nbytes), dtype=dtype, count=numel).view(shape)
    advise_huge(t)
    return t


def _anonymous_private(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping of ``nbytes``. ``mmap.mmap(-1, n)`` alone is a *shared*
    anonymous mapping, which Linux backs with shmem: there THP follows ``shmem_enabled``
    (``never`` by default), not ``enabled``, so ``MADV_HUGEPAGE`` got the pool no huge pages."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    if not flags:  # not a POSIX mmap (Windows): its anonymous mapping
        return mmap.mmap(-1, nbytes)
    return mmap.mmap(-1, nbytes, flags=flags)


def huge_copy(src: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``src`` in memory advised for huge pages (``src`` itself if small
    or not on the CPU)."""
    if src.device.type != "cpu" or src.numel() * src.element_size() < _MIN_BYTES:
        return src
    t = torch.empty(src.shape, dtype=src.dtype)
    if not advise_huge(t):
        return src
    return t.copy_(src)
