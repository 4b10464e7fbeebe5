"""Request fields mixed into the models of :mod:`radixkv.server.protocol`: ``logit_bias`` and
``min_tokens`` (every endpoint; ``/generate`` also takes SGLang's ``min_new_tokens``) and the
chat template controls of ``/v1/chat/completions`` (vLLM's names).

Format and range checks are here (a 400 naming the field); the checks that need the model
(``logit_bias`` keys inside the vocabulary) and the resolved ``max_tokens`` (``min_tokens`` at
most it) are the engine's (:mod:`radixkv.engine.logits_processors`), answered 400 the same way.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from radixkv.engine.chat_template import RESERVED_TEMPLATE_KWARGS
from radixkv.engine.logits_fields import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES

__all__ = ["ChatTemplateFields", "GenerateLogitsFields", "LogitsFields", "SGLangAccepted"]


class LogitsFields(BaseModel):
    """``logit_bias`` (OpenAI: token id as a string -> bias in [-100, 100]) and ``min_tokens``
    (vLLM: EOS, stop token ids and stop strings held off until that many tokens are out)."""

    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_and_range(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return None
        if len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} entries")
        for key, bias in value.items():
            if not key.strip().isdigit():
                raise ValueError(f"key {key!r} is not a token id (a non-negative integer)")
            if not math.isfinite(bias) or abs(bias) > MAX_LOGIT_BIAS:
                raise ValueError(
                    f"the bias of token {key} is {bias}; it must be in "
                    f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
                )
        return value

    def logits_kwargs(self) -> dict[str, Any]:
        """``SamplingParams`` keyword arguments (token ids as integers)."""
        bias = {int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None
        return {"logit_bias": bias, "min_tokens": self.min_tokens}


class GenerateLogitsFields(LogitsFields):
    """``/generate``'s: SGLang's ``min_new_tokens`` besides vLLM's ``min_tokens``."""

    min_new_tokens: int | None = Field(None, ge=0)

    def logits_kwargs(self) -> dict[str, Any]:
        """As :meth:`LogitsFields.logits_kwargs`, ``min_new_tokens`` winning when given."""
        kwargs = super().logits_kwargs()
        if self.min_new_tokens is not None:
            kwargs["min_tokens"] = self.min_new_tokens
        return kwargs


class ChatTemplateFields(BaseModel):
    """vLLM's chat template controls: ``add_generation_prompt`` (default true),
    ``continue_final_message`` (the last message is left open and continued; needs
    ``add_generation_prompt`` false), ``chat_template_kwargs`` (extra template variables, e.g.
    ``enable_thinking``) and ``chat_template`` (a Jinja template for this request, taken only
    when the server trusts request templates)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = Field(None, min_length=1)

    @field_validator("continue_final_message")
    @classmethod
    def _not_both(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt", True):
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be true (set "
                "add_generation_prompt to false to continue the last message)"
            )
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_reserved(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        clash = sorted(RESERVED_TEMPLATE_KWARGS.intersection(value or {}))
        if clash:
            raise ValueError(f"may not set {', '.join(clash)} (a field of its own, or internal)")
        return value

    def template_options(self) -> dict[str, Any]:
        """Keyword arguments of :func:`radixkv.engine.chat_template.render_chat` (the request's
        ``chat_template`` only when given)."""
        options: dict[str, Any] = {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "chat_template_kwargs": self.chat_template_kwargs,
        }
        if self.chat_template is not None:
            options["chat_template"] = self.chat_template
        return options


class SGLangAccepted(BaseModel):
    """SGLang's extension fields that sgl-router (and SGLang's clients) add to every OpenAI request,
    taken at the values that ask for nothing radixkv does not do: ``no_stop_trim`` false (stop
    strings are trimmed, as here), ``return_hidden_states`` false, and ``separate_reasoning`` /
    ``stream_reasoning``: with a reasoning parser (``--reasoning-parser``), ``separate_reasoning``
    false leaves the text as it is (default: separated, :mod:`.reasoning`); without one the
    text is always left as it is, as in SGLang. ``no_stop_trim`` or ``return_hidden_states``
    true is a 400 naming the field."""

    no_stop_trim: Literal[False] | None = None
    return_hidden_states: Literal[False] | None = None
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
