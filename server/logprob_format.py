"""Logprobs in each API's JSON shape, from the engine's chosen logprobs and top-K lists.

The engine gives, per generated token, its logprob (``float``) and, when asked, its K most
likely alternatives (objects with ``token_id``, ``logprob``, ``decoded_token``); per prompt token
the same, ``None`` at position 0. These functions only reshape them:

* OpenAI completions: ``{"tokens", "token_logprobs", "top_logprobs": [{text: logprob}],
  "text_offset"}``;
* OpenAI chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``;
* vLLM ``prompt_logprobs``: ``[None, {"<id>": {"logprob", "rank", "decoded_token"}}, ...]``;
* SGLang ``meta_info``: ``[logprob, token_id, text or None]`` triples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

TokenStr = Callable[[int], str]


def _text(entry: Any, token_str: TokenStr) -> str:
    text = getattr(entry, "decoded_token", None)
    return text if text is not None else token_str(int(entry.token_id))


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[float | None],
    tops: Sequence[Sequence[Any]] | None,
    token_str: TokenStr,
    offset: int,
) -> dict[str, Any]:
    """OpenAI ``/v1/completions`` ``choices[i].logprobs`` (``offset``: text already sent)."""
    tokens = [token_str(t) for t in token_ids]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    lps = list(logprobs) + [None] * (len(tokens) - len(logprobs))
    top_dicts: list[dict[str, float]] = []
    for i in range(len(tokens)):
        top = tops[i] if tops is not None and i < len(tops) else []
        top_dicts.append({_text(t, token_str): float(t.logprob) for t in top})
    return {
        "tokens": tokens,
        "token_logprobs": lps[: len(tokens)],
        "top_logprobs": top_dicts,
        "text_offset": offsets,
    }


def chat_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[float | None],
    tops: Sequence[Sequence[Any]] | None,
    token_str: TokenStr,
) -> dict[str, Any]:
    """OpenAI chat ``choices[i].logprobs``: one entry per token with its ``top_logprobs``."""
    content = []
    for i, (tid, lp) in enumerate(zip(token_ids, logprobs)):
        tok = token_str(tid)
        top = tops[i] if tops is not None and i < len(tops) else []
        content.append(
            {
                "token": tok,
                "logprob": lp,
                "bytes": list(tok.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": (text := _text(t, token_str)),
                        "logprob": float(t.logprob),
                        "bytes": list(text.encode("utf-8")),
                    }
                    for t in top
                ],
            }
        )
    return {"content": content}


def vllm_prompt_logprobs(
    prompt_ids: Sequence[int],
    logprobs: Sequence[float | None] | None,
    tops: Sequence[Sequence[Any] | None] | None,
    token_str: TokenStr,
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs``: per position, the prompt token and the top-K by token id
    (``rank`` 1 is the most likely; the prompt token's rank is given when it is in the top-K)."""
    if logprobs is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for i, (tid, lp) in enumerate(zip(prompt_ids, logprobs)):
        if lp is None:
            out.append(None)
            continue
        top = list(tops[i] or []) if tops is not None else []
        entry: dict[str, dict[str, Any]] = {}
        ranks = {int(t.token_id): r for r, t in enumerate(top, start=1)}
        entry[str(tid)] = {"logprob": lp, "rank": ranks.get(tid), "decoded_token": token_str(tid)}
        for r, t in enumerate(top, start=1):
            entry.setdefault(
                str(t.token_id),
                {"logprob": float(t.logprob), "rank": r, "decoded_token": _text(t, token_str)},
            )
        out.append(entry)
    return out


def sglang_token_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[float | None],
    token_str: TokenStr,
    with_text: bool,
) -> list[list[Any]]:
    """SGLang's ``[logprob, token_id, text or None]`` per token."""
    return [[lp, int(t), token_str(t) if with_text else None] for t, lp in zip(token_ids, logprobs)]


def sglang_top_logprobs(
    tops: Sequence[Sequence[Any] | None], token_str: TokenStr, with_text: bool
) -> list[list[list[Any]] | None]:
    """SGLang's ``output_top_logprobs`` / ``input_top_logprobs``: a list of triples per token."""
    return [
        None
        if top is None
        else [
            [float(t.logprob), int(t.token_id), _text(t, token_str) if with_text else None]
            for t in top
        ]
        for top in tops
    ]
