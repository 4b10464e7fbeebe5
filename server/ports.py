"""Loopback ports for the processes radixkv starts (cluster replicas, Redis, sgl-router).

A port is chosen here and bound later by another process, so it must not be taken in between.
The kernel's own pick (``bind(("127.0.0.1", 0))``) comes from the ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default), the range every outbound
connection takes its local port from: the router's, the replicas' and the clients' connections
could take a port chosen there before its server bound it (seen in CI: a replica's uvicorn
exited with "address already in use"). So ports are picked at random below that range and
checked bindable; only if none is found does the kernel choose.
"""

from __future__ import annotations

import random
import socket

__all__ = ["free_port", "free_port_run"]

#: Where the search starts: above the well-known and most registered service ports.
LOW_PORT = 20000
_TRIES = 200


def ephemeral_range_start() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_run(n: int) -> int:
    """A port ``p`` with ``p .. p + n - 1`` all bindable on loopback now, below the ephemeral
    range where possible (module docstring); else a kernel-chosen port (``n == 1``)."""
    if n < 1:
        raise ValueError(f"free_port_run: n must be >= 1, got {n}")
    top = ephemeral_range_start()
    rng = random.Random()
    if top - n > LOW_PORT:
        for _ in range(_TRIES):
            base = rng.randrange(LOW_PORT, top - n)
            if all(_bindable(base + i) for i in range(n)):
                return base
    if n > 1:
        raise RuntimeError(f"no run of {n} free loopback ports below {top}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port() -> int:
    """A TCP port free on the loopback interface right now, below the ephemeral range where
    possible (module docstring)."""
    return free_port_run(1)
