"""Token logprobs: the chosen token's and the top-K alternatives, for outputs and prompts.

Every logprob here is ``log_softmax`` of the model's *raw* float32 logits — before penalties,
temperature and top-k/top-p filtering (vLLM's default ``raw_logprobs``), so it is the model's own
distribution whatever sampling settings a request uses. The one exception, as in vLLM: a
structured-output request's grammar mask is applied first (disallowed tokens are -inf, reported
as ``MIN_LOGPROB``), so its logprobs are over the tokens its grammar allows.

Shapes:

* a generated token has its chosen logprob (``float``) and, with ``logprobs=K``, a list of the
  K most likely tokens as :class:`Logprob` (descending; the chosen token is listed there only if
  it is among the K);
* a prompt of ``L`` tokens has ``L`` entries, the first ``None`` (nothing predicts it); entry
  ``i`` is the logprob of prompt token ``i`` given tokens ``[0, i)`` and its top-K alternatives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Logprob", "TokenTexts", "chosen_and_top", "collect_prompt_logprobs"]


@dataclass(frozen=True)
class Logprob:
    """One candidate token at one position (vLLM's ``Logprob`` fields plus the token id)."""

    token_id: int
    logprob: float
    decoded_token: str | None = None


TopList = list[tuple[int, float]]
#: Floor of a reported alternative's logprob (vLLM's): a token a grammar masked is -inf, which
#: JSON cannot carry.
MIN_LOGPROB = -9999.0


def chosen_and_top(
    logits: torch.Tensor, chosen: Sequence[int], num_top: Sequence[int]
) -> tuple[list[float], list[TopList]]:
    """Chosen-token logprobs and top-``num_top[i]`` ``(token_id, logprob)`` lists per row.

    ``logits`` is ``[B, vocab]`` raw logits (any float dtype; computed in float32).
    """
    if logits.shape[0] != len(chosen) or len(chosen) != len(num_top):
        raise ValueError(f"{logits.shape[0]} rows, {len(chosen)} tokens, {len(num_top)} counts")
    if not chosen:
        return [], []
    lp = torch.log_softmax(logits.float(), dim=-1)
    idx = torch.as_tensor(list(chosen), dtype=torch.long, device=lp.device)
    picked = lp.gather(1, idx.unsqueeze(1)).squeeze(1).tolist()
    kmax = max(num_top)
    tops: list[TopList] = [[] for _ in chosen]
    if kmax > 0:
        vals, ids = lp.topk(min(kmax, lp.shape[-1]), dim=-1)
        vals = vals.clamp_min(MIN_LOGPROB)  # a grammar-masked alternative is -inf
        vals_l, ids_l = vals.tolist(), ids.tolist()
        for i, k in enumerate(num_top):
            tops[i] = list(zip(ids_l[i][:k], vals_l[i][:k]))
    return [float(v) for v in picked], tops


def collect_prompt_logprobs(
    logits: torch.Tensor, entries: Sequence[tuple[Any, int]]
) -> torch.Tensor:
    """Note prompt logprobs from one step's all-token ``logits`` (``[T, vocab]``).

    ``entries`` are the step's ``(sequence, new tokens)`` pairs in batch order, taken before
    ``num_computed`` advances. A sequence with ``skip_cache_read`` (its prompt logprobs asked)
    gets ``prompt_logprobs[j + 1]`` / ``prompt_top_logprobs[j + 1]`` from the row of each
    position ``j`` it computed, and loses ``skip_cache_read`` once its whole prompt is noted.
    Returns each entry's last row (``[len(entries), vocab]``), what sampling needs.
    """
    last: list[int] = []
    offset = 0
    for seq, n in entries:
        start, end = seq.num_computed, min(seq.num_computed + n, len(seq.prompt_ids) - 1)
        if seq.skip_cache_read and seq.prompt_logprobs is not None and end > start:
            # the row of position j predicts prompt token j + 1
            targets = seq.prompt_ids[start + 1 : end + 1]
            k = seq.params.prompt_logprobs or 0
            rows = logits[offset : offset + (end - start)]
            vals, tops = chosen_and_top(rows, targets, [k] * len(targets))
            seq.prompt_logprobs[start + 1 : end + 1] = vals
            seq.prompt_top_logprobs[start + 1 : end + 1] = tops
        if seq.num_computed + n >= len(seq.prompt_ids):
            seq.skip_cache_read = False  # every prompt position is noted
        offset += n
        last.append(offset - 1)
    return logits.index_select(0, torch.tensor(last, dtype=torch.long, device=logits.device))


class TokenTexts:
    """Decoded text of single token ids, cached (a vocabulary's worth at most)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._cache.get(token_id)
        if text is None:
            text = str(self.tokenizer.decode([token_id], skip_special_tokens=False))
            self._cache[token_id] = text
        return text

    def logprobs(self, top: TopList | None) -> list[Logprob] | None:
        """``(id, logprob)`` pairs as :class:`Logprob` with their decoded text."""
        if top is None:
            return None
        return [Logprob(t, lp, self(t)) for t, lp in top]
