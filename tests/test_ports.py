"""The loopback ports radixkv picks for the processes it starts (server/ports.py)."""

from __future__ import annotations

import socket

import pytest

from radixkv.server import ports
from radixkv.server.ports import ephemeral_range_start, free_port, free_port_run


def test_a_port_run_is_bindable_and_below_the_ephemeral_range() -> None:
    top = ephemeral_range_start()
    for n in (1, 3, 6):
        base = free_port_run(n)
        assert base + n <= top, (base, n, top)  # outbound connections never take these
        socks = [socket.socket() for _ in range(n)]
        try:
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", base + i))
        finally:
            for s in socks:
                s.close()
    assert free_port() < top


def test_a_port_taken_now_is_not_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", free_port()))
    held.listen()
    taken = held.getsockname()[1]
    draws = iter([taken - 1, taken, taken + 1])  # runs of 2 that include it, then one that does not

    class Draws:
        def randrange(self, lo: int, hi: int) -> int:
            return next(draws)

    monkeypatch.setattr(ports.random, "Random", Draws)
    try:
        assert ports.free_port_run(2) == taken + 1
    finally:
        held.close()


def test_an_empty_run_is_refused() -> None:
    with pytest.raises(ValueError, match="n must be >= 1"):
        free_port_run(0)
