"""A noisy tenant against a quiet one (issue 59, findings 2 and 5): what another key's request
waits while one key's chat template or grammar compile runs.

On the tiny model behind a keyed server that trusts request templates (two keys):

* **template**: key B streams 1,500 tokens; key A sends a chat whose own template loops
  4,000 x 4,000 times (~0.8 s of Jinja). Printed: A's status and time, B's longest gap between
  two tokens while A's template ran, and B's median gap before.
* **grammar**: key A sends three 1,300-property JSON schemas at once (~1.5 s of compile each over
  the tiny vocabulary), key B a small new schema 0.3 s later. Printed: A's statuses and times,
  B's status and time.

Run from a checkout's root (``python -m bench.bench_noisy_tenant``); run it in a worktree of an
older commit to compare (it imports that checkout's radixkv). docs/performance.md has the figures
before and after issue 59.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import httpx

sys.path.insert(0, "tests")  # the tests' ServerThread (uvicorn in a thread)
from fake_engine import ServerThread  # noqa: E402

from bench.tiny_model import byte_level_hf_tokenizer, tiny_loaded_model  # noqa: E402
from radixkv.engine.engine import Engine  # noqa: E402
from radixkv.server.app import create_app  # noqa: E402

LOOP = "{% for i in range(4000) %}{% for j in range(4000) %}{% endfor %}{% endfor %}x"
CHAT = [{"role": "user", "content": "hi"}]


def attack_schema(tag: str, n: int = 1300) -> dict[str, Any]:
    props = {
        f"{tag}{i}": {"type": "string", "pattern": f"[a-z]{{{i % 7 + 1},{i % 7 + 20}}}"}
        for i in range(n)
    }
    return {"type": "object", "properties": props}


def small_schema(name: str) -> dict[str, Any]:
    return {"type": "object", "properties": {name: {"type": "integer"}}}


def constrained(url: str, schema: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
    """A two-token completion constrained to ``schema``."""
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    body = {"prompt": "{", "max_tokens": 2, "response_format": fmt}
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)


def main() -> None:
    tok = byte_level_hf_tokenizer()
    model = tiny_loaded_model(tokenizer=tok, max_position_embeddings=4096)
    engine = Engine(model, page_size=4, kv_cache_tokens=16384, attention_backend="torch",
                    dtype="float32")  # fmt: skip
    keys = ["sk-a-0123456789abcdef", "sk-b-0123456789abcdef"]
    app = create_app(engine, api_key=keys, trust_request_chat_template=True)
    A, B = ({"Authorization": f"Bearer {k}"} for k in keys)  # noqa: N806
    with ServerThread(app) as srv:
        url = srv.base_url
        # warm: template path, grammar pool (both children), a stream
        httpx.post(
            url + "/v1/chat/completions",
            json={"messages": CHAT, "max_tokens": 2, "chat_template": "{{ messages[0].content }}"},
            headers=A,
            timeout=120,
        )
        for i in range(2):
            constrained(url, small_schema(f"w{i}"), B)
        # (a) template
        gaps: list[tuple[float, float]] = []
        marks: dict[str, Any] = {}

        def stream() -> None:
            body = {
                "prompt": "The quick brown fox",
                "max_tokens": 1500,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
            }
            last = time.monotonic()
            with httpx.stream(
                "POST", url + "/v1/completions", json=body, headers=B, timeout=120
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        now = time.monotonic()
                        gaps.append((now, now - last))
                        last = now

        def attack() -> None:
            marks["t0"] = time.monotonic()
            r = httpx.post(
                url + "/v1/chat/completions",
                json={"messages": CHAT, "max_tokens": 2, "chat_template": LOOP},
                headers=A,
                timeout=120,
            )
            marks["t1"] = time.monotonic()
            marks["status"] = r.status_code

        ts = threading.Thread(target=stream)
        ts.start()
        time.sleep(1.0)
        ta = threading.Thread(target=attack)
        ta.start()
        ta.join()
        ts.join()
        during = [g for t, g in gaps if marks["t0"] <= t <= marks["t1"] + 0.05]
        before = [g for t, g in gaps if t < marks["t0"]][5:]
        print(
            f"template 4000x4000: attacker {marks['status']} in {marks['t1'] - marks['t0']:.2f} s; "
            f"victim stream max token gap {max(during):.3f} s during it (median before {sorted(before)[len(before) // 2] * 1e3:.1f} ms)"
        )
        # (b) grammar: A sends 3 heavy schemas at once, B a small new one 0.3 s later
        res: dict[int, Any] = {}

        def heavy(i: int) -> None:
            t0 = time.monotonic()
            r = constrained(url, attack_schema(f"h{i}"), A)
            res[i] = (r.status_code, round(time.monotonic() - t0, 2))

        th = [threading.Thread(target=heavy, args=(i,)) for i in range(3)]
        for t in th:
            t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        r = constrained(url, small_schema("b"), B)
        vict = time.monotonic() - t0
        for t in th:
            t.join()
        print(
            f"grammar: attacker's 3 schemas (status, s) {res}; victim's small schema {r.status_code} in {vict:.2f} s"
        )


if __name__ == "__main__":
    main()
