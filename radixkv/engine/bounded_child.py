"""A child process that does untrusted work (a request's chat template, a request's grammar) one
job at a time, over JSON lines on its stdin/stdout, bounded in time and memory: the parent kills
it at the time bound (the work stops, not just the wait), and its address space is capped.

Parent side, :class:`BoundedChild`: ``BoundedChild(module, init, memory_bytes)`` starts ``python -m
module`` in a session of its own and sends ``init`` (a JSON object) as its first line;
:meth:`BoundedChild.ask` sends a job and returns the answer, or None when the time bound passed
first (the caller then kills it). The child's start-up (imports, ``init``) is not counted in a
job's time: the first :meth:`~BoundedChild.ask` first waits up to ``start_timeout`` s for its
``{"ready": 1}`` line.

Child side, :func:`serve`: reads ``init``, runs ``setup(init)`` (imports, state), caps
``RLIMIT_AS`` at its size then plus ``init["memory_bytes"]``, says ready, and answers each job line
with ``handle(job)``. A ``MemoryError`` is answered ``{"error": ..., "limit": 1, "exit": 1}`` and
the child exits (its heap may be in any state); an answer with ``"exit"`` ends it.

Invariants: one job in flight per child; a child that timed out, died or broke the protocol is
never asked again (the owner kills it and starts another).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["BoundedChild", "serve"]

#: seconds a child may take to start (imports, ``init``) before its first job
START_TIMEOUT = 120.0


class BoundedChild:
    """``python -m module`` answering JSON-line jobs (see the module docstring)."""

    def __init__(
        self, module: str, init: dict[str, Any], memory_bytes: int, *,
        start_timeout: float = START_TIMEOUT,
    ) -> None:  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C in the server's terminal is the server's to handle
        )
        self.start_timeout = start_timeout
        self.buffer = b""
        self.ready = False
        self._send({**init, "memory_bytes": int(memory_bytes)})

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL it (its work stops), reap it, close its pipes; idempotent."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()  # type: ignore[union-attr]

    def ask(self, job: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        """Send ``job``; its answer, or None when ``timeout`` s passed first (counted from the
        child's readiness). Raises ``OSError`` or ``ValueError`` when the child died, did not
        start, or broke the protocol."""
        if not self.ready:
            if self._line(time.monotonic() + self.start_timeout) != {"ready": 1}:
                raise OSError("the child process did not start")
            self.ready = True
        self._send(job)
        return self._line(time.monotonic() + timeout)

    def _send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj).encode() + b"\n")
        self.proc.stdin.flush()

    def _line(self, deadline: float) -> dict[str, Any] | None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise OSError("the child process exited")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        answer = json.loads(line)
        if not isinstance(answer, dict):
            raise ValueError("the child process answered out of protocol")
        return answer


def _cap_memory(extra: int) -> None:
    import resource

    with open("/proc/self/statm") as fh:
        size = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (size + extra, size + extra))


OUT_OF_MEMORY = {"error": "the work ran out of its memory bound and was stopped", "limit": 1,
                 "exit": 1}  # fmt: skip


def serve(
    handle: Callable[[dict[str, Any]], dict[str, Any]],
    setup: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """The child's main loop (see the module docstring)."""
    stdin, out = sys.stdin.buffer, sys.stdout.buffer
    init = json.loads(stdin.readline() or b"{}")
    if setup is not None:
        setup(init)
    _cap_memory(int(init["memory_bytes"]))
    out.write(b'{"ready": 1}\n')
    out.flush()
    for line in stdin:
        try:
            answer = handle(json.loads(line))
            data = json.dumps(answer).encode() + b"\n"
        except MemoryError:
            answer = OUT_OF_MEMORY
            data = json.dumps(answer).encode() + b"\n"
        out.write(data)
        out.flush()
        if answer.get("exit"):
            return
