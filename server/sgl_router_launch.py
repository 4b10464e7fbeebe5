"""sgl-router (PyPI ``sglang-router``, SGLang's Rust gateway) as a child process in front of
radixkv replicas: ``radixkv cluster --router sglang`` and ``bench/bench_router.py``'s ``sgl_*``
cases.

:class:`SglRouter` starts ``python -m radixkv.server.sgl_router_launch ARGS`` in a process group
of its own (output to ``router.log`` in the log directory), which calls sglang_router's own
launcher (``sglang_router.launch_router``) with ``ARGS`` plus ``--api-key`` read from the
environment (:data:`API_KEY_ENV`, removed before the router starts): the key never appears on a
command line, which every local user can read in ``/proc/PID/cmdline`` (``sglang-router launch
--api-key KEY`` would show it there until sgl-router's ``setproctitle``). :meth:`SglRouter.start`
returns once sgl-router's ``/readiness`` counts every replica healthy; :meth:`SglRouter.stop`
sends SIGTERM to its group, SIGKILL after a grace period.

Flags given to sgl-router beyond ``--worker-urls``, ``--host``, ``--port`` and ``--policy``:
Prometheus on a free loopback port (its default is 0.0.0.0:29000, which two routers would share),
worker health checks every 2 s (its default: 60 s) marking a replica unhealthy after 2 failures,
startup checks every second, and a 5 s shutdown grace period (default 180 s). Its cache-aware
thresholds stay SGLang's defaults (cache threshold 0.3, balance 64 / 1.5), which differ from
``radixkv router``'s (0.5, 32 / 1.0001).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = [
    "API_KEY_ENV",
    "SGL_POLICIES",
    "SglRouter",
    "serve_sgl_router",
    "sgl_router_args",
    "sgl_router_key",
]

#: the environment variable that carries the API key to the child (never its command line)
API_KEY_ENV = "RADIXKV_SGL_ROUTER_API_KEY"

#: radixkv's routing policy names -> sgl-router's ``--policy``
SGL_POLICIES = {"cache_aware": "cache_aware", "round_robin": "round_robin"}

logger = logging.getLogger(__name__)

_LOG_LEVELS = {"debug": "debug", "info": "info", "warning": "warn", "error": "error"}


def sgl_router_args(
    urls: Sequence[str],
    port: int,
    policy: str,
    prometheus_port: int,
    host: str = "127.0.0.1",
    log_level: str = "warning",
    health_interval: int = 2,
) -> list[str]:
    """sgl-router's arguments for ``urls`` on ``host:port`` with radixkv's ``policy`` (no key:
    see :data:`API_KEY_ENV`). Raises ``ValueError`` for a policy sgl-router has no match for."""
    if policy not in SGL_POLICIES:
        raise ValueError(f"sgl-router has no policy for {policy!r}: {', '.join(SGL_POLICIES)}")
    args = ["--worker-urls", *urls, "--host", host, "--port", str(port)]
    args += ["--policy", SGL_POLICIES[policy]]
    args += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port)]
    args += ["--health-check-interval-secs", str(health_interval)]
    args += ["--health-failure-threshold", "2", "--health-success-threshold", "1"]
    args += ["--worker-startup-check-interval", "1", "--shutdown-grace-period-secs", "5"]
    return args + ["--log-level", _LOG_LEVELS.get(log_level.lower(), "info")]


class SglRouter:
    """sgl-router over ``urls`` on ``127.0.0.1:port`` (see the module docstring).

    Args:
        urls: the replicas.
        port: the router's port.
        policy: ``cache_aware`` or ``round_robin`` (radixkv's names).
        api_key: the one API key the replicas take (sgl-router checks it on every client request
            and sends it to the replicas); None for keyless replicas.
        log_dir: ``router.log`` goes there (default: discarded).
        log_level: radixkv's level name.
    """

    def __init__(
        self,
        urls: Sequence[str],
        port: int,
        policy: str = "cache_aware",
        api_key: str | None = None,
        log_dir: str | None = None,
        log_level: str = "warning",
    ) -> None:
        from .ports import free_port

        self.urls = list(urls)
        self.port = port
        self.args = sgl_router_args(self.urls, port, policy, free_port(), log_level=log_level)
        self.api_key = api_key
        self.log_dir = log_dir
        self.proc: subprocess.Popen[Any] | None = None
        self._log: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def command(self) -> list[str]:
        """The child's command line (no key on it)."""
        return [sys.executable, "-m", "radixkv.server.sgl_router_launch", *self.args]

    def start(self, timeout: float = 120.0) -> SglRouter:
        """Start sgl-router and wait until every replica is registered and healthy; raises
        ``RuntimeError`` (after stopping it) when it exits or the time is up."""
        env = dict(os.environ)
        env.pop(API_KEY_ENV, None)
        if self.api_key is not None:
            env[API_KEY_ENV] = self.api_key
        out: Any = subprocess.DEVNULL
        if self.log_dir is not None:
            os.makedirs(self.log_dir, exist_ok=True)
            out = self._log = open(os.path.join(self.log_dir, "router.log"), "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float) -> None:
        """Wait until ``/readiness`` reports every replica healthy."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"sgl-router exited with {self.proc.returncode}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                ready = httpx.get(self.url + "/readiness", timeout=2).json()
                if ready.get("healthy_workers") == len(self.urls):
                    return
            time.sleep(0.2)
        raise RuntimeError(f"sgl-router did not report {len(self.urls)} healthy replicas")

    def healthy_workers(self) -> int:
        """How many replicas sgl-router counts healthy now (``/readiness``)."""
        import httpx

        return int(httpx.get(self.url + "/readiness", timeout=5).json().get("healthy_workers", 0))

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to the router's process group, SIGKILL after ``grace`` s (idempotent)."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> SglRouter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def sgl_router_key(keys: dict[str, Any]) -> str:
    """The one API key sgl-router takes from :func:`~radixkv.server.cluster.router_keys`'s
    ``keys``. Raises ``ValueError`` without a key (sgl-router has no ``Host`` check and forwards
    with a loopback ``Host``, so a keyless sgl-router on loopback serves any web page whose name
    resolves to 127.0.0.1: DNS rebinding; with a key, such a page gets 401 on every path) and for
    several keys (sgl-router checks a single ``--api-key``, so the others' holders would get
    401s from it)."""
    api_keys = keys["api_keys"]
    if not api_keys:
        raise ValueError(
            "--router sglang needs an API key (--api-key or --api-key-file after --): "
            "sgl-router has no Host check, so a keyless one is open to DNS rebinding (a web "
            "page whose name resolves to 127.0.0.1 could read completions and register its own "
            "worker); without a key use --router radixkv, which refuses a non-loopback Host"
        )
    if len(api_keys) > 1:
        raise ValueError(
            f"--router sglang takes one API key and the replicas take {len(api_keys)}: "
            "sgl-router checks a single key (use --router radixkv for several keys or tenants)"
        )
    return str(api_keys[0])


def serve_sgl_router(
    urls: Sequence[str], port: int, policy: str, keys: dict[str, Any], args: Any
) -> None:
    """``radixkv cluster --router sglang``'s front: sgl-router on ``port`` over ``urls`` until
    it exits (raises ``RuntimeError``) or this process is interrupted (it is stopped then)."""
    router = SglRouter(urls, port, policy, sgl_router_key(keys), args.log_dir, args.log_level)
    try:
        router.start()
        logger.info("sgl-router on %s (%s) -> %s", router.url, policy, ", ".join(urls))
        while router.proc is not None and router.proc.poll() is None:
            time.sleep(0.5)
        code = router.proc.returncode if router.proc is not None else None
        raise RuntimeError(f"sgl-router exited with {code} (see router.log in --log-dir)")
    finally:
        router.stop()


def main(argv: Sequence[str] | None = None) -> None:
    """The child: sglang_router's launcher with ``argv`` and the key from :data:`API_KEY_ENV`."""
    from sglang_router.launch_router import launch_router, parse_router_args

    args = list(sys.argv[1:] if argv is None else argv)
    key = os.environ.pop(API_KEY_ENV, None)
    if key:
        args += ["--api-key", key]
    launch_router(parse_router_args(args))


if __name__ == "__main__":
    main()
