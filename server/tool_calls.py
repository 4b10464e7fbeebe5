"""Tool calls of ``/v1/chat/completions`` by constrained decoding (OpenAI's ``tools``).

``tool_choice``:

* a named function (``{"type": "function", "function": {"name": ...}}``): the output is that
  function's arguments, a JSON object constrained to its ``parameters`` schema;
* ``"required"``: the output is a JSON array of ``{"name": ..., "arguments": {...}}`` calls (at
  least one; exactly one when ``parallel_tool_calls`` is false), each a function of ``tools``
  with arguments matching its schema;
* ``"none"`` (or no ``tools``): tools are ignored, the answer is text;
* ``"auto"`` (OpenAI's default when ``tools`` is given): with ``--enable-auto-tool-choice
  --tool-call-parser NAME`` (vLLM's flags; :mod:`.tool_parsers`: ``hermes``, ``llama3_json``,
  ``mistral``), the model answers as it likes and the calls it writes in its own format become
  ``tool_calls``, the text around them ``content``; nothing is constrained.
  Without those flags it is a 400 naming them. The tools are the chat template's ``tools``
  for every choice but ``"none"`` (the template shows them to the model, as vLLM does).

Answers: a parsed call list is returned as ``message.tool_calls`` (``arguments`` a JSON
string, ``content`` null) with ``finish_reason: "tool_calls"``. An output cut short (``length``)
does not parse: it is returned as text with its own finish reason. Streaming: a named call's
arguments stream as they are generated (the first delta carries the call's id and name); a
``required`` list is sent whole in the final deltas, once it parses; with ``auto`` the content
streams as far as it cannot be part of a call, and the calls are sent whole at the end.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from radixkv.engine.structured import StructuredOutputs

from .protocol import APIError
from .tool_parsers import TOOL_CALL_PARSERS, ToolCallParser

__all__ = ["TOOL_CALL_PARSERS", "ToolCallStream", "ToolPlan", "tool_plan"]

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolPlan:
    """How one chat request's output becomes tool calls (module docstring). ``named`` is the
    forced function's name (its arguments are the whole output), None for ``"required"``."""

    named: str | None
    spec: StructuredOutputs | None  # None: "auto", nothing constrained
    auto: ToolCallParser | None = None  # "auto": the model's format

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """OpenAI ``tool_calls`` of a finished output, or None when ``text`` does not parse."""
        if self.auto is not None:
            found = self.auto.parse(text)
            if found is None:
                return None
            return [self._call(n, json.dumps(a, ensure_ascii=False)) for n, a in found[0]]
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.named is not None:
            if not isinstance(value, dict):
                return None
            return [self._call(self.named, text)]
        if not isinstance(value, list) or not value:
            return None
        out = []
        for item in value:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None
            args = json.dumps(item.get("arguments", {}), ensure_ascii=False)
            out.append(self._call(item["name"], args))
        return out

    @staticmethod
    def _call(name: str, arguments: str) -> dict[str, Any]:
        return {
            "id": _call_id(),
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The non-streamed ``(message, finish_reason)`` of one choice."""
        calls = self.calls(text) if finish_reason == "stop" else None
        if calls is None:
            return {"role": "assistant", "content": text}, finish_reason
        content = (self.auto.parse(text) or ([], ""))[1] or None if self.auto else None
        return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"


def tool_plan(body: Any, parser: str | None = None) -> ToolPlan | None:
    """The request's tool plan (None: answer with text), or a 400 naming what is unsupported.
    ``parser``: the server's ``--tool-call-parser`` (with ``--enable-auto-tool-choice``), which
    ``"auto"`` needs."""
    tools = body.tools
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if choice == "none":
        return None
    if (choice is None or choice == "auto") and parser is not None:
        return ToolPlan(None, None, auto=TOOL_CALL_PARSERS[parser])
    if choice is None or choice == "auto":
        raise APIError(
            400,
            'tool_choice "auto" needs a tool-call parser: this server was started without '
            "--enable-auto-tool-choice --tool-call-parser NAME (hermes: Qwen, Hermes; "
            'llama3_json: Llama 3.1+; mistral). Use tool_choice "required" or name a '
            'function ({"type": "function", "function": {"name": ...}}); "none" ignores the '
            "tools.",
            param="tool_choice",
        )
    by_name = {t.function.name: t.function for t in tools}
    if len(by_name) != len(tools):
        raise APIError(400, "tools: function names must be unique", param="tools")
    if choice == "required":
        cases = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": name},
                    "arguments": fn.parameters or _ANY_OBJECT,
                },
                "required": ["name", "arguments"],
            }
            for name, fn in by_name.items()
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": cases}}
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan(None, StructuredOutputs(json=schema, disable_any_whitespace=True))
    name = choice.function.name
    if name not in by_name:
        raise APIError(
            400,
            f"tool_choice names function {name!r}, which is not in tools "
            f"({', '.join(sorted(by_name))})",
            param="tool_choice",
        )
    params = by_name[name].parameters or _ANY_OBJECT
    return ToolPlan(name, StructuredOutputs(json=params, disable_any_whitespace=True))


@dataclass
class ToolCallStream:
    """Streamed tool-call deltas of one request's ``n`` choices (module docstring)."""

    plan: ToolPlan
    texts: dict[int, str] = field(default_factory=dict)
    ids: dict[int, str] = field(default_factory=dict)

    sent: dict[int, int] = field(default_factory=dict)  # auto: content characters sent

    def deltas(
        self, index: int, new_text: str, finished: bool, finish_reason: str | None
    ) -> list[tuple[dict[str, Any], str | None]]:
        """``(delta, finish_reason or None)`` chunks for choice ``index`` after one output."""
        text = self.texts.get(index, "") + new_text
        self.texts[index] = text
        if self.plan.auto is not None:
            return self._auto(self.plan.auto, index, text, finished, finish_reason)
        out: list[tuple[dict[str, Any], str | None]] = []
        if self.plan.named is not None and new_text:
            call: dict[str, Any] = {"index": 0, "function": {"arguments": new_text}}
            if index not in self.ids:
                self.ids[index] = _call_id()
                call.update(id=self.ids[index], type="function")
                call["function"] = {"name": self.plan.named, "arguments": new_text}
            out.append(({"tool_calls": [call]}, None))
        if not finished:
            return out
        calls = self.plan.calls(text) if finish_reason == "stop" else None
        if calls is None:
            if self.plan.named is None and text:  # never sent: the text as it is
                out.append(({"content": text}, None))
            return [*out, ({}, finish_reason)]
        if self.plan.named is None:
            listed = [{"index": i, **c} for i, c in enumerate(calls)]
            out.append(({"tool_calls": listed}, None))
        return [*out, ({}, "tool_calls")]

    def _auto(
        self,
        parser: ToolCallParser,
        index: int,
        text: str,
        finished: bool,
        finish_reason: str | None,
    ) -> list[tuple[dict[str, Any], str | None]]:
        """``auto``: content as far as it cannot be part of a call (``parser.hold``), the calls
        whole at the end."""
        sent = self.sent.get(index, 0)
        out: list[tuple[dict[str, Any], str | None]] = []
        calls = self.plan.calls(text) if finished and finish_reason == "stop" else None
        upto = len(text) if finished and calls is None else max(sent, parser.hold(text))
        if upto > sent:
            out.append(({"content": text[sent:upto]}, None))
            self.sent[index] = upto
        if not finished:
            return out
        if calls is None:
            return [*out, ({}, finish_reason)]
        after = (parser.parse(text[upto:]) or ([], ""))[1]  # content after the calls
        if after:
            out.append(({"content": after}, None))
        listed = [{"index": i, **c} for i, c in enumerate(calls)]
        out.append(({"tool_calls": listed}, None))
        return [*out, ({}, "tool_calls")]
