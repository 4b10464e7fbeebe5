"""Reasoning parsers (issue 58): a ``<think>`` block returned as ``reasoning_content``, whole and
streamed, as vLLM's ``--reasoning-parser`` and SGLang's ``separate_reasoning`` do. The stream
splits any cut of a text into deltas as the whole text is split (markers split across deltas
included); through the server on the fake engine, which answers with its prompt."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from fake_engine import FakeEngine, ServerThread

from radixkv.server.app import create_app
from radixkv.server.reasoning import REASONING_PARSERS, ReasoningStream, split_reasoning

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]


@pytest.mark.parametrize(
    "parser, text, want",
    [
        (QWEN3, "<think>plan it</think>\n\nThe answer.", ("plan it", "\n\nThe answer.")),
        (QWEN3, "no thinking here", (None, "no thinking here")),
        (QWEN3, "<think>cut short", ("cut short", None)),
        (QWEN3, "<think></think>x", ("", "x")),
        (R1, "plan it</think>The answer.", ("plan it", "The answer.")),
        (R1, "still thinking", ("still thinking", None)),
        (QWEN3, "a </thin b", (None, "a </thin b")),  # a marker's prefix is plain text
    ],
)
def test_split_reasoning(parser, text, want) -> None:
    assert split_reasoning(parser, text) == want


def test_any_cut_into_deltas_splits_as_the_whole_text() -> None:
    rng = random.Random(0)
    texts = ["hi <think>deep</think>\n\nanswer", "<think></think>x", "a<thin", "<think>a</think",
             "x</think>y<think>z", "<<think>>a<</think>>b"]  # fmt: skip
    for parser in (QWEN3, R1):
        for text in texts:
            whole = split_reasoning(parser, text)
            for _ in range(300):
                cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, len(text))))
                parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
                stream = ReasoningStream(parser)
                got = [stream.feed(p) for p in parts] + [stream.finish()]
                reasoning = "".join(r for r, _ in got)
                content = "".join(c for _, c in got)
                assert (reasoning if stream.saw_reasoning else None, content or None) == whole


MESSAGES = [{"role": "user", "content": "<think>weigh the options</think>Pick B."}]
#: the fake's answer is its rendered prompt, once through with this many tokens (bytes)
ANSWER = len("<|user|><think>weigh the options</think>Pick B.\n<|assistant|>")


def _chat(url: str, **extra) -> httpx.Response:
    body = {"messages": MESSAGES, "max_tokens": ANSWER, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)


def test_chat_answers_carry_the_reasoning_apart_whole_and_streamed() -> None:
    with ServerThread(create_app(FakeEngine(), reasoning_parser="qwen3")) as srv:
        # the fake answers with its rendered prompt: <|user|>CONTENT\n<|assistant|>
        message = _chat(srv.base_url).json()["choices"][0]["message"]
        assert message["reasoning_content"] == "weigh the options"
        assert message["content"] == "<|user|>Pick B.\n<|assistant|>"
        reasoning, content = "", ""
        with httpx.stream("POST", f"{srv.base_url}/v1/chat/completions", timeout=30,
                          json={"messages": MESSAGES, "max_tokens": ANSWER, "stream": True}) as r:  # fmt: skip
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        reasoning += choice["delta"].get("reasoning_content") or ""
                        content += choice["delta"].get("content") or ""
        assert (reasoning, content) == ("weigh the options", "<|user|>Pick B.\n<|assistant|>")
        # SGLang's separate_reasoning false: the text as it is
        kept = _chat(srv.base_url, separate_reasoning=False).json()["choices"][0]["message"]
        assert "reasoning_content" not in kept and "<think>" in kept["content"]
    # without a parser nothing changes
    with ServerThread(create_app(FakeEngine())) as srv:
        plain = _chat(srv.base_url).json()["choices"][0]["message"]
        assert "reasoning_content" not in plain and "<think>" in plain["content"]
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        create_app(FakeEngine(), reasoning_parser="granite")
