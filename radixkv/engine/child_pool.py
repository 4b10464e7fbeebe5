"""Bounded child processes lent one job at a time, and a per-key bound on jobs in flight: the
parts that the template sandbox (:mod:`~radixkv.engine.template_sandbox`) and the grammar
compiler (:mod:`~radixkv.engine.grammar_compiler`) share.

:class:`ChildPool` holds up to ``size`` :class:`~radixkv.engine.bounded_child.BoundedChild`
processes of one module. Invariants: a child is idle or lent, never both; at most ``size``
exist; a child given back as spent (it timed out, died, broke the protocol or asked to exit) is
killed, counted in ``killed``, and replaced by a fresh one unless the pool is closed.

:class:`KeyLimit` counts each key's jobs in flight, at most ``limit`` each. The key ``None``
(a server without API keys: one tenant) is not counted: the pool's size is its bound, in both
users alike.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Hashable
from typing import Any

from radixkv.engine.bounded_child import BoundedChild

__all__ = ["ChildPool", "KeyLimit"]


class ChildPool:
    """Up to ``size`` children running ``python -m module`` (see the module docstring); none
    start before :meth:`start`."""

    def __init__(self, module: str, memory_bytes: int, size: int) -> None:
        if size < 1 or memory_bytes <= 0:
            raise ValueError("a child pool needs size >= 1 and memory_bytes > 0")
        self.module = module
        self.memory_bytes = int(memory_bytes)
        self.size = int(size)
        self.killed = 0  #: children stopped because they were spent (a bound, a death)
        self._init: dict[str, Any] | None = None
        self._idle: queue.SimpleQueue[BoundedChild] = queue.SimpleQueue()
        self._lent: set[BoundedChild] = set()
        self._count = 0  # idle + lent
        self._lock = threading.Lock()
        self._closed = False

    def start(self, init: dict[str, Any]) -> None:
        """Start the missing children with ``init`` (their imports overlap the caller's
        work); idempotent."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self.module} pool is closed")
            self._init = dict(init)
            missing = self.size - self._count
            self._count += missing
        for _ in range(missing):
            self._idle.put(self._spawn())

    def _spawn(self) -> BoundedChild:
        assert self._init is not None, "start() first"
        return BoundedChild(self.module, self._init, self.memory_bytes)

    def lend(self, timeout: float | None = None) -> BoundedChild | None:
        """An idle child (a dead one is replaced first), or None when none frees up within
        ``timeout`` seconds (None: wait)."""
        try:
            child = self._idle.get(timeout=timeout)
        except queue.Empty:
            return None
        if not child.alive():  # died while idle (killed from outside): start another
            child.kill()
            child = self._spawn()
        with self._lock:
            self._lent.add(child)
        return child

    def give_back(self, child: BoundedChild, keep: bool) -> None:
        """Return a lent child: idle again when ``keep`` (and alive), else killed, counted and
        replaced (not once the pool is closed)."""
        keep = keep and child.alive()
        with self._lock:
            self._lent.discard(child)
            closed = self._closed
            if not keep:
                self.killed += 1
            if closed:
                self._count -= 1
        if not keep or closed:
            child.kill()
        if not closed:
            self._idle.put(child if keep else self._spawn())

    def pids(self) -> list[int]:
        """The pids of the pool's children (idle and lent)."""
        with self._lock:
            lent = list(self._lent)
        idle = self._drain()
        for child in idle:
            self._idle.put(child)
        return sorted(c.pid for c in idle + lent)

    def _drain(self) -> list[BoundedChild]:
        out = []
        while True:
            try:
                out.append(self._idle.get_nowait())
            except queue.Empty:
                return out

    def check_integrity(self) -> None:
        """Raises ``AssertionError`` unless no child is both idle and lent and at most ``size``
        exist."""
        with self._lock:
            lent = set(self._lent)
            count = self._count
        idle = self._drain()
        try:
            assert not lent.intersection(idle), "a child is both idle and lent"
            assert len(idle) + len(lent) <= min(count, self.size), (len(idle), len(lent), count)
        finally:
            for child in idle:
                self._idle.put(child)

    def close(self) -> None:
        """Kill the idle children now, the lent ones when given back; idempotent."""
        with self._lock:
            self._closed = True
        idle = self._drain()
        with self._lock:
            self._count -= len(idle)
        for child in idle:
            child.kill()


class KeyLimit:
    """Jobs in flight per key, at most ``limit`` each; ``None`` is not counted (module
    docstring)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("a per-key limit must be >= 1")
        self.limit = int(limit)
        self._in_flight: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    def acquire(self, key: Hashable) -> bool:
        """Count one more job of ``key``; False (nothing counted) when it has ``limit``."""
        if key is None:
            return True
        with self._lock:
            n = self._in_flight.get(key, 0)
            if n >= self.limit:
                return False
            self._in_flight[key] = n + 1
            return True

    def release(self, key: Hashable) -> None:
        """One job of ``key`` ended."""
        if key is None:
            return
        with self._lock:
            left = self._in_flight[key] - 1
            if left:
                self._in_flight[key] = left
            else:
                del self._in_flight[key]

    def in_flight(self, key: Hashable) -> int:
        """Jobs of ``key`` in flight now."""
        with self._lock:
            return self._in_flight.get(key, 0)

    def total(self) -> int:
        """Jobs of every (counted) key in flight now."""
        with self._lock:
            return sum(self._in_flight.values())

    def check_integrity(self) -> None:
        """Raises ``AssertionError`` unless every count is in ``(0, limit]``."""
        with self._lock:
            assert all(0 < n <= self.limit for n in self._in_flight.values()), self._in_flight
