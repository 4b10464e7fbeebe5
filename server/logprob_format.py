"""Logprobs in each API's JSON shape, from the engine's vLLM-shaped logprobs.

The engine gives, per generated token, one ``{token_id: Logprob}`` dict (``logprob``, ``rank``,
``decoded_token``): the request's K most likely tokens, most likely first, then the token itself
when it is not among them (``radixkv/engine/logprobs.py``); per prompt token the same, ``None``
at position 0. So a position's top-K are its first K entries and a token's own logprob is its
entry. These functions only reshape them:

* OpenAI completions: ``{"tokens", "token_logprobs", "top_logprobs": [{text: logprob}],
  "text_offset"}``;
* OpenAI chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``;
* vLLM ``prompt_logprobs``: ``[None, {"<id>": {"logprob", "rank", "decoded_token"}}, ...]``;
* SGLang ``meta_info``: ``[logprob, token_id, text or None]`` triples.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from itertools import islice
from typing import Any

TokenStr = Callable[[int], str]
#: One position: token id -> an object with ``logprob`` and ``decoded_token`` (``Logprob``).
Entry = Mapping[int, Any]


def top_k(entry: Entry | None, k: int) -> list[tuple[int, Any]]:
    """The ``k`` most likely ``(token_id, Logprob)`` of a position (its first ``k`` entries)."""
    return list(islice(entry.items(), k)) if entry else []


def own_logprob(token_id: int, entry: Entry | None) -> float | None:
    """``token_id``'s logprob at its position (None where the position has no dict)."""
    own = entry.get(token_id) if entry else None
    return None if own is None else float(own.logprob)


def _text(token_id: int, lp: Any, token_str: TokenStr) -> str:
    text = getattr(lp, "decoded_token", None)
    return text if text is not None else token_str(int(token_id))


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[Entry | None],
    k: int,
    token_str: TokenStr,
    offset: int,
) -> dict[str, Any]:
    """OpenAI ``/v1/completions`` ``choices[i].logprobs`` (``offset``: text already sent)."""
    tokens = [token_str(t) for t in token_ids]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    padded = [entries[i] if i < len(entries) else None for i in range(len(tokens))]
    return {
        "tokens": tokens,
        "token_logprobs": [own_logprob(t, e) for t, e in zip(token_ids, padded)],
        "top_logprobs": [
            None
            if e is None  # a position without logprobs (an echoed prompt's first token)
            else {_text(t, lp, token_str): float(lp.logprob) for t, lp in top_k(e, k)}
            for e in padded
        ],
        "text_offset": offsets,
    }


def chat_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[Entry | None],
    k: int,
    token_str: TokenStr,
) -> dict[str, Any]:
    """OpenAI chat ``choices[i].logprobs``: one entry per token with its ``top_logprobs``."""
    content = []
    for tid, entry in zip(token_ids, entries):
        tok = token_str(tid)
        content.append(
            {
                "token": tok,
                "logprob": own_logprob(tid, entry),
                "bytes": list(tok.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": (text := _text(t, lp, token_str)),
                        "logprob": float(lp.logprob),
                        "bytes": list(text.encode("utf-8")),
                    }
                    for t, lp in top_k(entry, k)
                ],
            }
        )
    return {"content": content}


def vllm_prompt_logprobs(
    prompt_ids: Sequence[int],
    entries: Sequence[Entry | None] | None,
    k: int,
    token_str: TokenStr,
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs``: per position, the prompt token and the top-K by token id
    (``rank`` 1 is the most likely; the prompt token's rank is given when it is in the top-K)."""
    if entries is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for tid, entry in zip(prompt_ids, entries):
        if entry is None:
            out.append(None)
            continue
        top = top_k(entry, k)
        ranks = {int(t): r for r, (t, _) in enumerate(top, start=1)}
        lp = own_logprob(tid, entry)
        item = {str(tid): {"logprob": lp, "rank": ranks.get(tid), "decoded_token": token_str(tid)}}
        for r, (t, top_lp) in enumerate(top, start=1):
            item.setdefault(
                str(t),
                {
                    "logprob": float(top_lp.logprob),
                    "rank": r,
                    "decoded_token": _text(t, top_lp, token_str),
                },
            )
        out.append(item)
    return out


def sglang_token_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[Entry | None],
    token_str: TokenStr,
    with_text: bool,
) -> list[list[Any]]:
    """SGLang's ``[logprob, token_id, text or None]`` per token."""
    return [
        [own_logprob(t, e), int(t), token_str(t) if with_text else None]
        for t, e in zip(token_ids, entries)
    ]


def sglang_top_logprobs(
    entries: Sequence[Entry | None], k: int, token_str: TokenStr, with_text: bool
) -> list[list[list[Any]] | None]:
    """SGLang's ``output_top_logprobs`` / ``input_top_logprobs``: a list of triples per token."""
    return [
        None
        if entry is None
        else [
            [float(lp.logprob), int(t), _text(t, lp, token_str) if with_text else None]
            for t, lp in top_k(entry, k)
        ]
        for entry in entries
    ]
