"""A real ``redis-server`` for tests: started on a free loopback port, stopped afterwards.

Use it with ``from redis_fixture import redis_server  # noqa: F401`` in a test module. The
fixture yields a :class:`RedisServer`; ``stop()`` kills it (a Redis that goes away) and
``start()`` brings it back on the same port. Tests are skipped when no ``redis-server`` binary
is installed (``setup.sh`` installs the Debian package).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest

from radixkv.server.ports import free_port

__all__ = ["RedisServer", "free_port", "redis_server"]


class RedisServer:
    """One ``redis-server`` process on ``127.0.0.1:port`` (no persistence)."""

    def __init__(self, port: int | None = None, maxmemory: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (bash setup.sh installs it)")
        self.binary = binary
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--protected-mode", "no"]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s,
            ):
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def client(self):  # -> redis.Redis
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (bash setup.sh installs it)")
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()
