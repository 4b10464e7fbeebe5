"""The one chat template path: a conversation rendered by the model's tokenizer into token ids.

Used by :meth:`radixkv.engine.engine.Engine.apply_chat_template` and by the HTTP chat route
(``radixkv.server.intake.apply_chat_template``, which turns the ``ValueError`` into a 400).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["render_chat"]


def render_chat(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of ``messages`` rendered by ``tokenizer``'s chat template, ending in the
    assistant's generation prompt. Raises ``ValueError`` when the model has no template or the
    template rejects the messages.

    transformers may return a plain list, a nested list (batch of one), a tensor, or (since
    v5) a ``BatchEncoding``/dict holding ``input_ids``; all are flattened to ``list[int]``.
    """
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template: send a prompt as text or token ids")
    try:
        out: Any = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
    except Exception as exc:  # a template error is the caller's messages' fault
        raise ValueError(f"cannot apply the chat template: {exc}") from exc
    if isinstance(out, Mapping) or (hasattr(out, "keys") and hasattr(out, "__getitem__")):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list | tuple):
        out = out[0]
    return [int(t) for t in out]
