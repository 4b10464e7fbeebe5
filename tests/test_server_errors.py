"""Bad input and engine failures: OpenAI-shaped 4xx/5xx answers, and the server keeps serving.

Runs against the deterministic fake engine (``fake_engine.py``): its hooks inject step failures
and stall the queue; the error paths tested here are the server's, not the model's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from fake_engine import FakeEngine, ServerThread

from radixkv.server.app import create_app

MODEL = "test-model"
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine(max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def server(engine: FakeEngine) -> Iterator[ServerThread]:
    with ServerThread(create_app(engine, model_name=MODEL)) as srv:
        yield srv


def post(server: ServerThread, path: str, body: Any = None, **kwargs: Any) -> httpx.Response:
    if body is not None:
        kwargs["json"] = body
    return httpx.post(f"{server.base_url}{path}", timeout=30, **kwargs)


def assert_error(r: httpx.Response, status: int, *fragments: str, param: str | None = None) -> None:
    """``r`` is an OpenAI-shaped error with this status whose message contains ``fragments``."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    for fragment in fragments:
        assert fragment in err["message"], (fragment, err["message"])
    if param is not None:
        assert err["param"] == param, err


def assert_still_serving(server: ServerThread) -> None:
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "still alive", "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "sti"


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4, **fields}


# ---------------------------------------------------------------------------------- malformed


def test_malformed_json(server: ServerThread) -> None:
    r = post(
        server,
        "/v1/completions",
        content=b'{"model": "test-model", "prompt": ',
        headers={"Content-Type": "application/json"},
    )
    assert_error(r, 400, "Invalid JSON body")


def test_body_not_an_object(server: ServerThread) -> None:
    assert_error(post(server, "/v1/chat/completions", [1, 2, 3]), 400, "JSON object")


def test_missing_field(server: ServerThread) -> None:
    assert_error(post(server, "/v1/completions", {"model": MODEL}), 400, "prompt", param="prompt")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "hot"),
        ("max_tokens", "many"),
        ("n", 1.5),
        ("stop", 5),
        ("logprobs", "yes"),
        ("stream", "perhaps"),
    ],
)
def test_wrong_types(server: ServerThread, field: str, value: Any) -> None:
    r = post(server, "/v1/completions", completion(**{field: value}))
    assert_error(r, 400, field, param=field)


def test_wrong_type_in_chat_messages(server: ServerThread) -> None:
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": "hello"})
    assert_error(r, 400, "messages")


def test_wrong_type_in_generate_sampling_params(server: ServerThread) -> None:
    r = post(server, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "ten"}})
    assert_error(r, 400, "sampling_params.max_new_tokens", param="sampling_params.max_new_tokens")


# ---------------------------------------------------------------------------------- values


def test_empty_prompts(server: ServerThread) -> None:
    assert_error(post(server, "/v1/completions", completion(prompt="")), 400, "empty")
    assert_error(post(server, "/v1/completions", completion(prompt=[])), 400, "empty")
    assert_error(post(server, "/generate", {"text": ""}), 400, "empty", param="text")
    assert_error(post(server, "/generate", {"input_ids": []}), 400, "empty", param="input_ids")
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": []})
    assert_error(r, 400, "at least one message", param="messages")


def test_generate_needs_exactly_one_prompt(server: ServerThread) -> None:
    assert_error(post(server, "/generate", {}), 400, "exactly one of")
    assert_error(post(server, "/generate", {"text": "a", "input_ids": [5]}), 400, "exactly one")


def test_context_length(server: ServerThread) -> None:
    prompt = "x" * 100  # 100 tokens with the fake's byte tokenizer
    r = post(server, "/v1/completions", completion(prompt=prompt, max_tokens=50))
    assert_error(r, 400, str(MAX_MODEL_LEN), "150", "100", "50", param="max_tokens")
    r = post(server, "/v1/completions", completion(prompt="y" * 200, max_tokens=1))
    assert_error(r, 400, str(MAX_MODEL_LEN), "200")
    r = post(
        server,
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "z" * 300}]},
    )
    assert_error(r, 400, str(MAX_MODEL_LEN))
    r = post(server, "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 29}})
    assert_error(r, 400, str(MAX_MODEL_LEN), "129")


@pytest.mark.parametrize("value", [0, -1, 10**12])
def test_bad_max_tokens(server: ServerThread, value: int) -> None:
    r = post(server, "/v1/completions", completion(max_tokens=value))
    assert_error(r, 400, param="max_tokens")
    r = post(
        server,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": value,
        },
    )
    assert_error(r, 400)


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("n", 0, "greater than or equal to 1"),
        ("n", 17, "less than or equal to 16"),
        ("temperature", -0.1, "greater than or equal to 0"),
        ("temperature", 2.5, "less than or equal to 2"),
        ("top_p", 0, "greater than 0"),
        ("top_p", 1.5, "less than or equal to 1"),
        ("top_k", 0, "top_k"),
        ("min_p", 2, "less than or equal to 1"),
        ("presence_penalty", 3, "less than or equal to 2"),
        ("logprobs", 50, "less than or equal to 20"),
    ],
)
def test_out_of_range(server: ServerThread, field: str, value: Any, fragment: str) -> None:
    r = post(server, "/v1/completions", completion(**{field: value}))
    assert_error(r, 400, field, fragment, param=field)


def test_out_of_range_streaming_is_rejected_before_streaming(server: ServerThread) -> None:
    r = post(server, "/v1/completions", completion(stream=True, temperature=9))
    assert_error(r, 400, "temperature")
    assert r.headers["content-type"].startswith("application/json")


def test_unknown_model(server: ServerThread) -> None:
    r = post(server, "/v1/completions", completion(model="gpt-9"))
    assert_error(r, 404, "gpt-9", MODEL, param="model")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])


def test_openai_client_sees_bad_request(server: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", n=0)
    assert "n" in str(info.value)


def test_engine_value_error_is_400(server: ServerThread) -> None:
    r = post(
        server, "/generate", {"input_ids": [5, 999999], "sampling_params": {"max_new_tokens": 2}}
    )
    assert_error(r, 400, "999999", "out of range")


def test_unknown_route_and_method(server: ServerThread) -> None:
    assert_error(httpx.get(f"{server.base_url}/v1/nothing"), 404, "Not Found")
    assert_error(httpx.get(f"{server.base_url}/v1/completions"), 405)


def test_still_serving_after_bad_requests(server: ServerThread) -> None:
    assert_still_serving(server)


# ---------------------------------------------------------------------------------- engine failures


def test_step_exception_fails_request_and_loop_survives(
    server: ServerThread, engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """The client gets a fixed text with an id; the exception's text goes to the log only."""
    engine.fail_steps = 1
    with caplog.at_level(logging.ERROR, logger="radixkv.server"):
        r = post(server, "/v1/completions", completion())
    assert_error(r, 500, "internal error (id ")
    assert "injected" not in r.text
    error_id = r.json()["error"]["message"].split("id ")[1].split(";")[0]
    assert any(error_id in m and "injected step failure" in m for m in caplog.messages)
    assert server.app.state.engine_loop.alive
    assert_still_serving(server)


def test_step_exception_mid_stream(server: ServerThread, engine: FakeEngine) -> None:
    engine.step_delay = 0.01
    try:
        with httpx.stream(
            "POST",
            f"{server.base_url}/v1/completions",
            json=completion(prompt="a long enough prompt", max_tokens=100, stream=True),
            timeout=30,
        ) as r:
            assert r.status_code == 200
            events = []
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: ") :])
                if len(events) == 2:
                    engine.fail_steps = 1
    finally:
        engine.step_delay = 0.0
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "internal error (id " in error["message"] and "injected" not in error["message"]
    assert_still_serving(server)
    server.app.state.engine_loop.call_sync(lambda e: e.check_integrity())


def test_queue_full_is_503() -> None:
    engine = FakeEngine()
    engine.paused = True
    app = create_app(engine, model_name=MODEL, max_waiting=2)
    with ServerThread(app) as srv:
        url = f"{srv.base_url}/v1/completions"

        async def scenario() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as http:
                first = [asyncio.create_task(http.post(url, json=completion())) for _ in range(2)]
                deadline = time.monotonic() + 10
                while app.state.engine_loop.num_pending < 2 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                third = await http.post(url, json=completion())
                engine.paused = False
                return [third, *(await asyncio.gather(*first))]

        third, *rest = asyncio.run(scenario())
        assert_error(third, 503, "overloaded", "max_waiting=2")
        assert [r.status_code for r in rest] == [200, 200]
        metrics = httpx.get(f"{srv.base_url}/metrics").text
        assert 'radixkv_requests_rejected_total{reason="queue_full"} 1.0' in metrics
