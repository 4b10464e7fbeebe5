"""The HTTP server, run for real (uvicorn on a loopback port) and called with real clients.

The server is built on each engine of ``server_engine`` below: the deterministic fake in
``fake_engine.py``, then the real :class:`radixkv.Engine` on a tiny random Llama.
Assertions about the exact text only hold for the fake (it echoes the prompt); everything else
(shapes, usage, caching, aborts, page accounting) is checked on both.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from fake_engine import FakeEngine, FakeTokenizer, ServerThread

from radixkv.server.app import create_app
from radixkv.server.intake import apply_chat_template

MODEL = "test-model"
LONG_PROMPT = (
    "The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill "
    "and the bird sings in the old oak tree behind the red barn."
)


def build_tiny_engine() -> Any:
    """The real ``radixkv.Engine`` on a tiny random Llama with the fake's byte tokenizer (an
    import or build error fails the tests that use it)."""
    from bench.tiny_model import tiny_loaded_model
    from radixkv.engine.engine import Engine

    loaded = tiny_loaded_model(tokenizer=FakeTokenizer())
    return Engine(
        loaded,
        page_size=4,
        kv_cache_tokens=16384,
        attention_backend="torch",
        dtype="float32",
        max_running_requests=64,
    )


@pytest.fixture(scope="module", params=["fake", "tiny-llama"])
def server_engine(request: pytest.FixtureRequest) -> Any:
    """The engine under the server: the deterministic fake, then the real engine (tiny Llama)."""
    if request.param == "fake":
        return FakeEngine(page_size=4, num_pages=4096, max_model_len=512)
    return build_tiny_engine()


@pytest.fixture(scope="module")
def server(server_engine: Any) -> Iterator[ServerThread]:
    app = create_app(server_engine, model_name=MODEL)
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def is_fake(engine: Any) -> bool:
    return isinstance(engine, FakeEngine)


def metric_value(text: str, name: str, labels: str = "") -> float:
    """Value of one sample in Prometheus text (0 if absent)."""
    pattern = re.escape(name) + (re.escape("{" + labels + "}") if labels else "") + r" (\S+)"
    match = re.search(r"^" + pattern + r"$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def wait_idle(server: ServerThread, timeout: float = 30.0) -> dict[str, Any]:
    """Poll /cache/stats until nothing runs or waits; return the stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(f"{server.base_url}/cache/stats", timeout=10).json()
        if stats["running"] == 0 and stats["waiting"] == 0:
            return stats
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine still busy: {stats}")
        time.sleep(0.05)


@contextlib.contextmanager
def slow_steps(engine: Any, delay: float) -> Iterator[None]:
    """Slow the engine's steps down so that a client can hang up mid-request."""
    if is_fake(engine):
        engine.step_delay = delay
        try:
            yield
        finally:
            engine.step_delay = 0.0
        return
    step = engine.step

    def slow_step() -> Any:
        time.sleep(delay)
        return step()

    engine.step = slow_step  # the engine thread looks ``step`` up on every call
    try:
        yield
    finally:
        del engine.step


def assert_no_leak(server: ServerThread) -> None:
    """Idle engine: integrity holds and every used page is held by the prefix tree."""
    stats = wait_idle(server)
    loop = server.app.state.engine_loop
    loop.call_sync(lambda e: e.check_integrity())
    stats = loop.call_sync(lambda e: e.stats())
    assert stats["pages_used"] == stats["pages_cached"], stats


# ---------------------------------------------------------------------------------- OpenAI API


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion(client: openai.OpenAI, server_engine: Any) -> None:
    out = client.completions.create(
        model=MODEL,
        prompt="hello world",
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert len(out.choices) == 1
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert out.usage is not None
    assert out.usage.completion_tokens == 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + 5
    assert out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens is not None
    if is_fake(server_engine):
        assert choice.text == "hello"
        assert out.usage.prompt_tokens == len("hello world")


def test_completion_stream(client: openai.OpenAI, server_engine: Any) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="streaming works",
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == ["length"]
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert usage.completion_tokens == 6
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens is not None
    if is_fake(server_engine):
        assert text == "stream"


def test_completion_stream_matches_non_stream(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        prompt=LONG_PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kwargs).choices[0].text
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices
    )
    assert streamed == full


def test_completion_n_and_seed(client: openai.OpenAI, server_engine: Any) -> None:
    out = client.completions.create(
        model=MODEL,
        prompt="parallel sampling",
        max_tokens=4,
        n=3,
        seed=7,
        temperature=0.8,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage is not None and out.usage.completion_tokens == 12
    if is_fake(server_engine):
        assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [
            "para",
            "aral",
            "rall",
        ]


def test_completion_stream_n(client: openai.OpenAI) -> None:
    """Two seeded sampled streams: each choice streams the text the same request gets without
    streaming (seeded rows are reproducible), and the usage counts both."""
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        prompt="two streams",
        max_tokens=3,
        n=2,
        seed=11,
        temperature=0.8,
        extra_body={"ignore_eos": True},
    )
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    ):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    assert finished == {0: "length", 1: "length"}
    assert usage is not None and usage.completion_tokens == 6
    full = client.completions.create(**kwargs)
    assert texts == {c.index: c.text for c in full.choices}


def test_completion_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt="logprobs", max_tokens=3, logprobs=1, extra_body={"ignore_eos": True}
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3
    assert all(x is not None and x <= 0.0 for x in lp.token_logprobs)


def test_completion_stop(client: openai.OpenAI, server_engine: Any) -> None:
    """The text ends before the stop string's first occurrence, finish_reason "stop". On the
    real engine the stop string is taken from the same greedy completion run without one."""
    kwargs: dict[str, Any] = dict(model=MODEL, prompt="hello world", max_tokens=10, temperature=0)
    if is_fake(server_engine):
        stop, want = " ", "hello"
    else:
        kwargs["extra_body"] = {"ignore_eos": True}
        full = client.completions.create(**kwargs).choices[0].text
        cut = next((i for i in range(1, len(full)) if full[i] not in full[:i]), None)
        assert cut is not None, f"no character to stop at in {full!r}"
        stop, want = full[cut], full[:cut]
    out = client.completions.create(**kwargs, stop=[stop])
    assert out.choices[0].text == want
    assert out.choices[0].finish_reason == "stop"


def test_prompt_as_token_ids(client: openai.OpenAI, server_engine: Any) -> None:
    ids = server_engine.tokenizer.encode("token ids")
    out = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert out.usage is not None and out.usage.prompt_tokens == len(ids)


def test_chat(client: openai.OpenAI, server_engine: Any) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say hi"},
        ],
        max_completion_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 5
    assert out.usage.prompt_tokens_details is not None
    if is_fake(server_engine):
        assert choice.message.content == "<|sys"


def test_chat_stream(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Count to three"}],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens_details is not None


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3
    assert all(entry.logprob <= 0.0 for entry in content)


def test_chat_n(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        n=2,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == [0, 1]


def test_cached_tokens_on_repeat(client: openai.OpenAI, server: ServerThread) -> None:
    system = {"role": "system", "content": LONG_PROMPT}
    convs = [
        [system, {"role": "user", "content": "first question"}],
        [system, {"role": "user", "content": "second question"}],
    ]
    kwargs: dict[str, Any] = dict(model=MODEL, max_tokens=2, extra_body={"ignore_eos": True})
    client.chat.completions.create(messages=convs[0], **kwargs)
    second = client.chat.completions.create(messages=convs[1], **kwargs)
    engine = server.app.state.engine
    a, b = (apply_chat_template(engine.tokenizer, c) for c in convs)
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= shared - engine.page_size


def test_cache_salt_isolates(client: openai.OpenAI) -> None:
    prompt = LONG_PROMPT + " salted"
    kwargs: dict[str, Any] = dict(model=MODEL, prompt=prompt, max_tokens=1)
    client.completions.create(extra_body={"cache_salt": "tenant-a", "ignore_eos": True}, **kwargs)
    same = client.completions.create(
        extra_body={"cache_salt": "tenant-a", "ignore_eos": True}, **kwargs
    )
    other = client.completions.create(
        extra_body={"cache_salt": "tenant-b", "ignore_eos": True}, **kwargs
    )
    assert same.usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[union-attr]
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------- /generate


def test_generate(server: ServerThread, server_engine: Any) -> None:
    r = httpx.post(
        f"{server.base_url}/generate",
        json={"text": "abcdefgh", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["output_ids"]) == 4
    meta = body["meta_info"]
    for key in (
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "cached_tokens_details",
        "finish_reason",
        "e2e_latency",
    ):
        assert key in meta
    assert meta["completion_tokens"] == 4
    assert meta["finish_reason"]["type"] == "length"
    if is_fake(server_engine):
        assert body["text"] == "abcd"


def test_generate_input_ids_stream(server: ServerThread, server_engine: Any) -> None:
    ids = server_engine.tokenizer.encode("stream me please")
    events: list[Any] = []
    with httpx.stream(
        "POST",
        f"{server.base_url}/generate",
        json={
            "input_ids": ids,
            "sampling_params": {"max_tokens": 5, "temperature": 0, "ignore_eos": True},
            "stream": True,
        },
        timeout=30,
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert len(last["output_ids"]) == 5
    assert last["meta_info"]["prompt_tokens"] == len(ids)
    assert last["meta_info"]["finish_reason"]["type"] == "length"


def test_generate_n(server: ServerThread, server_engine: Any) -> None:
    sampling = {"max_new_tokens": 2, "n": 2, "ignore_eos": True, "seed": 3}
    r = httpx.post(
        f"{server.base_url}/generate",
        json={"text": "xyz!", "sampling_params": sampling},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(body, list) and [b["index"] for b in body] == [0, 1]
    for b in body:
        assert len(b["output_ids"]) == 2, b
        assert b["meta_info"]["completion_tokens"] == 2
        assert b["meta_info"]["finish_reason"]["type"] == "length"
        assert b["text"] == server_engine.tokenizer.decode(b["output_ids"])


# ---------------------------------------------------------------------------------- admin


def test_metrics(server: ServerThread, client: openai.OpenAI) -> None:
    """One request moves every counter by exactly its own share (nothing else runs)."""
    wait_idle(server)
    before = httpx.get(f"{server.base_url}/metrics", timeout=10)
    assert before.status_code == 200
    out = client.completions.create(
        model=MODEL, prompt="metrics please", max_tokens=3, extra_body={"ignore_eos": True}
    )
    wait_idle(server)
    r = httpx.get(f"{server.base_url}/metrics", timeout=10)
    assert r.status_code == 200
    text = r.text

    def delta(name: str, labels: str = "") -> float:
        return metric_value(text, name, labels) - metric_value(before.text, name, labels)

    usage = out.usage
    assert usage is not None and usage.prompt_tokens > 0 and usage.completion_tokens == 3
    cached = usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    assert delta("radixkv_prompt_tokens_total") == usage.prompt_tokens
    assert delta("radixkv_generation_tokens_total") == 3
    assert delta("radixkv_cached_tokens_total") == cached
    assert delta("radixkv_requests_total", 'finish_reason="length"') == 1
    assert delta("radixkv_time_to_first_token_seconds_count") == 1
    assert delta("radixkv_inter_token_latency_seconds_count") == 2  # one token per step
    assert delta("radixkv_e2e_request_latency_seconds_count") == 1
    for name in (
        "radixkv_cached_tokens_total",
        "radixkv_cache_hit_rate",
        "radixkv_num_requests_running",
        "radixkv_num_requests_waiting",
        "radixkv_kv_pages_used",
        "radixkv_kv_pages_cached",
        "radixkv_kv_pages_free",
    ):
        assert f"\n{name} " in text, name
    for source in ("device", "host", "disk"):
        assert f'radixkv_cached_tokens_by_source_total{{source="{source}"}}' in text
    assert metric_value(text, "radixkv_kv_pages_used") > 0


def test_cache_stats(server: ServerThread, client: openai.OpenAI) -> None:
    client.completions.create(
        model=MODEL, prompt=LONG_PROMPT, max_tokens=2, extra_body={"ignore_eos": True}
    )
    wait_idle(server)
    r = httpx.get(f"{server.base_url}/cache/stats", timeout=10)
    assert r.status_code == 200, r.text
    stats = r.json()
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["pages_used"] + stats["pages_free"] == stats["pages_total"] > 0
    assert stats["pages_cached"] == stats["pages_used"]  # idle: only the cache holds pages
    assert stats["prompt_tokens_total"] > 0 and stats["pages_cached"] > 0
    assert stats["hit_rate"] == pytest.approx(
        stats["cached_tokens_total"] / stats["prompt_tokens_total"]
    )


def test_pin(server: ServerThread, client: openai.OpenAI) -> None:
    text = LONG_PROMPT + " pinned"
    client.completions.create(
        model=MODEL, prompt=text, max_tokens=1, extra_body={"ignore_eos": True}
    )
    r = httpx.post(f"{server.base_url}/cache/pin", json={"text": text, "ttl": 60}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    page = server.app.state.engine.page_size
    assert body["pinned_tokens"] == body["prompt_tokens"] // page * page > 0


def test_flush_cache_refused_while_running(server: ServerThread) -> None:
    url = server.base_url
    with (
        slow_steps(server.app.state.engine, 0.005),
        httpx.stream(
            "POST",
            f"{url}/generate",
            json={
                "text": LONG_PROMPT,
                "sampling_params": {"max_new_tokens": 300, "ignore_eos": True},
                "stream": True,
            },
            timeout=30,
        ) as r,
    ):
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        busy = httpx.post(f"{url}/flush_cache", timeout=10)
        assert busy.status_code == 409
        assert "in flight" in busy.json()["error"]["message"]
    # the dropped stream is aborted; then the flush goes through
    wait_idle(server)
    ok = httpx.post(f"{url}/flush_cache", timeout=10)
    assert ok.status_code == 200, ok.text
    assert_no_leak(server)


# ---------------------------------------------------------------------------------- concurrency


def test_concurrent_streams_with_disconnects(server: ServerThread) -> None:
    """32 concurrent streams; every third client hangs up midway. No page may leak."""
    url = f"{server.base_url}/v1/completions"
    metrics_before = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    aborts_before = metric_value(metrics_before, "radixkv_requests_total", 'finish_reason="abort"')
    max_tokens = 40

    async def one(i: int) -> tuple[str, int]:
        drop = i % 3 == 0
        payload = {
            "model": MODEL,
            "prompt": f"{LONG_PROMPT} request {i}",
            # a dropped stream would run long: only an abort ends it early
            "max_tokens": 300 if drop else max_tokens,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        tokens = 0
        async with (
            httpx.AsyncClient(timeout=60) as http,
            http.stream("POST", url, json=payload) as r,
        ):
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    return "done", tokens
                chunk = json.loads(data)
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and drop:
                    tokens += 1
                    if tokens >= 3:
                        return "dropped", tokens  # leaving the `async with` hangs up
        return "truncated", tokens

    async def main() -> list[tuple[str, int]]:
        return await asyncio.gather(*(one(i) for i in range(32)))

    # A dropped stream must still be running when its hang-up reaches the engine: at 2 ms a step
    # its 300 tokens took ~0.6 s, and a busy CI host once let 7 of 11 finish by length first.
    with slow_steps(server.app.state.engine, 0.01):
        results = asyncio.run(main())
    kept = [r for i, r in enumerate(results) if i % 3 != 0]
    dropped = [r for i, r in enumerate(results) if i % 3 == 0]
    assert all(status == "done" and n == max_tokens for status, n in kept), kept
    assert all(status == "dropped" for status, _ in dropped), dropped

    assert_no_leak(server)
    metrics_after = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    aborts_after = metric_value(metrics_after, "radixkv_requests_total", 'finish_reason="abort"')
    assert aborts_after - aborts_before == len(dropped)


def test_non_streaming_disconnect_aborts(server: ServerThread) -> None:
    """A client that times out on a non-streaming request gets it aborted."""
    before = metric_value(
        httpx.get(f"{server.base_url}/metrics").text,
        "radixkv_requests_total",
        'finish_reason="abort"',
    )
    with slow_steps(server.app.state.engine, 0.01):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(
                f"{server.base_url}/v1/completions",
                json={
                    "model": MODEL,
                    "prompt": LONG_PROMPT,
                    "max_tokens": 300,
                    "ignore_eos": True,
                },
                timeout=0.3,
            )
        assert_no_leak(server)
    after = metric_value(
        httpx.get(f"{server.base_url}/metrics").text,
        "radixkv_requests_total",
        'finish_reason="abort"',
    )
    assert after > before


# ---------------------------------------------------------------------------------- auth


def test_api_key() -> None:
    app = create_app(FakeEngine(), api_key="sekrit", model_name=MODEL)
    with ServerThread(app) as srv:
        assert httpx.get(f"{srv.base_url}/health").status_code == 200
        for method, path in [
            ("GET", "/v1/models"),
            ("POST", "/v1/completions"),
            ("POST", "/generate"),
            ("GET", "/metrics"),
            ("GET", "/cache/stats"),
            ("POST", "/flush_cache"),
            ("POST", "/cache/pin"),
        ]:
            r = httpx.request(method, f"{srv.base_url}{path}", json={})
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.get(f"{srv.base_url}/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        good = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="sekrit", max_retries=0)
        assert [m.id for m in good.models.list().data] == [MODEL]
        out = good.completions.create(model=MODEL, prompt="auth ok", max_tokens=2)
        assert out.choices[0].text == "au"
        bad = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


# ---------------------------------------------------------------------------------- CLI


def test_serve_flags_map_to_engine_knobs() -> None:
    import argparse

    from radixkv.server.cli import add_serve_parser, engine_kwargs, resolve_model

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        [
            "serve",
            "--port",
            "9001",
            "--api-key",
            "k",
            "--max-waiting",
            "8",
            "--kv-cache-tokens",
            "4096",
            "--page-size",
            "8",
            "--disable-prefix-cache",
            "--schedule-policy",
            "fcfs",
            "--eviction-policy",
            "lfu",
            "--chunked-prefill-tokens",
            "256",
            "--max-running-requests",
            "4",
            "--attention-backend",
            "torch",
            "--dtype",
            "float32",
            "--host-cache-tokens",
            "1024",
            "--disk-cache-dir",
            "/tmp/x",
            "--disk-cache-bytes",
            "1000000",
            "--kv-cache-dtype",
            "int8",
        ]
    )
    assert (resolve_model(args)[0], args.host, args.port, args.api_key, args.max_waiting) == (
        "smollm2",
        "127.0.0.1",
        9001,
        ["k"],  # --api-key is repeatable: each key may be a tenant (--salt-from-api-key)
        8,
    )
    assert engine_kwargs(args) == {
        "kv_cache_tokens": 4096,
        "page_size": 8,
        "enable_prefix_cache": False,
        "schedule_policy": "fcfs",
        "eviction_policy": "lfu",
        "chunked_prefill_tokens": 256,
        "max_running_requests": 4,
        "attention_backend": "torch",
        "dtype": "float32",
        "host_cache_tokens": 1024,
        "disk_cache_dir": "/tmp/x",
        "disk_cache_bytes": 1000000,
        "kv_cache_dtype": "int8",
    }
    covered = set(engine_kwargs(args))
    # the other knobs, and the flags that go to the app rather than the engine
    args = parser.parse_args(
        ["serve", "--kv-cache-memory-gb", "0.5", "--kv-layout", "virtual"]
        + ["--disk-write-policy", "write_through", "--host-write-policy", "write_through"]
        + ["--max-model-len", "256", "--device", "cpu", "--seed", "5"]
        + ["--remote-cache", "redis://127.0.0.1:6399/0", "--mixed-prefill-tokens", "128"]
        + ["--remote-write-policy", "write_back", "--mixed-prefill-min-tokens", "64"]
        + ["--served-model-name", "svc", "--api-key-file", "/tmp/keys.txt"]
        + ["--kv-mac-key-file", "/tmp/kv.key", "--tokenizer", "tok-dir"]
        + ["--chat-template", "t.jinja", "--gpu-memory-utilization", "0.9"]
        + ["--quantization", "int8"]
    )
    assert engine_kwargs(args) == {
        "kv_cache_memory_gb": 0.5,
        "kv_layout": "virtual",
        "disk_write_policy": "write_through",
        "host_write_policy": "write_through",
        "max_model_len": 256,
        "device": "cpu",
        "seed": 5,
        "remote_cache_url": "redis://127.0.0.1:6399/0",
        "remote_write_policy": "write_back",
        "mixed_prefill_tokens": 128,
        "mixed_prefill_min_tokens": 64,
        "kv_mac_key_file": "/tmp/kv.key",
        "tokenizer": "tok-dir",
        "chat_template": "t.jinja",
        "quantization": "int8",
        "kv_cache_memory_fraction": 0.9,
    }
    assert (args.served_model_name, args.api_key_file, args.api_key) == (
        ["svc"],
        "/tmp/keys.txt",
        None,
    )
    covered |= set(engine_kwargs(args))
    # every value of the choice flags added since: --quantization gguf (a GGUF's own blocks)
    gguf = parser.parse_args(["serve", "model.gguf", "--quantization", "gguf"])
    assert engine_kwargs(gguf)["quantization"] == "gguf"
    from radixkv.config import EngineConfig
    from radixkv.server.cli import ENGINE_FLAGS

    # every engine flag is checked by one of the two parses, and each names a real knob
    assert covered == {knob for _, knob, _, _ in ENGINE_FLAGS} | {"enable_prefix_cache"}
    assert covered <= set(EngineConfig.knob_names())


def test_run_serve_wires_its_flags_into_the_engine_and_the_app(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """``radixkv serve`` end to end on the tiny model (``Engine`` and ``uvicorn.run`` patched
    to build it and to serve in a thread): the served name, keys from --api-key-file, a pool
    sized by --kv-cache-memory-gb, the virtual layout and write-through to the disk tier."""
    import uvicorn

    import radixkv
    from bench.tiny_model import tiny_loaded_model
    from radixkv.cli import main
    from radixkv.engine.engine import Engine

    keys = tmp_path / "keys.txt"
    keys.write_text("# one tenant\nkey-from-file\n")
    page, gb = 32, 0.001
    built: dict[str, Any] = {}

    def engine_from_name(model: str, **knobs: Any) -> Any:
        built.update(model=model, knobs=knobs)
        built["engine"] = Engine(tiny_loaded_model(), **knobs)
        return built["engine"]

    checked: list[str] = []

    def serve(app: Any, host: str, port: int, log_level: str, **options: Any) -> None:
        assert (host, port) == ("127.0.0.1", 9123)
        # no vLLM flag given: uvicorn's own defaults (vllm_flags sets these when asked)
        assert options == {
            "access_log": True, "root_path": "", "ssl_keyfile": None, "ssl_certfile": None,
            "ssl_ca_certs": None,
        }  # fmt: skip
        auth = {"Authorization": "Bearer key-from-file"}
        with ServerThread(app) as srv:
            assert httpx.get(f"{srv.base_url}/v1/models", timeout=10).status_code == 401
            r = httpx.get(f"{srv.base_url}/v1/models", headers=auth, timeout=10)
            assert r.status_code == 200, r.text
            assert [m["id"] for m in r.json()["data"]] == ["svc-name"]
            body = {"model": "svc-name", "prompt": LONG_PROMPT, "max_tokens": 2}
            r = httpx.post(
                f"{srv.base_url}/v1/completions",
                json={**body, "temperature": 0, "ignore_eos": True},
                headers=auth,
                timeout=60,
            )
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "svc-name"
            prompt_pages = r.json()["usage"]["prompt_tokens"] // page
            # write-through: the prompt's pages reach the disk at once (the pool holds 65
            # pages, so nothing is evicted: write-back would leave the disk empty)
            deadline = time.monotonic() + 20
            while True:
                stats = httpx.get(f"{srv.base_url}/cache/stats", headers=auth, timeout=10).json()
                if stats["tiers"]["disk_files"] >= prompt_pages or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert stats["tiers"]["disk_files"] >= prompt_pages > 0, stats["tiers"]
            # 2 layers x K,V x page x 2 kv heads x head dim 16 x 4 bytes per page
            assert stats["pages_total"] == int(gb * (1 << 30)) // (2 * 2 * page * 2 * 16 * 4)
        checked.append("served")

    monkeypatch.setattr(radixkv, "Engine", engine_from_name)
    monkeypatch.setattr(uvicorn, "run", serve)
    argv = ["serve", "--model", "tiny", "--port", "9123", "--log-level", "warning"]
    argv += ["--served-model-name", "svc-name", "--api-key-file", str(keys)]
    argv += ["--page-size", str(page), "--dtype", "float32", "--kv-cache-memory-gb", str(gb)]
    argv += ["--kv-layout", "virtual", "--disk-cache-dir", str(tmp_path / "disk")]
    argv += ["--disk-write-policy", "write_through"]
    assert main(argv) == 0
    assert checked == ["served"]
    assert built["model"] == "tiny"
    engine = built["engine"]
    assert engine.runner.virtual is not None  # --kv-layout virtual reached the runner
    assert engine.tiers.disk is not None


def test_a_text_prompt_is_tokenized_once(
    client: openai.OpenAI, server_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The route tokenizes a text prompt once (off the event loop) and hands the engine token
    ids, with prompt logprobs asked too (they used to tokenize it a second time)."""
    calls: list[str] = []
    encode = FakeTokenizer.encode

    def counting(self: Any, text: str, *args: Any, **kwargs: Any) -> list[int]:
        calls.append(text)
        return encode(self, text, *args, **kwargs)

    monkeypatch.setattr(FakeTokenizer, "encode", counting)
    text = "count the tokenizations"
    out = client.completions.create(
        model=MODEL,
        prompt=text,
        max_tokens=2,
        extra_body={"ignore_eos": True, "prompt_logprobs": 1},
    )
    assert out.usage is not None and out.usage.prompt_tokens == len(encode(FakeTokenizer(), text))
    assert calls == [text]


def test_model_identity_like_vllm() -> None:
    """`radixkv serve MODEL` (positional, like `vllm serve`), several served names, the name
    given as the model served by default, the model's own name always accepted, and requests
    without `model` served."""
    import argparse

    from radixkv.server.cli import add_serve_parser, resolve_model

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))

    def resolved(*argv: str) -> tuple[str, list[str]]:
        return resolve_model(parser.parse_args(["serve", *argv]))

    assert resolved() == ("smollm2", ["smollm2"])
    assert resolved("smollm2") == ("smollm2", ["smollm2"])
    assert resolved("--model", "smollm2") == ("smollm2", ["smollm2"])
    assert resolved("/m.gguf", "--served-model-name", "a", "b") == ("/m.gguf", ["a", "b"])
    with pytest.raises(ValueError, match="two models"):
        resolved("smollm2", "--model", "other")

    app = create_app(FakeEngine(), model_name=["smollm2", "chat-alias"])
    with ServerThread(app) as srv:
        base = srv.base_url
        listed = httpx.get(f"{base}/v1/models").json()["data"]
        assert [m["id"] for m in listed] == ["smollm2", "chat-alias"]
        assert all(m["root"] == "fake-model" for m in listed)
        for model in ("smollm2", "chat-alias", "fake-model", None):
            body = {"prompt": "hi", "max_tokens": 2}
            if model is not None:
                body["model"] = model
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
            assert r.status_code == 200 and r.json()["model"] == "smollm2", (model, r.text)
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            if model is not None:
                chat["model"] = model
            assert httpx.post(f"{base}/v1/chat/completions", json=chat).status_code == 200
        r = httpx.post(f"{base}/v1/completions", json={"model": "gpt-4", "prompt": "hi"})
        assert r.status_code == 404 and "`smollm2`" in r.json()["error"]["message"]


def test_openai_client_like_a_vllm_user() -> None:
    """The official openai client as a vLLM user drives it: no model field problems, a field
    radixkv does not implement is a 400 naming it (never 200 with it ignored), bad roles are
    400s, the fields without effect here (user, metadata, service_tier, store=false) pass."""
    import openai

    app = create_app(FakeEngine(), model_name="smollm2")
    with ServerThread(app) as srv:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "hi"}]
        ok = client.chat.completions.create(
            model="smollm2", messages=msgs, max_tokens=2, user="u-1", metadata={"a": "b"},
            service_tier="auto", store=False, response_format={"type": "text"},
        )  # fmt: skip
        assert ok.choices[0].message.content is not None
        done = client.completions.create(model="smollm2", prompt="hi", max_tokens=2, user="u")
        assert done.usage is not None and done.usage.completion_tokens == 2
        implemented = client.chat.completions.create(  # test_server_fields.py: their effect
            model="smollm2", messages=msgs, max_tokens=2, logit_bias={"5": 10},
            extra_body={"min_tokens": 1, "chat_template_kwargs": {"x": 1}},
        )  # fmt: skip
        assert implemented.usage is not None and implemented.usage.completion_tokens == 2
        refused = [
            ("tool_choice", {"tool_choice": "required"}),  # without tools
            ("response_format.type", {"response_format": {"type": "xml"}}),
            ("store", {"store": True}),
        ]
        for param, extra in refused:
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(
                    model="smollm2", messages=msgs, max_tokens=2, **extra
                )
            body = err.value.body
            assert isinstance(body, dict) and body["param"] == param, (param, body)
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="smollm2", prompt="hi", suffix="end")
        assert isinstance(err.value.body, dict) and err.value.body["param"] == "suffix"
        assert "not supported" in err.value.body["message"]
        for role in ("wizard", "function", ""):
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(
                    model="smollm2",
                    messages=[{"role": role, "content": "x"}],  # type: ignore[misc,list-item]
                )
            assert isinstance(err.value.body, dict)
            assert err.value.body["param"] == "messages.0.role", err.value.body
        for role in ("system", "developer", "assistant", "tool"):
            client.chat.completions.create(
                model="smollm2",
                messages=[{"role": role, "content": "x"}, *msgs],  # type: ignore[misc,list-item]
                max_tokens=1,
            )
