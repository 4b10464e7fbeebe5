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
from collections.abc import Hashable, Mapping
from typing import Any

from radixkv.engine.template_sandbox import TemplateBusyError

__all__ = [
    "RESERVED_TEMPLATE_KWARGS",
    "encode_rendered",
    "load_chat_template",
    "render_chat",
    "render_chat_text",
]

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


def render_chat_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    sandbox: Any = None,
    sandbox_key: Hashable = None,
) -> str:
    """The text of ``messages`` rendered by ``tokenizer``'s chat template (or ``chat_template``,
    Jinja text), as transformers' ``apply_chat_template(..., tokenize=False)`` renders it, ending
    in the assistant's generation prompt unless told otherwise (see the module docstring);
    ``tools`` (OpenAI's ``tools``, JSON schemas) are the template's ``tools``.

    It reads only the tokenizer's Python attributes (its template, its special tokens), never its
    Rust backend, so it takes no tokenizer lock: the engine thread decodes while a conversation
    renders. With ``sandbox`` (a :class:`~radixkv.engine.template_sandbox.TemplateSandbox`), the
    template renders there, bounded in time and memory, one of ``sandbox_key``'s renders (for a
    template the request brought); else in this thread.

    Raises ``ValueError`` when there is no template, the options clash, or the template rejects
    the messages (:class:`~radixkv.engine.template_sandbox.TemplateLimitError` when it passed a
    sandbox bound); :class:`~radixkv.engine.template_sandbox.TemplateBusyError` when the sandbox
    has no slot for ``sandbox_key``."""
    inner = getattr(tokenizer, "wrapped", tokenizer)  # a LockedTokenizer's tokenizer
    if inner is None or not (chat_template or getattr(inner, "chat_template", None)):
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
    # a transformers tokenizer (else one of its own kind, with an apply_chat_template)
    hf = hasattr(inner, "get_chat_template") and hasattr(inner, "special_tokens_map")
    try:
        template = inner.get_chat_template(chat_template, tools) if hf else chat_template
        # kwargs overwrite special tokens if both are present (as apply_chat_template does)
        template_kwargs = {**inner.special_tokens_map, **extra} if hf else extra
        if sandbox is not None:
            return str(
                sandbox.render(
                    chat_template=template,
                    messages=messages,
                    template_kwargs=template_kwargs,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    tools=tools,
                    key=sandbox_key,
                )
            )
        if not hf:
            options: dict[str, Any] = {"add_generation_prompt": add_generation_prompt}
            if continue_final_message:
                options["continue_final_message"] = True
            if chat_template:
                options["chat_template"] = chat_template
            if tools:
                options["tools"] = tools
            return str(inner.apply_chat_template(messages, tokenize=False, **options, **extra))
        from transformers.utils.chat_template_utils import (
            _normalize_chat_messages,
            render_jinja_template,
        )

        rendered, _ = render_jinja_template(
            conversations=[_normalize_chat_messages(messages)],
            tools=tools,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **template_kwargs,
        )
    except (ValueError, TemplateBusyError):
        raise
    except Exception as exc:  # a template error is the caller's messages' fault
        raise ValueError(f"cannot apply the chat template: {exc}") from exc
    return str(rendered[0])


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], **options: Any) -> list[int]:
    """Token ids of ``messages`` rendered by ``tokenizer``'s chat template: the text of
    :func:`render_chat_text` (``options`` are its keywords) encoded without added special tokens
    (the template writes them), which is what transformers' ``apply_chat_template(...,
    tokenize=True)`` returns. Raises as :func:`render_chat_text` does."""
    return encode_rendered(tokenizer, render_chat_text(tokenizer, messages, **options))


def encode_rendered(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a rendered conversation: ``encode(text, add_special_tokens=False)``."""
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
