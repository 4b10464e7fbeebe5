"""``radixkv cluster``: Redis, N replicas and the router on one machine, stopped together.

``radixkv cluster --replicas 2 --port 8000`` starts

1. ``redis-server`` on a free loopback port (no persistence, ``maxmemory`` with
   ``allkeys-lru``) that requires a password: the shared remote KV tier (skipped with
   ``--no-remote-cache``);
2. ``N`` ``radixkv serve`` processes on ``port+1 .. port+N``, each pinned to its own share of
   the CPUs (``os.sched_setaffinity``; ``OMP_NUM_THREADS`` set to match), each with
   ``--remote-cache redis://127.0.0.1:REDIS/0``, ``--kv-mac-key-file`` (one secret for all of
   them: the MAC of the pages they share); the remote tier's own default write policy
   (``write_through``) sends a prefix to Redis as soon as it is cached, so the other replicas
   can use it at once (``--remote-write-policy write_back`` after ``--`` sends pages only on
   eviction); arguments after ``--`` go to every replica (a ``--kv-mac-key-file`` there
   replaces the cluster's);
3. the router on ``port``, once every replica answers ``/health``: sgl-router as a child process
   (``--router sglang``, and ``auto``, the default, without tenants: :func:`choose_router`), or
   ``radixkv router``'s app in this process (``--router radixkv``; ``auto`` with several keys or
   tenants) (sgl-router: :mod:`radixkv.server.sgl_router_launch`, ``--policy`` mapped to its
   own, one API key at most, passed in its environment, never on its command line).

Secrets: the Redis password and the KV MAC key are fresh random values per cluster, written to
files of mode 0600 in a private work directory (0700, removed at stop): ``redis.conf``
(``requirepass``; ``redis-server redis.conf``) and ``kv_mac.key``. No command line carries the
password (``/proc/PID/cmdline`` is world-readable): replicas get it in their environment
(``RADIXKV_REDIS_PASSWORD``), and :attr:`Cluster.redis_url` (with the password, for library
users) is logged only through ``redact_url``.

Ctrl-C (or any failure) stops the router, then the replicas, then Redis. :class:`Cluster` is the
same as a library (the router bench uses it without the router).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from radixkv.cache.kv_mac import KEY_FILE_NAME, create_secret_file
from radixkv.cache.private_files import write_new_file
from radixkv.cache.remote_store import PASSWORD_ENV

from .ports import free_port
from .redaction import redact_argv, redact_url

__all__ = [
    "Cluster",
    "choose_router",
    "add_cluster_parser",
    "cluster_from_args",
    "free_port",
    "run_cluster",
    "split_cores",
]

logger = logging.getLogger(__name__)


def split_cores(n: int, cores: Sequence[int] | None = None) -> list[list[int]]:
    """Split the CPUs this process may use into ``n`` contiguous groups (one per replica); with
    fewer CPUs than replicas, replicas share CPUs in turn."""
    if n < 1:
        raise ValueError(f"need at least one replica, got {n}")
    avail = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if len(avail) < n:
        return [[avail[i % len(avail)]] for i in range(n)]
    size, extra = divmod(len(avail), n)
    out, at = [], 0
    for i in range(n):
        k = size + (1 if i < extra else 0)
        out.append(avail[at : at + k])
        at += k
    return out


def _pin(cores: Sequence[int]) -> Callable[[], None]:
    def pin() -> None:
        os.sched_setaffinity(0, set(cores))
        os.setpgrp()  # Ctrl-C goes to the cluster, which stops the replicas in order

    return pin


def wait_healthy(url: str, proc: subprocess.Popen[Any] | None, timeout: float) -> None:
    """Wait until ``GET url/health`` answers 200; raises ``RuntimeError`` when ``proc`` exits or
    the time is up."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy within {timeout:.0f} s")


class Cluster:
    """Redis + ``replicas`` ``radixkv serve`` processes on loopback (see the module docstring).

    Args:
        replicas: how many replicas.
        base_port: replica ``i`` listens on ``base_port + 1 + i`` (0 = free ports).
        model: ``--model`` of every replica.
        serve_args: more ``radixkv serve`` arguments for every replica.
        remote_cache: start Redis and pass ``--remote-cache`` to the replicas.
        redis_maxmemory: Redis ``maxmemory`` (``allkeys-lru`` beyond it).
        cores: the CPUs to split between replicas (default: this process's affinity).
        log_dir: where each process's output goes (default: inherited stdout/stderr).

    Raises ``ValueError`` for a ``redis_maxmemory`` that is not a size (``1gb``, ``512mb``).
    """

    def __init__(
        self,
        replicas: int = 2,
        base_port: int = 0,
        model: str = "smollm2",
        serve_args: Sequence[str] = (),
        remote_cache: bool = True,
        redis_maxmemory: str = "1gb",
        redis_port: int = 0,
        cores: Sequence[int] | None = None,
        log_dir: str | None = None,
    ) -> None:
        if remote_cache and not re.fullmatch(r"[0-9]+[a-zA-Z]{0,2}", redis_maxmemory):
            raise ValueError(f"--redis-maxmemory {redis_maxmemory!r} is not a size like 1gb")
        self.n = replicas
        self.core_groups = split_cores(replicas, cores) if replicas else []  # 0: Redis alone
        self.ports = [base_port + 1 + i if base_port else free_port() for i in range(replicas)]
        self.model = model
        self.serve_args = list(serve_args)
        self.remote_cache = remote_cache
        self.redis_maxmemory = redis_maxmemory
        self.redis_port = redis_port or (free_port() if remote_cache else 0)
        self.log_dir = log_dir
        #: fresh per cluster; never logged, never on a command line
        self.redis_password = secrets.token_hex(24) if remote_cache else None
        self.work_dir: str | None = None  # created on first use (see _secrets), removed at stop
        self.redis: subprocess.Popen[Any] | None = None
        self.procs: list[subprocess.Popen[Any]] = []
        self._logs: list[Any] = []
        self._old_sigterm: Any = None

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    @property
    def redis_url(self) -> str | None:
        """The URL of the cluster's Redis, password included (log it through ``redact_url``)."""
        if not self.remote_cache:
            return None
        return f"redis://:{self.redis_password}@127.0.0.1:{self.redis_port}/0"

    @property
    def replica_redis_url(self) -> str | None:
        """The URL on the replicas' command lines: no password (they get it in their
        environment, ``RADIXKV_REDIS_PASSWORD``)."""
        return f"redis://127.0.0.1:{self.redis_port}/0" if self.remote_cache else None

    def _secrets(self) -> str:
        """The private work directory (0700) with ``kv_mac.key`` (0600), created once."""
        if self.work_dir is None:
            self.work_dir = tempfile.mkdtemp(prefix="radixkv-cluster-")
            create_secret_file(os.path.join(self.work_dir, KEY_FILE_NAME))
        return self.work_dir

    @property
    def kv_mac_key_file(self) -> str | None:
        """The key file every replica gets (None without the remote tier, or when the serve
        arguments name their own)."""
        if not self.remote_cache or any(
            a.partition("=")[0] == "--kv-mac-key-file" for a in self.serve_args
        ):
            return None
        return os.path.join(self._secrets(), KEY_FILE_NAME)

    def _out(self, name: str) -> Any:
        if self.log_dir is None:
            return None
        os.makedirs(self.log_dir, exist_ok=True)
        f = open(os.path.join(self.log_dir, name + ".log"), "ab")  # noqa: SIM115
        self._logs.append(f)
        return f

    def start(self, timeout: float = 600.0) -> Cluster:
        """Start Redis and the replicas and wait until every replica is healthy. In the main
        thread, SIGTERM becomes ``SystemExit`` until :meth:`stop`, so a terminated caller still
        stops its replicas (they run in process groups of their own)."""
        if threading.current_thread() is threading.main_thread():

            def on_sigterm(signum: int, frame: Any) -> None:
                raise SystemExit(128 + signum)

            self._old_sigterm = signal.signal(signal.SIGTERM, on_sigterm)
        try:
            if self.remote_cache:
                self._start_redis()
            for i in range(self.n):
                self._start_replica(i)
            for url, proc in zip(self.urls, self.procs):
                wait_healthy(url, proc, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_redis(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (bash setup.sh installs it)")
        conf = os.path.join(self._secrets(), "redis.conf")
        lines = [
            f"port {self.redis_port}",
            "bind 127.0.0.1",
            'save ""',
            "appendonly no",
            f"maxmemory {self.redis_maxmemory}",
            "maxmemory-policy allkeys-lru",
            f"requirepass {self.redis_password}",
        ]
        if not os.path.exists(conf):  # a restart reuses it
            write_new_file(conf, ("\n".join(lines) + "\n").encode())  # mode 0600
        out = self._out("redis")
        self.redis = subprocess.Popen(
            [binary, conf],
            stdout=out or subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            preexec_fn=os.setpgrp,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.redis_port), timeout=0.2),
            ):
                logger.info("redis-server on 127.0.0.1:%d (password required)", self.redis_port)
                return
            if self.redis.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.redis_port}")

    def replica_command(self, i: int) -> list[str]:
        """The command line of replica ``i`` (``radixkv serve`` with its port, the remote tier and
        the cluster's KV MAC key file when on, then the extra serve arguments). It carries no
        password (see :attr:`replica_redis_url`)."""
        cmd = [sys.executable, "-m", "radixkv", "serve", "--model", self.model]
        cmd += ["--port", str(self.ports[i]), "--host", "127.0.0.1"]
        if self.remote_cache:
            cmd += ["--remote-cache", str(self.replica_redis_url)]
            key_file = self.kv_mac_key_file
            if key_file is not None:
                cmd += ["--kv-mac-key-file", key_file]
        return cmd + self.serve_args

    def _start_replica(self, i: int) -> None:
        cores = self.core_groups[i]
        cmd = self.replica_command(i)
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = str(len(cores))
        if self.redis_password is not None:
            env[PASSWORD_ENV] = self.redis_password
        out = self._out(f"replica{i}")
        logger.info(
            "replica %d on %s, cores %s: %s", i, self.urls[i], cores, " ".join(redact_argv(cmd))
        )
        proc = subprocess.Popen(
            cmd,
            env=env,
            preexec_fn=_pin(cores),
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
        )
        if i < len(self.procs):
            self.procs[i] = proc
        else:
            self.procs.append(proc)

    def kill_replica(self, i: int) -> None:
        """SIGKILL replica ``i`` (a crash: no drain, no shutdown hooks) and reap it."""
        proc = self.procs[i]
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)

    def restart_replica(self, i: int, timeout: float = 600.0) -> None:
        """Start replica ``i`` again on its port (after :meth:`kill_replica` or a crash) and wait
        until it is healthy."""
        if self.procs[i].poll() is None:
            raise RuntimeError(f"replica {i} is still running")
        self._start_replica(i)
        wait_healthy(self.urls[i], self.procs[i], timeout)

    def kill_redis(self) -> None:
        """SIGKILL the cluster's Redis (its data goes with it: no persistence)."""
        if self.redis is not None:
            self.redis.kill()
            self.redis.wait(timeout=10)

    def restart_redis(self) -> None:
        """Start Redis again on the same port with the same password (empty)."""
        if self.redis is not None and self.redis.poll() is None:
            raise RuntimeError("redis-server is still running")
        self._start_redis()

    def stop(self) -> None:
        """Stop the replicas (SIGINT, then SIGKILL after 15 s), then Redis, and remove the work
        directory with the secrets (idempotent)."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    proc.send_signal(signal.SIGINT)
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.procs = []
        if self.redis is not None:
            self.redis.kill()
            self.redis.wait(timeout=10)
            self.redis = None
        if self.work_dir is not None:
            shutil.rmtree(self.work_dir, ignore_errors=True)
            self.work_dir = None
        for f in self._logs:
            f.close()
        self._logs = []
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def add_cluster_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``radixkv cluster`` on ``subparsers`` (sets ``func=run_cluster``)."""
    from radixkv.server.router_policy import POLICIES

    p = subparsers.add_parser(
        "cluster",
        help="start Redis, N pinned replicas and the router on loopback (Ctrl-C stops all)",
        description="One machine, several replicas: redis-server (the shared remote KV tier), "
        "N `radixkv serve` processes on PORT+1..PORT+N each pinned to its own CPUs, and the "
        "router on PORT. Arguments after `--` go to every replica.",
    )
    p.add_argument("--replicas", type=int, default=2, help="how many replicas (default 2)")
    p.add_argument("--port", type=int, default=8000, help="router port; replicas use the next")
    p.add_argument("--model", default="smollm2", help="model of every replica (default smollm2)")
    p.add_argument("--policy", choices=POLICIES, default="cache_aware")
    p.add_argument(
        "--router",
        choices=("auto", "radixkv", "sglang"),
        default="auto",
        help="the front: sgl-router (PyPI sglang-router) as a child process, or radixkv's "
        "router in this process; auto (the default) takes sgl-router (as good or better on "
        "bench_router: hit rate, TTFT, throughput) when the replicas take exactly one API key, "
        "radixkv's router otherwise: keyless (sgl-router has no Host check, so a keyless one is "
        "open to DNS rebinding; --router sglang is refused without a key), or several API keys "
        "or tenants (--salt-from-api-key), which only radixkv's router checks and keeps apart",
    )
    p.add_argument(
        "--no-remote-cache", action="store_true", help="no Redis: replicas share nothing"
    )
    p.add_argument("--redis-port", type=int, default=0, help="Redis port (default: a free one)")
    p.add_argument(
        "--redis-maxmemory", default="1gb", help="Redis maxmemory, allkeys-lru (default 1gb)"
    )
    p.add_argument("--log-dir", default=None, help="write each process's output there")
    p.add_argument("--log-level", default="info")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then `radixkv serve` flags")
    p.set_defaults(func=run_cluster)
    return p


def cluster_from_args(args: argparse.Namespace) -> Cluster:
    """The (not yet started) :class:`Cluster` that ``radixkv cluster`` runs for ``args``."""
    extra = list(args.serve_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    return Cluster(
        args.replicas,
        args.port,
        args.model,
        extra,
        remote_cache=not args.no_remote_cache,
        redis_maxmemory=args.redis_maxmemory,
        redis_port=args.redis_port,
        log_dir=args.log_dir,
    )


def router_keys(serve_args: Sequence[str]) -> dict[str, Any]:
    """The key arguments of ``create_router_app`` from the replicas' ``radixkv serve`` arguments
    (``--api-key``, ``--api-key-file``, ``--salt-from-api-key``, ``--admin-key``,
    ``--admin-key-file`` or ``RADIXKV_ADMIN_KEY``), so the router checks the keys the replicas
    take. Raises ``ValueError`` for a bad key or key file."""
    from radixkv.server.key_flags import add_key_flags, keys_from_args

    p = argparse.ArgumentParser(add_help=False)
    add_key_flags(p, public_metrics=False)
    keys = keys_from_args(p.parse_known_args(list(serve_args))[0])
    return {
        "api_keys": keys.api_keys,
        "admin_key": keys.admin_key,
        "salt_from_api_key": keys.salt_from_api_key,
    }


def choose_router(choice: str, keys: dict[str, Any]) -> str:
    """``auto``: sgl-router (bench_router: as good or better than radixkv's on hit rate, TTFT
    and throughput at 2 and 4 replicas) when the replicas take exactly one API key and no
    tenants; radixkv's router otherwise. Keyless, because sgl-router has no ``Host`` check and
    forwards with a loopback ``Host``: a web page whose name resolves to 127.0.0.1 (DNS
    rebinding) would read completions (and ``cached_tokens``, an oracle for the operator's
    prompts) and register its own worker with ``POST /workers``; radixkv's router refuses a
    non-loopback ``Host`` (421) and a cross-site POST (403) as the replicas do. With several keys
    or tenants (``--salt-from-api-key``), because sgl-router checks one key and its prefix tree
    is shared by all callers."""
    if choice != "auto":
        return choice
    one_key = len(keys["api_keys"]) == 1 and not keys["salt_from_api_key"]
    return "sglang" if one_key else "radixkv"


def run_cluster(args: argparse.Namespace) -> int:
    """Start everything, serve the router until Ctrl-C, stop everything. Returns the exit
    code."""
    from radixkv.server.router import create_router_app
    from radixkv.server.router_cli import serve_router_app
    from radixkv.server.sgl_router_launch import serve_sgl_router, sgl_router_key

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Ctrl-C stops the cluster even when it was started with SIGINT ignored (a background job
    # of a non-interactive shell inherits that): Python installs no handler then, and the
    # sgl-router front (unlike uvicorn, which installs its own) would never see the interrupt
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        cluster = cluster_from_args(args)
        keys = router_keys(cluster.serve_args)
        args.router = choose_router(args.router, keys)
        if args.router == "sglang":
            sgl_router_key(keys)  # one key at most: refused before anything starts
    except (ValueError, RuntimeError) as exc:
        print(f"radixkv cluster: {exc}", file=sys.stderr)
        return 2
    try:
        cluster.start()
        logger.info(
            "cluster: %s router http://127.0.0.1:%d (%s) -> %s; remote cache %s",
            args.router,
            args.port,
            args.policy,
            ", ".join(cluster.urls),
            redact_url(cluster.redis_url) if cluster.redis_url else "off",
        )
        if args.router == "sglang":  # returns only by raising (its exit, Ctrl-C, SIGTERM)
            serve_sgl_router(cluster.urls, args.port, args.policy, keys, args)
        app = create_router_app(cluster.urls, args.policy, **keys)
        serve_router_app(app, "127.0.0.1", args.port, args.log_level)
    except KeyboardInterrupt:
        pass
    except RuntimeError as exc:
        print(f"radixkv cluster: {exc}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
    return 0
