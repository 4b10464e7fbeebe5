"""Tool-call parsers of ``tool_choice: "auto"`` (vLLM's ``--tool-call-parser`` names): how a
model writes its tool calls in plain text, read back into ``(name, arguments)`` pairs.

* ``hermes`` (Hermes, Qwen2.5/Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks anywhere in the answer; the text around them is content.
* ``llama3_json`` (Llama 3.1+ with its JSON tool format): the whole answer is one or more
  ``{"name": ..., "parameters": {...}}`` objects (``arguments`` also taken), separated by ``;``,
  after an optional ``<|python_tag|>``; anything else is content.
* ``mistral`` (Mistral's ``[TOOL_CALLS]``): the text before ``[TOOL_CALLS]`` is content; after it a
  JSON list of ``{"name", "arguments"}`` (v3 tokenizers) or ``name[ARGS]{...}`` calls (v11+).

Each parser has ``parse(text) -> (calls, content) | None`` (None: no call, or one that does not
parse: the answer is text) and ``hold(text) -> i``: the answer's first ``i`` characters are
content whatever comes next (streaming sends them; the rest waits for the end).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .reasoning import partial_suffix

__all__ = ["TOOL_CALL_PARSERS", "ToolCallParser"]

Calls = list[tuple[str, Any]]


def _hold_at(marker: str) -> Callable[[str], int]:
    def hold(text: str) -> int:
        at = text.find(marker)
        return at if at >= 0 else len(text) - partial_suffix(text, marker)

    return hold


def _call(value: Any, args_key: str = "arguments") -> tuple[str, Any] | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get(args_key, value.get("arguments", value.get("parameters", {})))
    return (value["name"], args) if isinstance(args, dict) else None


def _hermes(text: str) -> tuple[Calls, str] | None:
    open_, close = "<tool_call>", "</tool_call>"
    calls: Calls = []
    rest: list[str] = []
    while (at := text.find(open_)) >= 0:
        rest.append(text[:at])
        end = text.find(close, at)
        if end < 0:
            return None
        try:
            call = _call(json.loads(text[at + len(open_) : end]))
        except ValueError:
            return None
        if call is None:
            return None
        calls.append(call)
        text = text[end + len(close) :]
    rest.append(text)
    return (calls, "".join(rest).strip()) if calls else None


_PYTHON_TAG = "<|python_tag|>"


def _objects(text: str, sep: str) -> list[Any] | None:
    """The JSON values of ``text`` one after another (``sep`` and whitespace between), or None
    when anything else is there."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    i = 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == sep):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


def _llama3(text: str) -> tuple[Calls, str] | None:
    body = text.strip().removeprefix(_PYTHON_TAG)
    values = _objects(body, ";") if body.lstrip().startswith("{") else None
    calls = [_call(v, "parameters") for v in values or []]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None], ""


def _llama3_hold(text: str) -> int:
    head = text.lstrip()
    if not head or head.startswith("{") or head.startswith(_PYTHON_TAG):
        return 0
    return 0 if _PYTHON_TAG.startswith(head) else len(text)


_MISTRAL = "[TOOL_CALLS]"


def _mistral(text: str) -> tuple[Calls, str] | None:
    at = text.find(_MISTRAL)
    if at < 0:
        return None
    content, body = text[:at].strip(), text[at + len(_MISTRAL) :].strip()
    calls: list[tuple[str, Any] | None] = []
    if body.startswith("["):  # v3: a JSON list
        values = _objects(body, ",")
        if values is None or len(values) != 1 or not isinstance(values[0], list):
            return None
        calls = [_call(v) for v in values[0]]
    else:  # v11+: name[ARGS]{...}, each after its own [TOOL_CALLS]
        for part in body.split(_MISTRAL):
            name, sep, args = part.strip().partition("[ARGS]")
            values = _objects(args, ",") if sep else None
            ok = values is not None and len(values) == 1 and name.strip()
            calls.append(_call({"name": name.strip(), "arguments": values[0]}) if ok else None)  # type: ignore[index]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None], content


@dataclass(frozen=True)
class ToolCallParser:
    """One model family's tool-call text format (module docstring)."""

    name: str
    parse: Callable[[str], tuple[Calls, str] | None]
    hold: Callable[[str], int]


TOOL_CALL_PARSERS = {
    "hermes": ToolCallParser("hermes", _hermes, _hold_at("<tool_call>")),
    "llama3_json": ToolCallParser("llama3_json", _llama3, _llama3_hold),
    "mistral": ToolCallParser("mistral", _mistral, _hold_at(_MISTRAL)),
}
