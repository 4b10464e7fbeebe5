"""The real sgl-router (PyPI ``sglang-router``: SGLang's Rust gateway) in front of a radixkv
server: it discovers the served model from radixkv's SGLang endpoints (``/get_model_info``,
``/get_server_info``) and forwards completions, chat and ``/generate``, whose bodies carry
SGLang's extension fields (``no_stop_trim``, ``return_hidden_states``, ``separate_reasoning``...),
which radixkv takes at their no-effect values. Issue 24 (sgl-router discovering the model)."""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engine import ServerThread
from test_server import build_tiny_engine

from radixkv.server.app import create_app

SERVED = "tiny-served"
ROUTER = shutil.which("sglang-router") or str(Path(sys.executable).parent / "sglang-router")
# the console script, or its module where the script is not on this venv's PATH (a venv that
# reaches another's site-packages through a .pth file has the package but not the script)
LAUNCH = (
    [ROUTER, "launch"]
    if Path(ROUTER).exists()
    else [sys.executable, "-m", "sglang_router.launch_router"]
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def worker() -> Iterator[str]:
    app = create_app(build_tiny_engine(), model_name=SERVED)
    with ServerThread(app) as srv:
        yield srv.base_url


@pytest.fixture(scope="module")
def router(worker: str) -> Iterator[str]:
    # the project's setup installs sglang-router (test extras): its absence is a defect to see
    installed = Path(ROUTER).exists() or importlib.util.find_spec("sglang_router") is not None
    assert installed, "sglang-router is not installed (pip install sglang-router)"
    port = _free_port()
    proc = subprocess.Popen(
        [*LAUNCH, "--worker-urls", worker, "--host", "127.0.0.1", "--port", str(port),
         "--policy", "cache_aware"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                workers = httpx.get(f"{base}/workers", timeout=2).json().get("workers", [])
                if workers and all(w.get("is_healthy") for w in workers):
                    break
            except (httpx.HTTPError, ValueError):
                pass
            assert proc.poll() is None, "sglang-router exited"
            time.sleep(0.3)
        else:
            pytest.fail("sglang-router did not register the radixkv worker within 60 s")
        yield base
    finally:
        proc.terminate()
        proc.wait(10)


def test_sgl_router_discovers_the_served_model(router: str, worker: str) -> None:
    (registered,) = httpx.get(f"{router}/workers", timeout=5).json()["workers"]
    assert registered["url"] == worker and registered["model_id"] == SERVED
    ids = [m["id"] for m in httpx.get(f"{router}/v1/models", timeout=5).json()["data"]]
    assert ids == [SERVED]
    info = httpx.get(f"{router}/get_model_info", timeout=5).json()
    assert info["served_model_name"] == SERVED and info["is_generation"] is True


def test_requests_through_sgl_router_answer_as_radixkv_does(router: str, worker: str) -> None:
    greedy = {"max_tokens": 4, "temperature": 0}
    comp = {"model": SERVED, "prompt": "The quick brown fox", **greedy}
    chat = {"model": SERVED, "messages": [{"role": "user", "content": "Say hi."}], **greedy}
    gen = {
        "text": "The quick brown fox",
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
    }
    for path, body, text in (
        ("/v1/completions", comp, lambda r: r["choices"][0]["text"]),
        ("/v1/chat/completions", chat, lambda r: r["choices"][0]["message"]["content"]),
        ("/generate", gen, lambda r: r["text"]),
    ):
        via = httpx.post(f"{router}{path}", json=body, timeout=60)
        direct = httpx.post(f"{worker}{path}", json=body, timeout=60)
        assert via.status_code == 200, (path, via.text)
        assert text(via.json()) == text(direct.json()), path


def test_sglang_fields_asking_for_what_radixkv_does_not_do_are_refused(worker: str) -> None:
    base = {"model": SERVED, "prompt": "hi", "max_tokens": 2}
    ok = {"no_stop_trim": False, "return_hidden_states": False, "separate_reasoning": True}
    assert (
        httpx.post(f"{worker}/v1/completions", json={**base, **ok}, timeout=30).status_code == 200
    )
    for field in ("no_stop_trim", "return_hidden_states"):
        r = httpx.post(f"{worker}/v1/completions", json={**base, field: True}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_sgl_router_launched_by_radixkv_checks_the_key_it_never_shows() -> None:
    """:class:`~radixkv.server.sgl_router_launch.SglRouter` (what ``radixkv cluster --router
    sglang`` runs) in front of a keyed radixkv server: sgl-router refuses clients without the
    key or with a wrong one (401), serves the key holder, and its process's command line (which
    every local user can read) never holds the key."""
    from radixkv.server.sgl_router_launch import SglRouter

    key = "sk-sgl-launch-test-0123456789"
    app = create_app(build_tiny_engine(), model_name=SERVED, api_key=key)
    reached: list[str] = []  # the paths that reached the replica (so we know who refused)

    async def recording(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            reached.append(scope["path"])
        await app(scope, receive, send)

    body = {"model": SERVED, "prompt": "The quick brown fox", "max_tokens": 3}
    with (
        ServerThread(recording) as srv,
        SglRouter([srv.base_url], _free_port(), api_key=key) as rt,
    ):
        assert rt.proc is not None
        cmdline = Path(f"/proc/{rt.proc.pid}/cmdline").read_bytes()
        assert key.encode() not in cmdline and key not in " ".join(rt.command)
        url = rt.url + "/v1/completions"
        assert httpx.post(url, json=body, timeout=30).status_code == 401
        bad = {"Authorization": "Bearer sk-wrong"}
        assert httpx.post(url, json=body, headers=bad, timeout=30).status_code == 401
        # sgl-router itself refused both: neither reached the replica
        assert "/v1/completions" not in reached, reached
        good = {"Authorization": f"Bearer {key}"}
        r = httpx.post(url, json=body, headers=good, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        assert reached.count("/v1/completions") == 1, reached
        pid = rt.proc.pid
    assert rt.proc is None and not Path(f"/proc/{pid}").exists()  # stopped with its context
