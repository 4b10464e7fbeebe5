"""``tool_choice: "auto"`` with vLLM's ``--enable-auto-tool-choice --tool-call-parser hermes``
(issue 58): the tools are the chat template's ``tools`` (rendered as transformers renders them),
and the model's ``<tool_call>{...}</tool_call>`` blocks become ``tool_calls``, whole and
streamed, the text around them ``content``. On the fake engine, which answers with its prompt."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fake_engine import FakeEngine, ServerThread

from radixkv.engine.chat_template import render_chat_text
from radixkv.server.app import create_app
from radixkv.server.tool_calls import ToolCallStream, ToolPlan
from radixkv.server.tool_parsers import TOOL_CALL_PARSERS

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


PARIS = ("get_weather", {"city": "Paris"})
#: per parser: (answer, its calls, its content)
FORMATS = {
    "hermes": [
        (f"Let me check.\n{CALL}", [PARIS], "Let me check."),
        (CALL + CALL, [PARIS, PARIS], ""),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [PARIS], ""),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
         '{"name": "get_weather", "arguments": {"city": "Paris"}}', [PARIS, PARIS], ""),
    ],
    "mistral": [
        ('Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
         [PARIS], "Sure."),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]'
         '{"city": "Paris"}', [PARIS, PARIS], ""),
    ],
}  # fmt: skip
NOT_CALLS = {
    "hermes": ["no calls", CALL[:-3], "<tool_call>not json</tool_call>", "<tool_call>[]</tool_call>"],
    "llama3_json": ["plain text", '{"name": "f"', 'text then {"name": "f", "parameters": {}}'],
    "mistral": ["plain", "[TOOL_CALLS]not json", '[TOOL_CALLS][{"arguments": {}}]'],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
def test_each_format_parses_and_the_text_around_the_calls_is_content(name: str) -> None:
    parser = TOOL_CALL_PARSERS[name]
    for text, calls, content in FORMATS[name]:
        assert parser.parse(text) == (calls, content), text
    for text in NOT_CALLS[name]:
        assert parser.parse(text) is None, text


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
def test_streamed_deltas_never_show_a_call_and_end_as_the_whole_answer(name: str) -> None:
    """Any cut of an answer into deltas: the content sent never holds a call's text (not even a
    marker's prefix), and the end gives the whole answer's calls; an answer without calls is
    sent whole as content."""
    import random

    rng = random.Random(1)
    plan = ToolPlan(None, None, auto=TOOL_CALL_PARSERS[name])
    for text, calls, content in [*FORMATS[name], *((t, None, t) for t in NOT_CALLS[name])]:
        for _ in range(50):
            cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(len(text), 12))))
            parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            stream = ToolCallStream(plan)
            deltas = [d for i, p in enumerate(parts)
                      for d in stream.deltas(0, p, i == len(parts) - 1, "stop")]  # fmt: skip
            sent = "".join(d.get("content") or "" for d, _ in deltas)
            got = [c for d, _ in deltas for c in d.get("tool_calls") or []]
            if calls is None:
                assert sent == text and not got and deltas[-1][1] == "stop"
                continue
            assert deltas[-1][1] == "tool_calls"
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                    for c in got] == calls  # fmt: skip
            assert sent.strip() == content, (parts, sent)


def test_tools_are_the_templates_tools_as_transformers_renders_them() -> None:
    from bench.tiny_model import byte_level_hf_tokenizer

    tok = byte_level_hf_tokenizer()
    template = (
        "{% for t in tools %}[tool {{ t.function.name }}: {{ t.function.description }}]"
        "{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    msgs = [{"role": "user", "content": "hi"}]
    got = render_chat_text(tok, msgs, chat_template=template, tools=TOOLS)
    want = tok.apply_chat_template(msgs, chat_template=template, tools=TOOLS, tokenize=False,
                                   add_generation_prompt=True)  # fmt: skip
    assert got == want == "[tool get_weather: Weather.]hi"


def _body(content: str, **extra: Any) -> dict[str, Any]:
    # the fake answers with its rendered prompt, <|user|>CONTENT\n<|assistant|>; the stop string
    # ends it with "stop" after CONTENT
    return {"messages": [{"role": "user", "content": content}], "tools": TOOLS,
            "max_tokens": 400, "stop": ["\n"], **extra}  # fmt: skip


def _stream(url: str, body: dict[str, Any]) -> tuple[str, list[dict[str, Any]], str | None]:
    content, calls, finish = "", [], None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True},
                      timeout=30) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    content += choice["delta"].get("content") or ""
                    calls += choice["delta"].get("tool_calls") or []
                    finish = choice["finish_reason"] or finish
    return content, calls, finish


def test_auto_tool_choice_returns_the_models_calls_whole_and_streamed() -> None:
    with ServerThread(create_app(FakeEngine(), tool_call_parser="hermes")) as srv:
        url = f"{srv.base_url}/v1/chat/completions"
        for choice in ("auto", None):
            body = _body(f"Checking.{CALL}", **({"tool_choice": choice} if choice else {}))
            r = httpx.post(url, json=body, timeout=30)
            assert r.status_code == 200, r.text
            out = r.json()["choices"][0]
            assert out["finish_reason"] == "tool_calls"
            (call,) = out["message"]["tool_calls"]
            assert call["function"]["name"] == "get_weather"
            assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
            assert out["message"]["content"] == "<|user|>Checking."
            content, calls, finish = _stream(srv.base_url, body)
            assert finish == "tool_calls" and content.startswith("<|user|>Checking.")
            assert [c["function"] for c in calls] == [call["function"]]
            assert "<tool_call>" not in content  # never shown, not even a marker's prefix
        # no call in the answer: plain text, as without tools
        plain = httpx.post(url, json=_body("Just text."), timeout=30).json()["choices"][0]
        assert plain["finish_reason"] == "stop" and "tool_calls" not in plain["message"]
        assert plain["message"]["content"] == "<|user|>Just text."
        assert _stream(srv.base_url, _body("Just text.")) == ("<|user|>Just text.", [], "stop")


def test_auto_without_a_parser_is_a_400_naming_the_flags() -> None:
    with ServerThread(create_app(FakeEngine())) as srv:
        r = httpx.post(f"{srv.base_url}/v1/chat/completions", json=_body("hi"), timeout=30)
        assert r.status_code == 400 and "--tool-call-parser NAME (hermes" in r.text
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        create_app(FakeEngine(), tool_call_parser="pythonic")
