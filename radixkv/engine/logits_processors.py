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

import math
from collections.abc import Collection, Sequence
from typing import Any, Protocol

import torch

__all__ = [
    "MAX_LOGIT_BIAS",
    "MAX_LOGIT_BIAS_ENTRIES",
    "apply_logits_processors",
    "check_logits_fields",
    "check_token_ids",
    "uses_logits_processors",
]

#: ``logit_bias`` values lie in ``[-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]`` (OpenAI's range).
MAX_LOGIT_BIAS = 100.0
#: Largest ``logit_bias`` map accepted: a bound on one request's work per step.
MAX_LOGIT_BIAS_ENTRIES = 1024
_CACHE = "_logit_bias_tensors"


class LogitsFields(Protocol):
    """The fields of :class:`~radixkv.engine.sampling.SamplingParams` read here."""

    logit_bias: dict[int, float] | None
    min_tokens: int
    max_tokens: int
    ignore_eos: bool
    stop_token_ids: list[int] | None


class RowState(Protocol):
    """One batch row: its params and the tokens it generated so far."""

    params: Any
    output_ids: Sequence[int]


def check_logits_fields(params: LogitsFields) -> None:
    """Raise ``ValueError`` naming ``logit_bias`` or ``min_tokens`` when one is malformed (the
    vocabulary bound is :func:`check_token_ids`, which needs the model)."""
    bias = params.logit_bias
    if bias is not None:
        if not isinstance(bias, dict):
            raise ValueError(f"invalid logit_bias={bias!r}: must be a dict token id -> bias")
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"invalid logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries")
        for token, value in bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise ValueError(
                    f"invalid logit_bias: key {token!r} is not a token id (an integer >= 0)"
                )
            if (
                not isinstance(value, int | float)
                or isinstance(value, bool)
                or not math.isfinite(value)
                or abs(value) > MAX_LOGIT_BIAS
            ):
                raise ValueError(
                    f"invalid logit_bias: the bias of token {token} is {value!r}; it must be a "
                    f"number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
                )
    m = params.min_tokens
    if not isinstance(m, int) or isinstance(m, bool) or m < 0:
        raise ValueError(f"invalid min_tokens={m!r}: must be an integer >= 0")
    if isinstance(params.max_tokens, int) and m > params.max_tokens:
        raise ValueError(f"invalid min_tokens={m}: must be <= max_tokens ({params.max_tokens})")


def check_token_ids(params: LogitsFields, vocab_size: int) -> None:
    """Raise ``ValueError`` naming ``logit_bias`` when a key is not a token of the model."""
    bad = [t for t in params.logit_bias or () if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"invalid logit_bias: token id {bad[0]} is out of range [0, {vocab_size})")


def uses_logits_processors(params: LogitsFields) -> bool:
    """Whether ``params`` asks for a logit bias or a minimum length."""
    return bool(params.logit_bias) or params.min_tokens > 0


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
