"""What a structured-output request asks for (vLLM's ``StructuredOutputsParams`` names), validated.

A :class:`StructuredOutputs` names exactly one constraint on the generated text:

* ``json``: a JSON schema (a dict, or its JSON text); the output is one JSON value it accepts;
* ``json_object``: any JSON object (OpenAI's ``response_format={"type": "json_object"}``);
* ``regex``: the whole output matches the regular expression;
* ``choice``: the output is exactly one of the strings;
* ``grammar``: an EBNF grammar (xgrammar's / GBNF syntax, root rule ``root``).

``disable_any_whitespace`` (JSON kinds only) makes JSON use the fixed separators ``", "`` and
``": "`` with no other whitespace; otherwise any whitespace is allowed between JSON tokens, up to
``MAX_JSON_WHITESPACE`` characters a run (so a small model cannot loop on blank lines).

``after_reasoning`` (``(start, end)`` markers, e.g. ``("<think>", "</think>")``): the constraint
applies to what follows a reasoning block, as vLLM does with a reasoning parser: from the first
token after the output's ``end`` marker, or from the first token when the prompt already closed
the block (its last ``end`` after its last ``start``). It is not part of the compile key.

This module has no xgrammar dependency: :mod:`radixkv.engine.grammar` compiles what it
describes. Invariant: a validated instance has exactly one kind, and :meth:`key` is a hashable,
canonical description of it (equal constraints give equal keys; the compile cache's key).
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_CHOICES",
    "MAX_JSON_WHITESPACE",
    "MAX_SPEC_CHARS",
    "CompileQueueFullError",
    "StructuredOutputs",
]

#: Longest constraint text accepted (schema JSON, regex, grammar, all choices together).
MAX_SPEC_CHARS = 65536
#: Most choices accepted.
MAX_CHOICES = 1024
#: Longest run of whitespace between JSON tokens unless ``disable_any_whitespace``.
MAX_JSON_WHITESPACE = 16

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputs:
    """One output constraint (see the module docstring); :meth:`validate` before use."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    after_reasoning: tuple[str, str] | None = None

    @property
    def kind(self) -> str:
        """The one constraint set: ``"json"``, ``"json_object"``, ``"regex"``, ``"choice"`` or
        ``"grammar"`` (``ValueError`` when none or several are)."""
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, json_object, regex, choice or"
                f" grammar; got {', '.join(given) if given else 'none'}"
            )
        return given[0]

    def validate(self) -> StructuredOutputs:
        """Raise ``ValueError`` naming the problem (types, sizes, one kind); returns ``self``.
        Whether the schema, regex or grammar compiles is checked by the compiler."""
        kind = self.kind
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be true or false")
        gate = self.after_reasoning
        if gate is not None and not (
            isinstance(gate, tuple | list)
            and len(gate) == 2
            and all(isinstance(m, str) and m for m in gate)
        ):
            raise ValueError("structured_outputs.after_reasoning must be two non-empty markers")
        if kind == "json_object" and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true or false")
        if kind == "json":
            if isinstance(self.json, str):
                try:
                    schema = _json.loads(self.json)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from exc
            else:
                schema = self.json
            if not isinstance(schema, dict | bool):
                raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        elif kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
        elif kind == "choice":
            if (
                not isinstance(self.choice, list)
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError("structured_outputs.choice must be a list of non-empty strings")
            if len(self.choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice: at most {MAX_CHOICES} choices")
        if len(self.key()[1]) > MAX_SPEC_CHARS:
            raise ValueError(
                f"structured_outputs.{kind} is longer than {MAX_SPEC_CHARS} characters"
            )
        return self

    def key(self) -> tuple[str, str, bool]:
        """``(kind, canonical text, disable_any_whitespace)``: the compile cache's key."""
        kind = self.kind
        if kind == "json":
            schema = _json.loads(self.json) if isinstance(self.json, str) else self.json
            text = _json.dumps(schema, separators=(",", ":"), ensure_ascii=False)  # key order kept
        elif kind == "choice":
            text = _json.dumps(self.choice, ensure_ascii=False)
        elif kind == "json_object":
            text = ""
        else:
            text = str(getattr(self, kind))
        return kind, text, bool(self.disable_any_whitespace)

    def describe(self) -> str:
        """A short description for error messages: the kind and the start of its text."""
        kind, text, _ = self.key()
        return f"{kind} {text[:80]!r}" + ("..." if len(text) > 80 else "")


class CompileQueueFullError(RuntimeError):
    """A key already has its constraints' compiles queued or running (answered 429 over HTTP;
    :class:`~radixkv.engine.grammar.GrammarCompilerPool`)."""
