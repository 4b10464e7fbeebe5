"""Per-request logits processors: ``logit_bias`` (OpenAI's) and ``min_tokens`` (vLLM's).

:func:`apply_logits_processors` runs first in the batched sampler, before penalties, greedy
argmax, temperature and the filters (vLLM's order). It works on the whole batch at once:

* ``logit_bias``: one scatter-add (``index_put_`` with ``accumulate``) of every biased
  ``(row, token)`` of every row that has a bias;
* ``min_tokens``: one masked fill with ``-inf`` of every ``(row, stop token)`` of the rows that
  have generated fewer than ``min_tokens`` tokens. The stop tokens are the model's EOS ids
  (unless ``ignore_eos``) and the row's ``stop_token_ids``, as vLLM masks them.

Rows that use neither are left as they are, and when no row uses either the logits come back
untouched (no copy, no tensor op). Stop strings are held off by the detokenizer
(:class:`radixkv.engine.detokenizer.IncrementalDetokenizer`, ``min_tokens``).

The logprobs a request asks for are taken from the raw logits, before these processors (as
vLLM's default ``raw_logprobs``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, Protocol

import torch

__all__ = ["apply_logits_processors"]

_CACHE = "_logit_bias_tensors"


class RowState(Protocol):
    """One batch row: its params and the tokens it generated so far."""

    params: Any
    output_ids: Sequence[int]


def _bias_tensors(params: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token ids, biases)`` of ``params.logit_bias``, built once per params object (and
    again only if ``logit_bias`` is replaced)."""
    bias = params.logit_bias
    cached = params.__dict__.get(_CACHE)
    if cached is None or cached[0] is not bias:
        ids = torch.tensor(list(bias.keys()), dtype=torch.long)
        vals = torch.tensor([float(v) for v in bias.values()], dtype=torch.float32)
        cached = (bias, ids, vals)
        params.__dict__[_CACHE] = cached
    return cached[1], cached[2]


def apply_logits_processors(
    logits: torch.Tensor, rows: Sequence[RowState], eos_token_ids: Collection[int]
) -> torch.Tensor:
    """``logits [B, vocab]`` with every row's ``logit_bias`` added and, for the rows short of
    their ``min_tokens``, the stop tokens set to ``-inf``; a new tensor when any row has either,
    ``logits`` itself otherwise (see the module docstring)."""
    biased: list[int] = []
    short: list[int] = []
    for i, row in enumerate(rows):
        p = row.params
        if p.logit_bias:
            biased.append(i)
        if p.min_tokens and len(row.output_ids) < p.min_tokens:
            short.append(i)
    if not biased and not short:
        return logits
    logits = logits.clone()
    dev, vocab = logits.device, logits.shape[-1]
    if biased:
        pairs = [_bias_tensors(rows[i].params) for i in biased]
        counts = torch.tensor([len(ids) for ids, _ in pairs])
        r_idx = torch.tensor(biased).repeat_interleave(counts)
        t_idx = torch.cat([ids for ids, _ in pairs])
        vals = torch.cat([v for _, v in pairs]).to(logits.dtype)
        logits.index_put_((r_idx.to(dev), t_idx.to(dev)), vals.to(dev), accumulate=True)
    if short:
        r_list: list[int] = []
        t_list: list[int] = []
        for i in short:
            p = rows[i].params
            stops = set(p.stop_token_ids or ())
            if not p.ignore_eos:
                stops.update(eos_token_ids)
            ids = [t for t in stops if 0 <= t < vocab]
            r_list.extend([i] * len(ids))
            t_list.extend(ids)
        if t_list:
            index = (torch.tensor(r_list, device=dev), torch.tensor(t_list, device=dev))
            logits.index_put_(index, torch.tensor(float("-inf"), dtype=logits.dtype, device=dev))
    return logits
