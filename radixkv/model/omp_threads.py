"""Hand torch's OpenMP worker threads back before another thread takes over the parallel work.

libgomp (the OpenMP runtime of torch's Linux CPU wheels) keeps one pool of worker threads for
every thread that has started a parallel region. The server loads and prepacks the model on the
main thread, then steps the engine on a thread of its own (``radixkv.server.engine_loop``): two
pools, so libgomp manages more threads than there are CPUs, and in that state it cuts the time
an idle worker spins waiting for the next parallel region to a throttled count
(``gomp_throttled_spin_count_var`` in libgomp's ``env.c``). A decode step runs thousands of short
parallel regions (every linear, norm and attention call), and with the throttle their workers
sleep on a futex between regions and are woken by a syscall each time.

:func:`release_omp_workers` frees the calling thread's pool (``omp_pause_resource_all``, OpenMP
5.0), so the engine thread's pool is the only one left. Measured on a Zen 4 host (AVX512-BF16,
2 cores), 30 bf16 linears of 64 x 576 x 3,072 (``.diag``-style one-off, median of 60): on the
main thread 17.3 ms; on a second thread after the main thread's pool had run 19.0-19.8 ms; the
same after this release 17.4-18.0 ms. In the server the decode step's every part was slower
than the same step offline (see docs/performance.md, "2026-11-26, fourth session").

Invariant: only worker threads of the calling thread's pool are stopped; a later parallel region
on that thread starts a new pool. Where libgomp is not loaded (another OpenMP runtime, or no
torch), nothing happens.
"""

from __future__ import annotations

import ctypes
import logging

__all__ = ["release_omp_workers"]

log = logging.getLogger(__name__)

#: ``omp_pause_soft`` of ``omp_pause_resource_t``.
_OMP_PAUSE_SOFT = 1


def _libgomp_path() -> str | None:
    """The path of the libgomp mapped into this process, if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "libgomp" in path.rsplit("/", 1)[-1]:
                    return path
    except OSError:
        pass
    return None


def release_omp_workers() -> bool:
    """Free the calling thread's OpenMP worker threads (libgomp only); whether it did.

    Call it on a thread that is done with torch's parallel work (the server's main thread after
    loading the model) before another thread (the engine's) starts its own."""
    path = _libgomp_path()
    if path is None:
        return False
    try:
        pause = ctypes.CDLL(path).omp_pause_resource_all
    except (OSError, AttributeError):  # a libgomp older than OpenMP 5.0
        return False
    pause.restype = ctypes.c_int
    pause.argtypes = [ctypes.c_int]
    ok = pause(_OMP_PAUSE_SOFT) == 0  # -1 inside a parallel region
    log.debug("released this thread's OpenMP workers: %s", ok)
    return ok
