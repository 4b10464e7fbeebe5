"""The one chat template path: a conversation rendered by the model's tokenizer into token ids.

Used by :meth:`radixkv.engine.engine.Engine.apply_chat_template` and by the HTTP chat route
(``radixkv.server.intake.apply_chat_template``, which turns the ``ValueError`` into a 400).

The controls are vLLM's: ``add_generation_prompt`` (end with the assistant's header, the
default), ``continue_final_message`` (leave the last message open, so the model continues it;
exclusive with ``add_generation_prompt``), ``chat_template`` (a Jinja template replacing the
model's) and ``chat_template_kwargs`` (extra variables for the template, e.g.
``enable_thinking``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = ["RESERVED_TEMPLATE_KWARGS", "load_chat_template", "render_chat"]

#: Names ``chat_template_kwargs`` may not set: they are ``apply_chat_template``'s own arguments.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "sanitize_control_tokens",
    }
)


def load_chat_template(value: str) -> str:
    """A chat template given as a file path or as the Jinja text itself (as vLLM's
    ``--chat-template``). Raises ``ValueError`` when ``value`` is neither an existing file nor
    template text (text holds ``{{`` or ``{%``)."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as fh:
            return fh.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(
        f"chat template {value!r} is neither a file nor Jinja template text ({{{{ or {{%)"
    )


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of ``messages`` rendered by ``tokenizer``'s chat template (or ``chat_template``,
    Jinja text), ending in the assistant's generation prompt unless told otherwise (see the
    module docstring). Raises ``ValueError`` when there is no template, the options clash, or
    the template rejects the messages.

    transformers may return a plain list, a nested list (batch of one), a tensor, or (since
    v5) a ``BatchEncoding``/dict holding ``input_ids``; all are flattened to ``list[int]``.
    """
    if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise ValueError("this model has no chat template: send a prompt as text or token ids")
    if add_generation_prompt and continue_final_message:
        raise ValueError(
            "continue_final_message and add_generation_prompt cannot both be true (set "
            "add_generation_prompt to false to continue the last message)"
        )
    extra = dict(chat_template_kwargs or {})
    clash = sorted(RESERVED_TEMPLATE_KWARGS.intersection(extra))
    if clash:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)}")
    options: dict[str, Any] = {"add_generation_prompt": add_generation_prompt, "tokenize": True}
    if continue_final_message:
        options["continue_final_message"] = True
    if chat_template:
        options["chat_template"] = chat_template
    try:
        out: Any = tokenizer.apply_chat_template(messages, **options, **extra)
    except Exception as exc:  # a template error is the caller's messages' fault
        raise ValueError(f"cannot apply the chat template: {exc}") from exc
    if isinstance(out, Mapping) or (hasattr(out, "keys") and hasattr(out, "__getitem__")):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list | tuple):
        out = out[0]
    return [int(t) for t in out]
