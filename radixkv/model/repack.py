"""Packing a weight nobody else holds without ever holding both of its layouts whole.

A load that packs a plain ``[N, K]`` weight into radixkv's native GEMM layout (``[N / cols,
K / step, cols * step]``, ``pack_f32_weight`` / ``pack_bf16_weight``) and then frees the plain
one holds both for a moment: the transient a streamed load's peak is made of. Where the weight is
the loader's alone (:func:`memory_kind` says where it lives):

- in the heap (a fused or converted weight): :func:`pack_in_place` rewrites it in its own
  memory, a few blocks of rows at a time;
- memory-mapped from a checkpoint file, copy-on-write and never written (a weight the file holds
  as it is used): :func:`pack_dropping_source` packs it a few blocks at a time into new memory
  and drops the packed part's file pages from the resident set as it goes (they read back from
  the file). Packing it in place would keep a private mapping of the whole file per weight.

Each step moves at most :data:`STEP_ELEMENTS` elements, below torch's grain for splitting an op
over threads: one thread streams them, where thousands of small parallel regions (the native
``pack_*_weight`` per part) took 7 ms each on a shared 2-core host and made SmolLM2's load 3x
slower.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

__all__ = ["memory_kind", "pack_dropping_source", "pack_in_place"]

#: elements of the weight packed per step (the scratch): under torch's parallel grain (32,768)
STEP_ELEMENTS = 16384
#: file pages are dropped once this many bytes of them are packed
DROP_BYTES = 1 << 20
_PAGE = mmap.PAGESIZE  # 4 KiB on x86-64; 16 or 64 KiB on some arm64 kernels
_MADV_DONTNEED = 4


def _blocks_per_step(weight: torch.Tensor, cols: int) -> int:
    return max(1, STEP_ELEMENTS // (cols * weight.shape[1]))


def _blocks(n: int, k: int, cols: int, step: int, weight: torch.Tensor) -> torch.Tensor:
    """``weight``'s plain rows as blocks ``[N / cols, cols, K / step, step]``."""
    return weight.view(n // cols, cols, k // step, step)


def _check(weight: torch.Tensor, cols: int, step: int) -> None:
    n, k = weight.shape
    if not weight.is_contiguous() or n % cols or k % step:
        raise ValueError(f"a contiguous [N, K] weight with N % {cols} == 0 needed, got {n, k}")


def pack_in_place(weight: torch.Tensor, cols: int) -> torch.Tensor:
    """``weight`` ``[N, K]`` (contiguous) rewritten in its own memory as the native GEMM's packed
    layout ``[N / cols, K / step, cols * step]`` (step 2 for bf16, else 1: what
    ``pack_f32_weight`` / ``pack_bf16_weight`` return); returns that view. The plain layout is
    gone: nobody else may hold ``weight``."""
    step = 2 if weight.dtype == torch.bfloat16 else 1
    _check(weight, cols, step)
    n, k = weight.shape
    blocks = _blocks(n, k, cols, step, weight)
    per = _blocks_per_step(weight, cols)
    scratch = torch.empty((per, k // step, cols, step), dtype=weight.dtype)
    with torch.no_grad():
        for b in range(0, n // cols, per):
            chunk = blocks[b : b + per]
            part = scratch[: chunk.shape[0]]
            part.copy_(chunk.transpose(1, 2))
            chunk.view(-1).copy_(part.view(-1))
    return weight.view(n // cols, k // step, cols * step)


def pack_dropping_source(weight: torch.Tensor, cols: int) -> torch.Tensor:
    """``weight`` ``[N, K]`` packed into new memory as :func:`pack_in_place` lays it out, a few
    blocks of rows at a time, the whole pages of ``weight`` already packed dropped from the
    resident set (``MADV_DONTNEED``) as it goes. Only for a private file mapping never written
    (a streamed checkpoint's tensor, :func:`memory_kind` ``"file"``): its pages read back from
    the file, where anonymous memory would read back as zeros."""
    step = 2 if weight.dtype == torch.bfloat16 else 1
    _check(weight, cols, step)
    n, k = weight.shape
    blocks = _blocks(n, k, cols, step, weight)
    out = torch.empty((n // cols, k // step, cols, step), dtype=weight.dtype)
    base, row_bytes = weight.data_ptr(), k * weight.element_size()
    dropped = -(-base // _PAGE) * _PAGE  # whole pages of the weight only
    per = _blocks_per_step(weight, cols)
    with torch.no_grad():
        for b in range(0, n // cols, per):
            out[b : b + per].copy_(blocks[b : b + per].transpose(1, 2))
            done = (base + min(n, (b + per) * cols) * row_bytes) // _PAGE * _PAGE
            last = b + per >= n // cols
            if done - dropped >= DROP_BYTES or (last and done > dropped):
                _madvise(dropped, done - dropped, _MADV_DONTNEED)
                dropped = done
    return out.view(n // cols, k // step, cols * step)


_libc: ctypes.CDLL | None = None


def _madvise(start: int, length: int, advice: int) -> bool:
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        return _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice) == 0
    except (OSError, AttributeError):
        return False


def memory_kind(t: torch.Tensor) -> str | None:
    """``"anon"`` (the heap, anonymous memory) or ``"file"`` (a memory-mapped file: a streamed
    checkpoint's tensor) where all of ``t``'s bytes lie in private writable mappings of that kind
    (``/proc/self/maps``), so writing them changes no file; else None, also where it cannot
    tell (not Linux, a CUDA tensor)."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux"):
        return None
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    kinds = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if not lo <= start < hi:
                    continue
                path = fields[5].strip() if len(fields) > 5 else ""
                if "w" not in fields[1] or not fields[1].endswith("p"):
                    return None
                if path.startswith("[") and path != "[heap]":
                    return None  # a stack, the vdso...
                kinds.add("file" if path and path != "[heap]" else "anon")
                if end <= hi:
                    return kinds.pop() if len(kinds) == 1 else None
                start = hi  # the rest lies in the next mapping
    except (OSError, ValueError):
        return None
    return None
