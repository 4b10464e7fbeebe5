"""Token logprobs in vLLM's shape: per position, ``{token_id: Logprob}``.

Every logprob here is ``log_softmax`` of the model's *raw* float32 logits — before penalties,
temperature and top-k/top-p filtering (vLLM's default ``raw_logprobs``), so it is the model's own
distribution whatever sampling settings a request uses. The one exception, as in vLLM: a
structured-output request's grammar mask is applied first (disallowed tokens are -inf, reported
as ``MIN_LOGPROB``), so its logprobs are over the tokens its grammar allows.

Shapes (vLLM's ``SampleLogprobs`` / ``PromptLogprobs``):

* a generated token has one dict: with ``logprobs=K``, the K most likely tokens, then the sampled
  token when it is not among them (K or K + 1 entries, in that order: most likely first);
* a prompt of ``L`` tokens has ``L`` entries, the first ``None`` (nothing predicts it); entry
  ``i`` is the dict of prompt token ``i`` given tokens ``[0, i)``: the top-K, then the prompt
  token when it is not among them.

:class:`~radixkv.engine.request.Logprob` says what its ``rank`` and ``decoded_token`` are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from radixkv.engine.request import Logprob, PositionLogprobs

__all__ = [
    "Logprob",
    "PositionLogprobs",
    "TokenTexts",
    "chosen_and_top",
    "collect_prompt_logprobs",
]

TopList = list[tuple[int, float]]
#: Floor of a reported alternative's logprob (vLLM's): a token a grammar masked is -inf, which
#: JSON cannot carry.
MIN_LOGPROB = -9999.0


def chosen_and_top(
    logits: torch.Tensor, chosen: Sequence[int], num_top: Sequence[int]
) -> tuple[list[float], list[int], list[TopList]]:
    """Chosen-token logprobs, their ranks and the top-``num_top[i]`` ``(token_id, logprob)``
    lists per row (descending).

    ``logits`` is ``[B, vocab]`` raw logits (any float dtype; computed in float32). A chosen
    token's rank is 1 + the number of its row's logprobs strictly greater than its own.
    """
    if logits.shape[0] != len(chosen) or len(chosen) != len(num_top):
        raise ValueError(f"{logits.shape[0]} rows, {len(chosen)} tokens, {len(num_top)} counts")
    if not chosen:
        return [], [], []
    lp = torch.log_softmax(logits.float(), dim=-1)
    idx = torch.as_tensor(list(chosen), dtype=torch.long, device=lp.device)
    picked = lp.gather(1, idx.unsqueeze(1))
    ranks = ((lp > picked).sum(-1) + 1).tolist()
    kmax = max(num_top)
    tops: list[TopList] = [[] for _ in chosen]
    if kmax > 0:
        vals, ids = lp.topk(min(kmax, lp.shape[-1]), dim=-1)
        vals = vals.clamp_min(MIN_LOGPROB)  # a grammar-masked alternative is -inf
        vals_l, ids_l = vals.tolist(), ids.tolist()
        for i, k in enumerate(num_top):
            tops[i] = list(zip(ids_l[i][:k], vals_l[i][:k]))
    return [float(v) for v in picked.squeeze(1).tolist()], ranks, tops


def collect_prompt_logprobs(
    logits: torch.Tensor, entries: Sequence[tuple[Any, int]], texts: TokenTexts
) -> torch.Tensor:
    """Note prompt logprobs from one step's all-token ``logits`` (``[T, vocab]``).

    ``entries`` are the step's ``(sequence, new tokens)`` pairs in batch order, taken before
    ``num_computed`` advances. A sequence with ``skip_cache_read`` (its prompt logprobs asked)
    gets ``prompt_logprobs[j + 1]`` (its dict, ``texts`` decoding) from the row of each
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
            vals, ranks, tops = chosen_and_top(rows, targets, [k] * len(targets))
            seq.prompt_logprobs[start + 1 : end + 1] = [
                texts.logprobs(*row) for row in zip(targets, vals, ranks, tops)
            ]
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

    def logprobs(
        self, token_id: int, logprob: float | None, rank: int | None, top: TopList | None
    ) -> PositionLogprobs | None:
        """One position's dict: the ``top`` ``(id, logprob)`` pairs (descending) ranked by
        their logprobs, then ``token_id`` (the sampled or prompt token, its ``logprob`` and
        ``rank``) when it is not among them. None when ``logprob`` is (none asked)."""
        if logprob is None:
            return None
        out: PositionLogprobs = {}
        top_rank, prev = 0, None
        for j, (t, lp) in enumerate(top or ()):
            if lp != prev:  # 1 + the number strictly greater: ties share a rank
                top_rank, prev = j + 1, lp
            out[t] = Logprob(lp, top_rank, self(t))
        if token_id not in out:
            out[token_id] = Logprob(logprob, rank, self(token_id))
        return out
