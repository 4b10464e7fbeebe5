"""A live dashboard with something to see: the real engine on a tiny model, some traffic, and a
screenshot taken by headless Chromium (the picture in the README).

    python -m bench.dashboard_demo --screenshot docs/dashboard.png
    python -m bench.dashboard_demo --serve          # keep serving: open the printed URL

The engine (tiny random Llama, byte tokenizer, page size 4) has a small device pool and a host
tier, so the chats below (three system prompts, several questions each, one salted tenant, one
pinned prefix, a repeat round) make hits, device evictions to the host and loads back.
Everything stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import httpx

SYSTEMS = [
    "You are a meticulous librarian. Answer in one short sentence and cite the shelf number.",
    "You are a travel agent who prefers trains. Give the route, the duration and one tip.",
    "You are a code reviewer. Point out the bug first, then suggest the smallest fix.",
]
QUESTIONS = [
    ["Where are the atlases?", "Which shelf holds poetry?", "Do you lend maps?"],
    ["Paris to Lyon?", "Berlin to Prague?", "Milan to Zurich?", "Vienna to Budapest?"],
    ["Why does this loop never end?", "Is this lock taken twice?"],
]


def build_app() -> Any:
    from bench.tiny_model import tiny_loaded_model
    from radixkv.engine.engine import Engine
    from radixkv.server.app import create_app

    engine = Engine(
        tiny_loaded_model(),
        page_size=4,
        kv_cache_tokens=512,
        host_cache_tokens=4096,
        attention_backend="torch",
        dtype="float32",
    )
    return create_app(engine, model_name="tiny-llama")


def traffic(base: str) -> None:
    def chat(system: str, question: str, salt: str | None = None) -> None:
        body: dict[str, Any] = {
            "model": "tiny-llama",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
            "max_tokens": 8,
        }
        if salt:
            body["cache_salt"] = salt
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
        r.raise_for_status()

    for round_ in range(2):
        for system, questions in zip(SYSTEMS, QUESTIONS):
            for q in questions:
                chat(system, q)
        chat(SYSTEMS[0], "Where is the archive?", salt="tenant-acme")
        if round_ == 0:
            pin = {"text": f"<|system|>{SYSTEMS[1]}\n", "ttl": 600}
            httpx.post(f"{base}/cache/pin", json=pin, timeout=120).raise_for_status()
        time.sleep(1.5)


def screenshot(url: str, path: str) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("chromium is not installed (setup.sh installs it)")
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                "--virtual-time-budget=5000",
                "--window-size=1400,980",
                f"--screenshot={path}",
                url,
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--screenshot", default="bench/results/dashboard_demo.png")
    ap.add_argument("--serve", action="store_true", help="keep serving after the traffic")
    args = ap.parse_args(argv)
    sys.path.insert(0, "tests")
    from fake_engine import ServerThread

    with ServerThread(build_app()) as srv:
        traffic(srv.base_url)
        url = f"{srv.base_url}/dashboard"
        screenshot(url, args.screenshot)
        print(f"screenshot written to {args.screenshot}")
        if args.serve:
            print(f"serving the dashboard at {url} (Ctrl-C stops)")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
