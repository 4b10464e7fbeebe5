"""The C heap of a CPU serving process: keep freed activation buffers instead of returning them.

A prefill step of 2,048 tokens allocates and frees activations of tens of MB a layer (SmolLM2's
gate/up output in float32 is 25 MB). glibc's malloc serves such blocks from fresh ``mmap``
regions or trims its heap top back to the OS once freed, so the next layer's buffer is new
memory again and its first write takes a page fault for every 4 KiB: the GEMM that fills it
pays for the faults. :func:`tune_heap` raises the limits so that freed blocks stay in the
heap and are reused: ``M_MMAP_THRESHOLD`` to glibc's maximum (32 MiB: blocks below it come from
the heap), ``M_TRIM_THRESHOLD`` to 1 GiB (free heap top kept up to that size) and ``M_TOP_PAD``
to 64 MiB (the heap grows in large steps). The process holds its peak activation memory
instead of handing it back between steps, which a server does anyway a step later. vLLM's CPU
guide gets the same effect by preloading tcmalloc.

Measured (diagnosis, W1's float32 steps with the kernels held to AVX2, Zen 4 host): a 2,048-token
step's gate/up projection 1,050 ms across the layers with the tuning against 1,064-1,215 ms
without, and W1's wall 13.9 / 13.9 / 14.9 s against 16.3 / 15.6 / 14.5 s. The bf16 model on the
same host (AVX512-BF16; its gate/up output at 2,048 tokens is 12.6 MB): the cold 64-chat burst of
``bench.bench_vllm_serve``'s multi_turn offline, processes alternating with and without, three
each: median first-token time 4.03 / 4.08 / 4.09 s against 4.19 / 4.27 / 4.20 s, wall 8.82 / 8.92
/ 9.09 s against 8.95 / 9.14 / 9.17 s.

Linux with glibc only (elsewhere a no-op); ``RADIXKV_HEAP_TUNING=0`` leaves malloc as it is.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

__all__ = ["HEAP_SETTINGS", "tune_heap"]

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h) and the values tune_heap sets
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
HEAP_SETTINGS = {
    "M_MMAP_THRESHOLD": (_M_MMAP_THRESHOLD, 32 << 20),  # glibc's maximum on 64-bit
    "M_TRIM_THRESHOLD": (_M_TRIM_THRESHOLD, 1 << 30),
    "M_TOP_PAD": (_M_TOP_PAD, 64 << 20),
}

_applied: bool | None = None


def tune_heap() -> bool:
    """Apply :data:`HEAP_SETTINGS` to this process's malloc once (module docstring); True when
    they are in effect, False where they do not apply (not glibc, or
    ``RADIXKV_HEAP_TUNING=0``)."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("RADIXKV_HEAP_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no glibc mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    for name, (param, value) in HEAP_SETTINGS.items():
        if mallopt(param, value) != 1:
            log.warning("mallopt(%s, %d) was refused; the heap keeps glibc's defaults", name, value)
            return False
    _applied = True
    return True
