"""``logit_bias``, ``min_tokens`` / ``min_new_tokens`` and the chat template fields over HTTP, on
the real engine (a tiny random Llama with the fake's byte tokenizer: token id = byte + 3, EOS
2), called with the official ``openai`` client and plain JSON."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from fake_engine import EOS_ID, FakeEngine, FakeTokenizer, ServerThread

from radixkv.server.app import create_app

J = ord("J") + 3  # the token of "J"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    from bench.tiny_model import tiny_loaded_model
    from radixkv.engine.engine import Engine

    engine = Engine(
        tiny_loaded_model(tokenizer=FakeTokenizer()),
        page_size=4,
        kv_cache_tokens=4096,
        attention_backend="torch",
        dtype="float32",
    )
    with ServerThread(create_app(engine, model_name="tiny")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_logit_bias_forces_a_token_in_completions_and_chat(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=4, temperature=0, logit_bias={str(J): 100}
    )
    assert out.choices[0].text == "JJJJ"
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logit_bias={str(J): 100},
    )
    assert chat.choices[0].message.content == "JJJ"


def test_logit_bias_bans_the_greedy_token(server: ServerThread) -> None:
    def first_ids(bias: dict[str, float] | None) -> list[int]:
        sp: dict[str, Any] = {"max_new_tokens": 3, "temperature": 0}
        if bias:
            sp["logit_bias"] = bias
        body = {"input_ids": [40, 50, 60, 70], "sampling_params": sp}
        resp = httpx.post(f"{server.base_url}/generate", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        return resp.json()["output_ids"]

    greedy = first_ids(None)
    banned = first_ids({str(greedy[0]): -100})
    assert banned[0] != greedy[0]
    forced = first_ids({str(greedy[1]): 100})
    assert forced == [greedy[1]] * 3


def test_min_tokens_holds_eos_off(client: openai.OpenAI, server: ServerThread) -> None:
    eager = {str(EOS_ID): 100}
    out = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=10, temperature=0, logit_bias=eager
    )
    assert out.usage.completion_tokens == 1 and out.choices[0].finish_reason == "stop"
    held = client.completions.create(
        model="tiny",
        prompt="Hello",
        max_tokens=10,
        temperature=0,
        logit_bias=eager,
        extra_body={"min_tokens": 4},
    )
    assert held.usage.completion_tokens == 5 and held.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=10,
        temperature=0,
        logit_bias=eager,
        extra_body={"min_tokens": 2},
    )
    assert chat.usage.completion_tokens == 3
    gen = httpx.post(
        f"{server.base_url}/generate",
        json={
            "text": "Hello",
            "sampling_params": {
                "max_new_tokens": 10,
                "temperature": 0,
                "min_new_tokens": 3,
                "logit_bias": eager,
            },
        },
        timeout=60,
    )
    assert gen.status_code == 200, gen.text
    assert gen.json()["meta_info"]["completion_tokens"] == 4


BAD = [
    ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"-3": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 100.5}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": "x"}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"100000": 1}}, "logit_bias"),  # outside the vocab
    ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ("/v1/chat/completions", {"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ("/v1/chat/completions", {"logit_bias": {"1": -101}}, "logit_bias"),
    ("/v1/chat/completions", {"continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"add_generation_prompt": "maybe"}, "add_generation_prompt"),
    ("/v1/chat/completions", {"chat_template": "{{ 1 }}"}, "chat_template"),  # not trusted
    ("/generate", {"sampling_params": {"min_new_tokens": 200}}, "min_tokens"),  # > 128
    ("/generate", {"sampling_params": {"logit_bias": {"x": 1}}}, "logit_bias"),
    ("/tokenize", {"continue_final_message": True}, "continue_final_message"),
]


@pytest.mark.parametrize(("path", "fields", "param"), BAD)
def test_bad_values_are_400s_naming_the_field(
    server: ServerThread, path: str, fields: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 4}
    if path == "/v1/completions":
        body["prompt"] = "Hello"
    elif path == "/generate":
        body = {"text": "Hello"}
    else:
        body["messages"] = [{"role": "user", "content": "Hi"}]
        if path == "/tokenize":
            del body["max_tokens"]
    body.update(fields)
    resp = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert param in err["message"]
    assert param in (err["param"] or "")  # e.g. logit_bias, logit_bias.5, sampling_params.x


def test_request_chat_template_needs_the_trust_flag() -> None:
    """With ``trust_request_chat_template`` the field is rendered (the fake's tokenizer ignores
    it, so the answer is a 200); without it, a 400 (above)."""
    app = create_app(FakeEngine(), trust_request_chat_template=True)
    with ServerThread(app) as srv:
        resp = httpx.post(
            f"{srv.base_url}/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 2,
                "chat_template": "{{ messages[0].content }}",
            },
            timeout=60,
        )
    assert resp.status_code == 200, resp.text
