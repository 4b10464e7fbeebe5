"""Contiguous virtual KV over a shared physical page pool (vAttention on the CPU, with sharing).

The physical pool is one ``memfd``: tensor ``t = 2 * layer + (0 for K, 1 for V)`` occupies bytes
``[t * num_pages * page_bytes, (t + 1) * num_pages * page_bytes)`` and page ``p`` of it starts
``p * page_bytes`` further. :class:`VirtualKVPool` is a :class:`~radixkv.model.kv_pool.KVPool`
whose ``k[layer]`` / ``v[layer]`` are tensors over one ``MAP_SHARED`` mapping of that memfd, so
every page id of the allocator, the radix tree, the tiers and copy-on-write means what it meant.

:class:`VirtualKV` gives each running sequence a reserved ``PROT_NONE`` range of
``2 * num_layers * max_pages * page_bytes`` bytes: slot ``i`` of tensor ``t`` sits at
``base + t * range_bytes + i * page_bytes``. :meth:`VirtualKV.sync` maps the sequence's page
``pages[i]`` there with ``mmap(MAP_FIXED | MAP_SHARED, memfd, offset)`` (runs of consecutive page
ids in one call), so each sequence sees its K and V of a layer as one contiguous
``[seq_len, Hkv, D]`` tensor. Pages shared through the tree (a prefix hit) or with forked siblings
are mapped, never copied; :meth:`VirtualKV.release` unmaps the whole range.

Invariants (checked by :meth:`VirtualKV.check_integrity`): every mapped slot of a sequence holds
the page its page table has at that index, the kernel's ``/proc/self/maps`` agrees (file offset of
a sample of slots), and a mapped slot reads the same bytes as the pool's paged view.

OS limits: an ``mmap`` offset must be a multiple of the OS page (4 KiB), so one KV page of one
layer (``page_size * Hkv * D * itemsize``) must be too (:func:`virtual_layout_problem`), and the
process may hold at most ``vm.max_map_count`` mappings: :meth:`VirtualKV.sync` raises
:class:`MapLimitError` before it would pass ``max_map_count - MAP_MARGIN``.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from radixkv.model.kv_pool import KVPool

__all__ = [
    "MapLimitError",
    "VirtualKV",
    "VirtualKVPool",
    "count_process_mappings",
    "max_map_count",
    "virtual_layout_problem",
]

log = logging.getLogger(__name__)

OS_PAGE = mmap.PAGESIZE
MAP_MARGIN = 4096  # mappings left for the rest of the process (libraries, allocator arenas)
_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED = 0x01, 0x02, 0x10
_MAP_ANON, _MAP_NORESERVE = 0x20, 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
if _libc is not None:
    _libc.mmap.restype = ctypes.c_void_p
    _libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    _libc.munmap.restype = ctypes.c_int


class MapLimitError(RuntimeError):
    """Mapping more pages would pass the process's ``vm.max_map_count``."""


def max_map_count() -> int:
    """``/proc/sys/vm/max_map_count`` (65530 when it cannot be read)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 65530


def count_process_mappings() -> int:
    """Lines of ``/proc/self/maps``: the mappings this process holds now."""
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def virtual_layout_problem(
    page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> str | None:
    """Why ``kv_layout="virtual"`` cannot serve this pool, or ``None`` when it can."""
    if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
        return "kv_layout='virtual' needs Linux (memfd_create, mmap MAP_FIXED)"
    if torch.device(device).type != "cpu":
        return "kv_layout='virtual' maps host memory: it needs device='cpu'"
    itemsize = torch.empty((), dtype=dtype).element_size()
    page_bytes = page_size * num_kv_heads * head_dim * itemsize
    if page_bytes % OS_PAGE:
        return (
            f"kv_layout='virtual' needs one KV page of one layer (page_size {page_size} x "
            f"{num_kv_heads} KV heads x {head_dim} dims x {itemsize} B = {page_bytes} B) to be a "
            f"multiple of the {OS_PAGE} B OS page: pick a page_size that is a multiple of "
            f"{OS_PAGE // _gcd(OS_PAGE, num_kv_heads * head_dim * itemsize)}"
        )
    return None


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _mmap(addr: int, length: int, prot: int, flags: int, fd: int, offset: int) -> int:
    assert _libc is not None
    got = _libc.mmap(addr or None, length, prot, flags, fd, offset)
    if got is None or got == _MAP_FAILED:
        err = ctypes.get_errno()
        if err == 12:  # ENOMEM: usually vm.max_map_count
            raise MapLimitError(f"mmap failed (ENOMEM; vm.max_map_count={max_map_count()})")
        raise OSError(err, f"mmap failed: {os.strerror(err)}")
    if addr and got != addr:
        raise OSError(f"mmap MAP_FIXED returned {got:#x}, asked {addr:#x}")
    return int(got)


def _munmap(addr: int, length: int) -> None:
    assert _libc is not None
    if _libc.munmap(addr, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"munmap failed: {os.strerror(err)}")


def _tensor_at(addr: int, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor over ``nbytes`` of raw memory at ``addr`` (no copy; the caller keeps it mapped)."""
    buf = (ctypes.c_char * nbytes).from_address(addr)
    return torch.frombuffer(buf, dtype=dtype).view(shape)


class VirtualKVPool(KVPool):
    """A :class:`KVPool` whose pages live in one memfd (see the module docstring for offsets)."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        problem = virtual_layout_problem(page_size, num_kv_heads, head_dim, dtype, device)
        if problem is not None:
            raise ValueError(problem)
        if num_layers < 1 or num_pages < 1 or page_size < 1:
            raise ValueError(
                f"num_layers, num_pages and page_size must be >= 1, got "
                f"{num_layers}, {num_pages}, {page_size}"
            )
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        itemsize = torch.empty((), dtype=dtype).element_size()
        #: bytes of one page of one layer's K (or V)
        self.page_bytes = page_size * num_kv_heads * head_dim * itemsize
        self.tensor_bytes = num_pages * self.page_bytes
        self.fd = os.memfd_create("radixkv-kv", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, 2 * num_layers * self.tensor_bytes)  # zero-filled, lazily backed
        self._mm = mmap.mmap(self.fd, 2 * num_layers * self.tensor_bytes)
        flat = torch.frombuffer(self._mm, dtype=torch.uint8)
        shape = (num_pages, page_size, num_kv_heads, head_dim)

        def part(t: int) -> torch.Tensor:
            lo = t * self.tensor_bytes
            return flat[lo : lo + self.tensor_bytes].view(dtype).view(shape)

        self.k = [part(2 * layer) for layer in range(num_layers)]
        self.v = [part(2 * layer + 1) for layer in range(num_layers)]

    def page_offset(self, tensor: int, page: int) -> int:
        """Byte offset in the memfd of ``page`` of tensor ``2 * layer + (0 K | 1 V)``."""
        return tensor * self.tensor_bytes + page * self.page_bytes


@dataclass
class _Range:
    """One sequence's reservation: ``2 * num_layers`` tensor ranges of ``range_bytes`` each."""

    base: int
    slots: list[int] = field(default_factory=list)  # page mapped at each slot (-1 = none)
    views: list[torch.Tensor] = field(default_factory=list)  # per tensor [max_tokens, Hkv, D]
    runs: int = 0  # kernel mappings its page runs may add (2 per run: the run + a split)


def _runs(pages: Sequence[int]) -> int:
    """Runs of consecutive ids (one ``mmap`` call and, at most, one kernel mapping each)."""
    return sum(1 for i, p in enumerate(pages) if p >= 0 and (i == 0 or pages[i - 1] != p - 1))


class VirtualKV:
    """Per-sequence contiguous virtual ranges over a :class:`VirtualKVPool`.

    Args:
        pool: the memfd-backed pool.
        max_tokens: the longest sequence (``max_model_len``); sizes each reservation.
    """

    def __init__(self, pool: VirtualKVPool, max_tokens: int) -> None:
        self.pool = pool
        self.max_pages = -(-max_tokens // pool.page_size)
        self.range_bytes = self.max_pages * pool.page_bytes
        self.num_tensors = 2 * pool.num_layers
        self.ranges: dict[int, _Range] = {}
        self.map_limit = max_map_count() - MAP_MARGIN
        self.base_mappings = count_process_mappings()
        self.mappings = 0  # mappings held by the ranges (estimate: runs + one reservation each)
        self.map_seconds = 0.0  # time spent in mmap/munmap
        self.map_calls = 0
        self.syncs = 0

    # -- mapping -----------------------------------------------------------------------------
    def _reserve(self) -> _Range:
        size = self.num_tensors * self.range_bytes
        flags = _MAP_PRIVATE | _MAP_ANON | _MAP_NORESERVE
        base = _mmap(0, size, _PROT_NONE, flags, -1, 0)
        p = self.pool
        shape = (self.max_pages * p.page_size, p.num_kv_heads, p.head_dim)
        views = [
            _tensor_at(base + t * self.range_bytes, self.range_bytes, shape, p.dtype)
            for t in range(self.num_tensors)
        ]
        return _Range(base, [], views, 0)

    def sync(self, key: int, pages: Sequence[int]) -> None:
        """Make the range of ``key`` map exactly ``pages`` (slot ``i`` -> ``pages[i]``): only the
        slots that changed are (re)mapped, slots past the end go back to ``PROT_NONE``.

        Raises :class:`MapLimitError` (mapping nothing) when the mappings would pass
        ``vm.max_map_count - MAP_MARGIN``; raises ``ValueError`` past ``max_tokens``."""
        if len(pages) > self.max_pages:
            raise ValueError(
                f"a sequence of {len(pages)} pages exceeds the virtual range ({self.max_pages})"
            )
        t0 = time.perf_counter()
        rng = self.ranges.get(key)
        new_runs = 2 * _runs(pages) * self.num_tensors  # a run splits the reservation
        grow = new_runs + (1 if rng is None else 0) - (0 if rng is None else rng.runs)
        if self.mappings + grow > self.map_limit - self.base_mappings:
            raise MapLimitError(
                f"kv_layout='virtual' would hold {self.mappings + grow} mappings, past "
                f"vm.max_map_count ({self.map_limit + MAP_MARGIN}) minus the process's own"
            )
        if rng is None:
            rng = self._reserve()
            self.ranges[key] = rng
            self.mappings += 1
            self.map_calls += 1
        old = rng.slots
        target = list(pages) + [-1] * max(0, len(old) - len(pages))
        changed = [i for i, p in enumerate(target) if i >= len(old) or old[i] != p]
        p = self.pool
        i = 0
        while i < len(changed):  # group changed slots into runs of consecutive slots and pages
            j = i
            while (
                j + 1 < len(changed)
                and changed[j + 1] == changed[j] + 1
                and (target[changed[j + 1]] == target[changed[j]] + 1 or target[changed[j]] < 0)
                and (target[changed[j + 1]] < 0) == (target[changed[j]] < 0)
            ):
                j += 1
            first, n = changed[i], j - i + 1
            page = target[first]
            for t in range(self.num_tensors):
                addr = rng.base + t * self.range_bytes + first * p.page_bytes
                if page < 0:
                    flags = _MAP_PRIVATE | _MAP_ANON | _MAP_NORESERVE | _MAP_FIXED
                    _mmap(addr, n * p.page_bytes, _PROT_NONE, flags, -1, 0)
                else:
                    off = p.page_offset(t, page)
                    _mmap(addr, n * p.page_bytes, _PROT_RW, _MAP_SHARED | _MAP_FIXED, p.fd, off)
                self.map_calls += 1
            i = j + 1
        rng.slots = list(pages)
        self.mappings += new_runs - rng.runs
        rng.runs = new_runs
        self.syncs += 1
        self.map_seconds += time.perf_counter() - t0

    def release(self, key: int) -> None:
        """Unmap the whole range of ``key`` (no-op when it has none)."""
        rng = self.ranges.pop(key, None)
        if rng is None:
            return
        t0 = time.perf_counter()
        rng.views.clear()
        _munmap(rng.base, self.num_tensors * self.range_bytes)
        self.mappings -= rng.runs + 1
        self.map_calls += 1
        self.map_seconds += time.perf_counter() - t0

    def release_all(self) -> None:
        """Unmap every range."""
        for key in list(self.ranges):
            self.release(key)

    def retain(self, live: dict[int, Sequence[int]]) -> None:
        """Batched per step: ranges of keys not in ``live`` are released, the others synced."""
        for key in [k for k in self.ranges if k not in live]:
            self.release(key)
        for key, pages in live.items():
            self.sync(key, pages)

    # -- reading -----------------------------------------------------------------------------
    def views(self, key: int, layer: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` for ``key`` as contiguous ``[seq_len, Hkv, D]`` tensors."""
        rng = self.ranges[key]
        need = -(-seq_len // self.pool.page_size)
        if need > len(rng.slots) or any(s < 0 for s in rng.slots[:need]):
            raise RuntimeError(f"sequence {key}: {seq_len} tokens but slots {rng.slots[:need]}")
        return rng.views[2 * layer][:seq_len], rng.views[2 * layer + 1][:seq_len]

    # -- checks ------------------------------------------------------------------------------
    def check_integrity(
        self, live: dict[int, Sequence[int]] | None = None, sample: int = 8
    ) -> None:
        """Every mapped slot holds a page its sequence holds (``live``: key -> page table), the
        kernel maps it at that page's memfd offset, and it reads the pool's bytes.

        With ``live`` given, no range exists for a key outside it."""
        if live is not None:
            extra = set(self.ranges) - set(live)
            assert not extra, f"ranges of sequences that are gone: {sorted(extra)}"
        total = 0
        for key, rng in self.ranges.items():
            total += rng.runs + 1
            if live is not None:
                held = list(live[key])
                for i, page in enumerate(rng.slots):
                    assert i < len(held) and held[i] == page, (
                        f"sequence {key}: slot {i} maps page {page}, page table has "
                        f"{held[i] if i < len(held) else None}"
                    )
            assert rng.runs == 2 * _runs(rng.slots) * self.num_tensors, "mapping count drifted"
        assert total == self.mappings, f"mappings {self.mappings} but ranges hold {total}"
        self._check_kernel_maps(sample)

    def _check_kernel_maps(self, sample: int) -> None:
        want: list[tuple[int, int, int, int]] = []  # (addr, offset, tensor, page)
        p = self.pool
        for rng in self.ranges.values():
            mapped = [(i, pg) for i, pg in enumerate(rng.slots) if pg >= 0]
            for i, page in mapped[:: max(1, len(mapped) // sample)][:sample]:
                for t in (0, self.num_tensors - 1):
                    addr = rng.base + t * self.range_bytes + i * p.page_bytes
                    want.append((addr, p.page_offset(t, page), t, page))
        if not want:
            return
        areas = []
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                areas.append((lo, hi, int(parts[2], 16), parts[5] if len(parts) > 5 else ""))
        areas.sort()
        import bisect

        starts = [a[0] for a in areas]
        for addr, off, t, page in want:
            k = bisect.bisect_right(starts, addr) - 1
            assert k >= 0 and areas[k][0] <= addr < areas[k][1], f"{addr:#x} is not mapped"
            lo, _, aoff, name = areas[k]
            assert "radixkv-kv" in name, f"{addr:#x} maps {name!r}, not the KV memfd"
            assert aoff + (addr - lo) == off, f"{addr:#x} maps offset {aoff + addr - lo}, not {off}"
            view = _tensor_at(addr, p.page_bytes, (p.page_bytes,), torch.uint8)
            cache = p.k[t // 2] if t % 2 == 0 else p.v[t // 2]
            assert torch.equal(view, cache[page].view(torch.uint8).flatten()), (
                f"tensor {t} page {page}: the range and the pool read different bytes"
            )

    def stats(self) -> dict[str, float]:
        """Ranges, mappings, mmap calls and seconds spent mapping."""
        return {
            "ranges": len(self.ranges),
            "mappings": self.mappings,
            "map_calls": self.map_calls,
            "map_seconds": self.map_seconds,
            "syncs": self.syncs,
        }
