"""Structured outputs and tool calls over HTTP, on the real SmolLM2-135M-Instruct, greedy.

* OpenAI ``response_format`` (``json_schema``, ``json_object``), vLLM ``structured_outputs`` and
  ``guided_*``, SGLang ``/generate`` ``json_schema`` / ``regex`` / ``ebnf``: outputs validate,
  full-match or are one of the choices; streamed text equals the non-streamed text;
* tools with ``tool_choice`` a named function or ``"required"``: ``tool_calls`` whose arguments
  parse and validate against the function's schema (streamed too); ``"auto"`` is a 400;
* an invalid schema, regex or grammar, or two constraints at once, is a 400 naming the problem,
  and the server keeps serving.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from fake_engine import ServerThread
from structured_cases import SCHEMAS

from radixkv.server.app import create_app

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 99},
                    "b": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["a", "b"],
            },
        },
    },
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server(real_model: Any) -> Iterator[ServerThread]:
    from radixkv import Engine

    engine = Engine(real_model, dtype="float32", kv_cache_tokens=8192)
    with ServerThread(create_app(engine)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


def name(client: openai.OpenAI) -> str:
    """The served model's name (the one ``/v1/models`` lists)."""
    return client.models.list().data[0].id


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def post(server: ServerThread, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120)


def test_response_format_json_schema_whole_and_streamed(client: openai.OpenAI) -> None:
    for question, schema in (SCHEMAS[0], SCHEMAS[7], SCHEMAS[16]):
        args: dict[str, Any] = dict(
            model=name(client),
            messages=user(question + " Answer in JSON."),
            max_tokens=80,
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": schema, "strict": True},
            },
        )
        whole = client.chat.completions.create(**args)
        text = whole.choices[0].message.content or ""
        assert whole.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
        chunks = list(client.chat.completions.create(**args, stream=True))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_json_object_and_vllm_fields_on_both_openai_endpoints(
    client: openai.OpenAI, server: ServerThread
) -> None:
    obj = client.chat.completions.create(
        model=name(client),
        messages=user("Give a JSON object with the key ok set to true."),
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    prompt = "My phone number is "
    regex = r"\d{3}-\d{4}"
    for extra in ({"guided_regex": regex}, {"structured_outputs": {"regex": regex}}):
        out = client.completions.create(
            model=name(client), prompt=prompt, max_tokens=12, temperature=0, extra_body=extra
        )
        assert re.fullmatch(regex, out.choices[0].text), out.choices[0].text
        streamed = client.completions.create(
            model=name(client),
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body=extra,
        )
        assert "".join(c.choices[0].text for c in streamed if c.choices) == out.choices[0].text
    choices = ["Paris", "London", "Rome"]
    out = client.completions.create(
        model=name(client),
        prompt="The capital of Italy is",
        max_tokens=8,
        temperature=0,
        n=2,
        extra_body={"guided_choice": choices},
    )
    assert [c.text for c in out.choices] == ["Rome", "Rome"]
    r = post(
        server,
        "/v1/chat/completions",
        {
            "messages": user("A person as JSON."),
            "max_tokens": 60,
            "temperature": 0,
            "guided_json": SCHEMAS[0][1],
        },
    )
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), SCHEMAS[0][1])


def test_sglang_generate_fields(server: ServerThread) -> None:
    schema = SCHEMAS[2][1]
    cases = [
        ({"json_schema": json.dumps(schema)}, lambda t: jsonschema.validate(json.loads(t), schema)),
        ({"regex": r"[0-9]{2}:[0-9]{2}"}, lambda t: re.fullmatch(r"[0-9]{2}:[0-9]{2}", t)),
        ({"ebnf": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
    ]
    for fields, check in cases:
        body = {
            "text": "Answer: ",
            "sampling_params": {"max_new_tokens": 24, "temperature": 0, **fields},
        }
        r = post(server, "/generate", body)
        assert r.status_code == 200, r.text
        text = r.json()["text"]
        assert check(text) is not False, (fields, text)
        assert r.json()["meta_info"]["finish_reason"]["type"] == "stop"


def test_unconstrained_answer_unchanged_beside_constrained_ones(
    client: openai.OpenAI, server: ServerThread
) -> None:
    import concurrent.futures as cf

    def free() -> str:
        out = client.completions.create(
            model=name(client), prompt="Once upon a time", max_tokens=12, temperature=0
        )
        return out.choices[0].text

    alone = free()
    with cf.ThreadPoolExecutor(4) as pool:
        constrained = [
            pool.submit(
                post,
                server,
                "/v1/completions",
                {"prompt": "Data: ", "max_tokens": 30, "temperature": 0, "guided_json": s},
            )
            for _, s in SCHEMAS[:3]
        ]
        beside = pool.submit(free)
        assert beside.result() == alone
        for (_, schema), fut in zip(SCHEMAS[:3], constrained):
            jsonschema.validate(json.loads(fut.result().json()["choices"][0]["text"]), schema)


@pytest.mark.parametrize(
    ("field", "needle"),
    [
        ({"guided_regex": "(ab"}, "parenthesis"),
        ({"guided_json": {"type": "frobnicate"}}, "frobnicate"),
        ({"guided_grammar": "root ::= nowhere"}, "nowhere"),
        ({"guided_json": "{nope"}, "not valid JSON"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex and guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "whitespace_pattern"),
        ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"guided_regex": "a", "use_beam_search": True, "n": 2}, "use_beam_search"),
    ],
)
def test_bad_constraints_are_400_and_the_server_keeps_serving(
    server: ServerThread, field: dict[str, Any], needle: str
) -> None:
    body = {"messages": user("hi"), "max_tokens": 4, "temperature": 0, **field}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.json()
    ok = post(server, "/v1/chat/completions", {"messages": user("hi"), "max_tokens": 2})
    assert ok.status_code == 200


def test_a_compile_over_the_bound_is_a_400(server: ServerThread) -> None:
    import threading

    grammars = server.app.state.engine.grammars
    gate = threading.Event()
    blockers = [grammars.pool._pool.submit(gate.wait) for _ in range(2)]  # both workers busy
    grammars.timeout_s = 0.3
    try:
        body = {"messages": user("hi"), "max_tokens": 4, "guided_regex": "slow[0-9]"}
        r = post(server, "/v1/chat/completions", body)
    finally:
        grammars.timeout_s = 10.0
        gate.set()
    from radixkv.engine.grammar import WAIT_FACTOR

    # the wait's bound: WAIT_FACTOR times the compile's (queued behind the busy workers)
    assert r.status_code == 400, r.text
    assert f"did not compile within {0.3 * WAIT_FACTOR:g} s" in r.text, r.text
    for b in blockers:
        b.result(5)
    # compiled meanwhile: the same request now succeeds
    assert post(server, "/v1/chat/completions", body).status_code == 200


def _validate_calls(calls: list[Any]) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        fn = call["function"]
        jsonschema.validate(json.loads(fn["arguments"]), PARAMS[fn["name"]])


def _stream_tool_calls(server: ServerThread, body: dict[str, Any]) -> tuple[list[Any], str]:
    """The tool calls a streamed answer assembles (OpenAI's delta rules) and its finish."""
    calls: dict[int, dict[str, Any]] = {}
    finish = ""
    with httpx.stream(
        "POST", f"{server.base_url}/v1/chat/completions", json={**body, "stream": True}, timeout=120
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            for delta in choice["delta"].get("tool_calls") or []:
                slot = calls.setdefault(delta["index"], {"function": {"name": "", "arguments": ""}})
                slot.update({k: v for k, v in delta.items() if k in ("id", "type")})
                slot["function"]["name"] += delta.get("function", {}).get("name", "")
                slot["function"]["arguments"] += delta.get("function", {}).get("arguments", "")
            finish = choice["finish_reason"] or finish
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize(
    "tool_choice",
    [{"type": "function", "function": {"name": "get_weather"}}, "required"],
    ids=["named", "required"],
)
def test_tool_calls_whole_and_streamed(server: ServerThread, tool_choice: Any) -> None:
    body = {
        "messages": user("What is the weather in Paris?"),
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "max_tokens": 60,
        "temperature": 0,
        "parallel_tool_calls": False,
    }
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    _validate_calls(calls)
    if tool_choice != "required":
        assert calls[0]["function"]["name"] == "get_weather"
    streamed, finish = _stream_tool_calls(server, body)
    assert finish == "tool_calls"
    _validate_calls(streamed)
    assert [c["function"] for c in streamed] == [c["function"] for c in calls]


@pytest.mark.parametrize(
    ("tool_choice", "needle"),
    [
        ("auto", "auto"),
        (None, "auto"),
        ({"type": "function", "function": {"name": "nope"}}, "nope"),
    ],
)
def test_unsupported_tool_choices_are_400(
    server: ServerThread, tool_choice: Any, needle: str
) -> None:
    body: dict[str, Any] = {"messages": user("hi"), "tools": TOOLS, "max_tokens": 4}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    none = post(server, "/v1/chat/completions", {**body, "tool_choice": "none"})
    assert none.status_code == 200 and "tool_calls" not in none.json()["choices"][0]["message"]


def test_openapi_shows_the_constraint_fields(server: ServerThread) -> None:
    schemas = httpx.get(f"{server.base_url}/openapi.json").json()["components"]["schemas"]
    openai_fields = {"response_format", "structured_outputs", "guided_json", "guided_regex"}
    assert openai_fields <= set(schemas["CompletionRequest"]["properties"])
    chat = set(schemas["ChatCompletionRequest"]["properties"])
    assert openai_fields | {"tools", "tool_choice"} <= chat
    assert {"json_schema", "regex", "ebnf"} <= set(schemas["GenerateSamplingParams"]["properties"])


def test_with_a_reasoning_parser_the_constraint_applies_after_the_think_block(
    real_model: Any,
) -> None:
    """``--reasoning-parser``: a chat's constraint applies after the ``<think>`` block (as
    vLLM's), so the reasoning is free text. The answer continues an assistant message: one whose
    block is closed answers one of the choices; one whose block is open reasons as it would
    unconstrained (SmolLM2 does not close it within the token budget)."""
    from radixkv import Engine

    engine = Engine(real_model, dtype="float32", kv_cache_tokens=4096)
    question = user("Is the sky blue? Answer yes or no.")

    def answer(thought: str, **extra: Any) -> dict[str, Any]:
        body = {
            "messages": [*question, {"role": "assistant", "content": thought}],
            "continue_final_message": True,
            "add_generation_prompt": False,
            "max_tokens": 16,
            "temperature": 0,
            **extra,
        }
        r = post(srv, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    choice = {"structured_outputs": {"choice": ["yes", "no"]}}
    with ServerThread(create_app(engine, reasoning_parser="qwen3")) as srv:
        closed = answer("<think>The sky is blue.</think>", **choice)
        assert closed["message"]["content"] in ("yes", "no"), closed
        assert closed["finish_reason"] == "stop"
        free = answer("<think>Let me", ignore_eos=True)
        assert "</think>" not in (free["message"]["content"] or "")  # the premise
        gated = answer("<think>Let me", ignore_eos=True, **choice)
        assert gated["message"] == free["message"]
