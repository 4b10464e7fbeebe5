"""Issue 59, finding 5: a structured output constraint is a program whose compile xgrammar cannot
interrupt. :class:`~radixkv.engine.grammar.GrammarCompilerPool` probes each cold compile in a
child process killed at the time bound (the work stops, not just the wait) and capped in memory,
and bounds the compiles one key may have queued or running. Written as the attacks: a schema of
1,300 patterned properties (under the 64 KiB spec limit; ~1.5 s of compile over the tiny
320-token vocabulary on the AVX2 Zen 3 host, far more over a real vocabulary), a compile past
the memory bound, one key sending several while another tenant's constraint compiles."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fake_engine import ServerThread

from radixkv.engine.grammar import GrammarCompilerPool
from radixkv.engine.structured import CompileQueueFullError, StructuredOutputs

BOUND = 0.5  # seconds: the attack takes 3x that or more on the fastest host seen


def attack_schema(tag: str = "", n: int = 1300) -> str:
    props = {
        f"{tag}{i}": {"type": "string", "pattern": f"[a-z]{{{i % 7 + 1},{i % 7 + 20}}}"}
        for i in range(n)
    }
    return json.dumps({"type": "object", "properties": props}, separators=(",", ":"))


def spec(schema: str) -> StructuredOutputs:
    return StructuredOutputs(json=schema).validate()


def small(i: int) -> StructuredOutputs:
    return spec(json.dumps({"type": "object", "properties": {f"k{i}": {"type": "integer"}}}))


@pytest.fixture(scope="module")
def hf_tok() -> Any:
    from bench.tiny_model import byte_level_hf_tokenizer

    return byte_level_hf_tokenizer()


def warm(pool: GrammarCompilerPool) -> None:
    """Both children started and each has compiled once (their start-up is not a compile's)."""
    pool.compiler()
    for i in range(pool.workers):
        pool.compile(small(1000 + i), timeout=120)


@pytest.fixture()
def pool(hf_tok: Any) -> Iterator[GrammarCompilerPool]:
    p = GrammarCompilerPool(hf_tok, 320, [2], compile_timeout=BOUND)
    warm(p)
    try:
        yield p
    finally:
        p.check_integrity()
        p.close()


def test_the_schema_is_within_the_spec_limit_and_compiles_unbounded(hf_tok: Any) -> None:
    """The attack is a valid constraint: with a generous bound it compiles (the probe, then the
    server's own compile), so what stops it below is the bound alone."""
    from radixkv.engine.structured import MAX_SPEC_CHARS

    assert len(attack_schema()) <= MAX_SPEC_CHARS
    p = GrammarCompilerPool(hf_tok, 320, [2], compile_timeout=120)
    try:
        assert p.compile(spec(attack_schema()), timeout=240).memory_size_bytes > 0
    finally:
        p.close()


def test_a_slow_compile_is_killed_at_the_bound(pool: GrammarCompilerPool) -> None:
    before = set(pool.child_pids())
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=rf"did not compile within {BOUND:g} s"):
        pool.compile(spec(attack_schema()), timeout=30)
    assert time.monotonic() - t0 < BOUND + 3
    gone = before - set(pool.child_pids())
    assert len(gone) == 1 and pool.killed == 1  # its process was stopped, not left compiling
    with pytest.raises(ProcessLookupError):
        os.kill(gone.pop(), 0)
    # the failure is cached (deterministic): the same schema is refused at once, no new work
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="did not compile"):
        pool.compile(spec(attack_schema()), timeout=30)
    assert time.monotonic() - t0 < 0.1 and pool.killed == 1
    assert pool.compile(small(1), timeout=60) is not None  # a fresh process serves the next


def test_a_compile_past_the_memory_bound_is_stopped(hf_tok: Any) -> None:
    p = GrammarCompilerPool(hf_tok, 320, [2], compile_timeout=60, memory_bytes=4 << 20)
    try:
        with pytest.raises(ValueError, match="memory"):
            p.compile(spec(attack_schema(n=300)), timeout=120)
        assert p.killed == 1
        p.check_integrity()
    finally:
        p.close()


def test_one_key_cannot_queue_compiles_ahead_of_others(pool: GrammarCompilerPool) -> None:
    """Key A's slow compile holds one process; A's next constraint is refused at once (429
    over HTTP); key B's constraint compiles in the other process meanwhile, promptly."""
    fut = pool.submit(spec(attack_schema("a")), owner="A")
    with pytest.raises(CompileQueueFullError, match="already has 1"):
        pool.submit(spec(attack_schema("b")), owner="A")
    t0 = time.monotonic()
    assert pool.submit(small(7), owner="B").result(timeout=30) is not None
    assert time.monotonic() - t0 < BOUND and not fut.done()
    with pytest.raises(ValueError, match="did not compile"):
        fut.result(timeout=30)
    pool.check_integrity()
    assert pool.submit(small(8), owner="A").result(timeout=30) is not None  # A's turn again


# ------------------------------------------------------------------ through the server


def test_a_tenants_grammar_leaves_another_tenants_structured_outputs_alone(hf_tok: Any) -> None:
    from bench.tiny_model import tiny_loaded_model
    from radixkv.engine.engine import Engine
    from radixkv.server.app import create_app

    engine = Engine(tiny_loaded_model(tokenizer=hf_tok), page_size=4, kv_cache_tokens=8192,
                    attention_backend="torch", dtype="float32")  # fmt: skip
    engine.grammars.timeout_s = BOUND
    warm(engine.grammars.pool)
    keys = ["sk-grammar-a-0123456789", "sk-grammar-b-0123456789"]
    app = create_app(engine, api_key=keys)
    a, b = ({"Authorization": f"Bearer {k}"} for k in keys)

    def body(schema: str) -> dict[str, Any]:
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": json.loads(schema)}}
        return {"prompt": "{", "max_tokens": 4, "temperature": 0, "response_format": fmt}

    with ServerThread(app) as srv:
        url = srv.base_url + "/v1/completions"
        got: dict[str, Any] = {}

        def attacker() -> None:
            r = httpx.post(url, json=body(attack_schema("x")), headers=a, timeout=60)
            got.update(status=r.status_code, body=r.json())

        t = threading.Thread(target=attacker)
        t.start()
        deadline = time.monotonic() + 30
        while not engine.grammars.pool.keys.total() and time.monotonic() < deadline:
            time.sleep(0.005)
        second = httpx.post(url, json=body(attack_schema("y")), headers=a, timeout=60)
        assert second.status_code == 429, second.text
        assert second.json()["error"]["code"] == "key_limit"
        t0 = time.monotonic()
        schema = json.dumps({"type": "object", "properties": {"b": {"type": "integer"}}})
        r = httpx.post(url, json=body(schema), headers=b, timeout=60)
        took = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert took < BOUND + 0.5, took  # not queued behind A's compile
        t.join(60)
        assert got["status"] == 400, got
        assert "did not compile within" in got["body"]["error"]["message"], got
        assert engine.grammars.pool.killed >= 1
        engine.grammars.pool.check_integrity()
