"""Commit the KV pool's memory in the background while the server is idle.

The pool is lazily zeroed (:func:`radixkv.model.hugepages.huge_zeros`): start-up costs nothing,
and memory is committed where a step first writes it. In the VMs measured that first write is
slow: one 2,048-token prefill step's K/V stores took 53 ms into pool memory never written
before and 15 ms into memory committed ahead (``python -m bench.bench_step --startup``, Zen 4
host), and a cold burst writes fresh pages for every prompt. vLLM pays this at start-up, by filling its
cache. :class:`Prefaulter` pays it in idle time instead: a daemon thread walks the pool in
rounds of ``chunk_bytes`` of every layer's K and V, page order first (the allocator hands out
low page ids first, so the pages a burst takes first are committed first), and commits each
range with ``MADV_POPULATE_WRITE``, which changes no byte, so it is safe beside a running step.
Before each round it waits for ``idle()``; it never competes with a step for the cores.

Invariant: contents of the pool are never changed; a stop request ends the thread within one
round (a few tens of milliseconds).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from radixkv.model.hugepages import populate

__all__ = ["Prefaulter", "commit_pool", "pool_tensors"]

log = logging.getLogger(__name__)

#: Bytes of each tensor committed per round (one 2 MiB huge page).
CHUNK_BYTES = 2 << 20
#: How often an idle wait looks again.
IDLE_POLL_S = 0.05


class Prefaulter:
    """Background commit of ``tensors`` (CPU) in rounds taken only while ``idle()`` is true.

    Args:
        tensors: the pool's per-layer K and V tensors (CPU; others are skipped).
        idle: whether the engine has nothing to do right now (called from this thread).
        chunk_bytes: bytes of each tensor per round.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        idle: Callable[[], bool],
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self.tensors = [t for t in tensors if t.device.type == "cpu"]
        self.idle = idle
        self.chunk_bytes = chunk_bytes
        self.committed = 0  # bytes committed so far
        self.total = sum(t.untyped_storage().nbytes() for t in self.tensors)
        self.supported = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the background thread (once)."""
        if self._thread is None and self.tensors:
            self._thread = threading.Thread(target=self.run, name="radixkv-prefault", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the thread to stop and wait for it (at most ``timeout`` seconds)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def done(self) -> bool:
        """Whether every byte is committed (or committing is unsupported here)."""
        return not self.supported or self.committed >= self.total

    def run(self) -> None:
        """Commit every tensor, round by round, each round in idle time (the thread's body)."""
        start = time.perf_counter()
        longest = max((t.untyped_storage().nbytes() for t in self.tensors), default=0)
        for offset in range(0, longest, self.chunk_bytes):
            while not self.idle():
                if self._stop.wait(IDLE_POLL_S):
                    return
            if self._stop.is_set():
                return
            for t in self.tensors:
                n = min(self.chunk_bytes, t.untyped_storage().nbytes() - offset)
                if n <= 0:
                    continue
                if not populate(t, offset, n):
                    self.supported = False
                    log.info("KV pool prefault unavailable here (MADV_POPULATE_WRITE failed)")
                    return
                self.committed += n
        log.info(
            "KV pool committed in the background: %.0f MB in %.1f s",
            self.committed / 2**20,
            time.perf_counter() - start,
        )


def pool_tensors(engine: object) -> list[torch.Tensor]:
    """The KV pool's per-layer K and V tensors of ``engine``, found by name (``runner.pool``'s
    ``k`` and ``v``): none for an engine without them (a stand-in engine, a layout without
    per-layer tensors). Any object, not an engine type: this layer does not import the engine,
    and the server hands over whatever engine it serves."""
    pool = getattr(getattr(engine, "runner", None), "pool", None)
    return [*getattr(pool, "k", ()), *getattr(pool, "v", ())]


def commit_pool(engine: object) -> int:
    """Commit ``engine``'s whole KV pool now, in this thread (what vLLM pays at start-up by
    filling its cache; an offline burst's first writes then do not fault). Returns the bytes
    committed (0 where ``MADV_POPULATE_WRITE`` is unsupported)."""
    prefaulter = Prefaulter(pool_tensors(engine), lambda: True)
    prefaulter.run()
    return prefaulter.committed
