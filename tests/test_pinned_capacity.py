"""Pins never starve a request silently (issue 28): a request that cannot fit in the KV cache beside
the pinned prefixes is answered at once (``PinnedCapacityError``; HTTP 503 ``pinned_capacity``
naming the pins), one that fits runs, and one that reuses a pinned prefix counts that prefix as
its own. Real engine (tiny Llama), real server."""

from __future__ import annotations

import time

import httpx
import pytest
from fake_engine import ServerThread

from bench.tiny_model import tiny_loaded_model
from radixkv import SamplingParams
from radixkv.engine.engine import Engine
from radixkv.engine.pinning import PinnedCapacityError
from radixkv.server.app import create_app

POOL = 128  # tokens


def engine_with_pins() -> tuple[Engine, list[list[int]]]:
    engine = Engine(
        tiny_loaded_model(), page_size=4, kv_cache_tokens=POOL, attention_backend="torch",
        dtype="float32",
    )  # fmt: skip
    pinned = [[10 + 25 * i + t for t in range(24)] for i in range(3)]  # 3 x 24 = 72 tokens
    for ids in pinned:
        assert engine.pin_prefix(ids) == 24
    assert engine.tree.pinned_tokens(whole_tree=True) == 72
    return engine, pinned


def run(engine: Engine, rid: str, ids: list[int], max_tokens: int) -> None:
    engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0))
    while engine.has_unfinished():
        engine.step()


def test_a_request_that_cannot_fit_beside_the_pins_is_refused_at_once() -> None:
    engine, pinned = engine_with_pins()
    fresh = list(range(100, 140))  # 40 tokens + 30 = 70 > 128 - 72 = 56
    with pytest.raises(PinnedCapacityError, match="72 of the KV cache's 128 tokens are pinned"):
        engine.add_request("big", fresh, SamplingParams(max_tokens=30))
    assert not engine.has_unfinished()  # nothing queued
    run(engine, "small", list(range(150, 170)), 10)  # 30 tokens fit beside the pins
    # reusing a pinned prefix: 24 pinned + 10 new + 30 out = 64 <= 56 + 24
    run(engine, "reuse", pinned[1] + list(range(200, 210)), 30)
    engine.check_integrity()
    engine.flush_cache(drop_pins=True)
    run(engine, "big-later", fresh, 30)  # the pins gone, it fits
    engine.check_integrity()


def test_the_server_answers_503_naming_the_pins_within_seconds() -> None:
    engine, _ = engine_with_pins()
    app = create_app(engine, model_name="tiny")
    with ServerThread(app) as srv:
        body = {"model": "tiny", "prompt": list(range(100, 140)), "max_tokens": 30}
        start = time.monotonic()
        r = httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=30)
        assert time.monotonic() - start < 5
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "pinned_capacity" and "pinned" in err["message"]
        ok = {"model": "tiny", "prompt": list(range(150, 170)), "max_tokens": 10}
        assert httpx.post(f"{srv.base_url}/v1/completions", json=ok, timeout=30).status_code == 200
