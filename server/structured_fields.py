"""Request fields of structured outputs and tools, as mixins of the request models in
:mod:`radixkv.server.protocol` (pydantic only; :mod:`radixkv.server.structured_outputs` turns
them into the engine's :class:`~radixkv.engine.structured.StructuredOutputs`).

* OpenAI: ``response_format`` (``text``, ``json_object``, ``json_schema``), ``tools`` and
  ``tool_choice``;
* vLLM: ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``,
  ``disable_any_whitespace``) and the older ``guided_json`` / ``guided_regex`` /
  ``guided_choice`` / ``guided_grammar``;
* SGLang ``/generate`` ``sampling_params``: ``json_schema`` (text), ``regex``, ``ebnf``.

Fields radixkv does not implement inside these objects are a 400 naming them (``extra="forbid"``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "ChatToolFields",
    "GenerateStructuredFields",
    "ResponseFormat",
    "StructuredFields",
    "StructuredOutputsField",
    "Tool",
]


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's named schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI ``response_format``: ``{"type": "text" | "json_object" | "json_schema"}``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and (
            self.json_schema is None or not self.json_schema.schema_
        ):
            raise ValueError('response_format type "json_schema" needs json_schema.schema')
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f'response_format type "{self.type}" takes no json_schema')
        return self


class StructuredOutputsField(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of ``json``, ``regex``, ``choice``,
    ``grammar`` (EBNF) or ``json_object``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class StructuredFields(BaseModel):
    """The constraint fields of ``/v1/completions`` and ``/v1/chat/completions``."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class FunctionDefinition(BaseModel):
    """``tools[i].function``: a name, a description and a JSON schema of the arguments."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    """One entry of ``tools`` (OpenAI's: functions only)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice={"type": "function", "function": {"name": ...}}``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


class ChatToolFields(BaseModel):
    """``tools`` and ``tool_choice`` of ``/v1/chat/completions``."""

    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None


class GenerateStructuredFields(BaseModel):
    """SGLang's constraint fields of ``/generate``'s ``sampling_params``."""

    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
