"""A real local Redis Cluster for tests: three masters (no replicas) on free loopback ports.

Each node is a ``redis-server --cluster-enabled yes`` with its ``nodes-PORT.conf`` in a private
temporary directory; ``redis-cli --cluster create`` assigns the 16384 slots and the cluster is
ready once every node reports ``cluster_state:ok``. :meth:`LocalCluster.kill` stops one node (a
shard that goes away) and :meth:`LocalCluster.restart` brings it back on the same port with the
same ``nodes.conf``, so it rejoins owning the same slots. The nodes run with
``cluster-require-full-coverage no`` (the setting the docs recommend for a cache: the surviving
shards keep answering while one is down) and a short ``cluster-node-timeout``.

Each node's cluster bus port is chosen like its client port (``cluster-port``, below the
kernel's ephemeral range), not left at Redis's default of port + 10000: that default landed in
the ephemeral range, where an outbound connection can hold it, and a node then failed to start
(CI: "cluster node 32152 did not start"). A node's log stays in the data directory and its tail
is in the error when a node does not start.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_fixture import free_port

__all__ = ["LocalCluster", "redis_cluster"]


def _answers(
    port: int, command: bytes, want: bytes, password: str | None = None, timeout: float = 0.3
) -> bool:
    """True when ``127.0.0.1:port`` answers ``command`` (raw RESP inline) with ``want`` in it."""
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout) as s:
        if password is not None:
            command = b"AUTH " + password.encode() + b"\r\n" + command
        s.sendall(command)
        data = b""
        deadline = time.monotonic() + timeout
        while want not in data and time.monotonic() < deadline:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
        return want in data
    return False


class LocalCluster:
    """``n`` Redis Cluster masters on ``127.0.0.1`` (ports :attr:`ports`), data in a temp dir."""

    def __init__(
        self, n: int = 3, node_timeout_ms: int = 2000, password: str | None = None
    ) -> None:
        server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if server is None or cli is None:
            raise RuntimeError("redis-server / redis-cli are not installed (bash setup.sh)")
        self.server, self.cli = server, cli
        self.node_timeout_ms = node_timeout_ms
        self.password = password  # requirepass (and masterauth) of every node
        self.dir = Path(tempfile.mkdtemp(prefix="radixkv-test-rediscluster-"))
        self.ports: list[int] = []
        self.bus_ports: dict[int, int] = {}  # client port -> cluster bus port
        while len(self.ports) < n:
            p, bus = free_port(), free_port()
            taken = {*self.ports, *self.bus_ports.values()}
            if p != bus and p not in taken and bus not in taken:
                self.ports.append(p)
                self.bus_ports[p] = bus
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """The ``--remote-cache`` URL (any node works as the startup node)."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def _spawn(self, port: int) -> None:
        args = [self.server, "--port", str(port), "--bind", "127.0.0.1"]
        args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"]
        args += ["--cluster-port", str(self.bus_ports[port])]
        args += ["--logfile", f"node-{port}.log"]
        args += ["--cluster-node-timeout", str(self.node_timeout_ms)]
        args += ["--cluster-require-full-coverage", "no"]
        args += ["--appendonly", "no", "--save", "", "--protected-mode", "no"]
        args += ["--dir", str(self.dir)]
        if self.password is not None:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        self.procs[port] = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self.dir
        )
        deadline = time.monotonic() + 10
        while not _answers(port, b"PING\r\n", b"+PONG", self.password):
            if self.procs[port].poll() is not None or time.monotonic() > deadline:
                log = self.dir / f"node-{port}.log"
                tail = log.read_text(errors="replace")[-1500:] if log.is_file() else "(no log)"
                raise RuntimeError(
                    f"cluster node {port} (bus {self.bus_ports[port]}) did not start; "
                    f"exit code {self.procs[port].poll()}; its log ends: {tail}"
                )
            time.sleep(0.05)

    def start(self) -> None:
        for port in self.ports:
            self._spawn(port)
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        auth = [] if self.password is None else ["-a", self.password]
        subprocess.run(
            [self.cli, *auth, "--cluster", "create", *nodes]
            + ["--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=60,
        )
        self.wait_ok()

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Wait until every running node reports ``cluster_state:ok``."""
        deadline = time.monotonic() + timeout
        for port in self.procs:
            while not _answers(port, b"CLUSTER INFO\r\n", b"cluster_state:ok", self.password):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cluster node {port} never reported cluster_state:ok")
                time.sleep(0.1)

    def kill(self, port: int) -> None:
        """Kill the node on ``port`` (SIGKILL: a shard that goes away)."""
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait(timeout=10)

    def restart(self, port: int) -> None:
        """Start the node on ``port`` again (same port, same ``nodes-PORT.conf``)."""
        self._spawn(port)
        self.wait_ok()

    def client(self, port: int):  # -> redis.Redis
        """A plain client of one node (``DBSIZE`` per shard)."""
        import redis

        return redis.Redis(host="127.0.0.1", port=port, password=self.password)

    def stop(self) -> None:
        """Kill every node and remove the data directory (idempotent)."""
        for port in list(self.procs):
            with contextlib.suppress(Exception):
                self.kill(port)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[LocalCluster]:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server / redis-cli are not installed (bash setup.sh installs them)")
    cluster = LocalCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
