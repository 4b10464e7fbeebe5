"""The request fields of the logits processors (``logit_bias``, ``min_tokens``): their bounds and
checks, without torch, so the server's request models can import them (``radixkv simulate`` and
the request models never load torch). The processors themselves are
:mod:`radixkv.engine.logits_processors`."""

from __future__ import annotations

import math
from typing import Protocol

from radixkv.engine.errors import ParamError

__all__ = [
    "MAX_LOGIT_BIAS",
    "MAX_LOGIT_BIAS_ENTRIES",
    "LogitsFields",
    "check_logits_fields",
    "check_token_ids",
    "uses_logits_processors",
]

#: ``logit_bias`` values lie in ``[-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]`` (OpenAI's range).
MAX_LOGIT_BIAS = 100.0
#: Largest ``logit_bias`` map accepted: a bound on one request's work per step.
MAX_LOGIT_BIAS_ENTRIES = 1024


class LogitsFields(Protocol):
    """The fields of :class:`~radixkv.engine.sampling.SamplingParams` read here."""

    logit_bias: dict[int, float] | None
    min_tokens: int
    max_tokens: int
    ignore_eos: bool
    stop_token_ids: list[int] | None


def check_logits_fields(params: LogitsFields) -> None:
    """Raise :class:`~radixkv.engine.errors.ParamError` naming ``logit_bias`` or ``min_tokens``
    when one is malformed (the vocabulary bound is :func:`check_token_ids`, which needs the
    model)."""
    bias = params.logit_bias
    if bias is not None:
        if not isinstance(bias, dict):
            raise ParamError(
                "logit_bias", f"invalid logit_bias={bias!r}: must be a dict token id -> bias"
            )
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ParamError(
                "logit_bias", f"invalid logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries"
            )
        for token, value in bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise ParamError(
                    "logit_bias",
                    f"invalid logit_bias: key {token!r} is not a token id (an integer >= 0)",
                )
            if (
                not isinstance(value, int | float)
                or isinstance(value, bool)
                or not math.isfinite(value)
                or abs(value) > MAX_LOGIT_BIAS
            ):
                raise ParamError(
                    "logit_bias",
                    f"invalid logit_bias: the bias of token {token} is {value!r}; it must be a "
                    f"number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
                )
    m = params.min_tokens
    if not isinstance(m, int) or isinstance(m, bool) or m < 0:
        raise ParamError("min_tokens", f"invalid min_tokens={m!r}: must be an integer >= 0")
    if isinstance(params.max_tokens, int) and m > params.max_tokens:
        raise ParamError(
            "min_tokens", f"invalid min_tokens={m}: must be <= max_tokens ({params.max_tokens})"
        )


def check_token_ids(params: LogitsFields, vocab_size: int) -> None:
    """Raise :class:`~radixkv.engine.errors.ParamError` naming ``logit_bias`` when a key is not a
    token of the model."""
    bad = [t for t in params.logit_bias or () if not 0 <= t < vocab_size]
    if bad:
        raise ParamError(
            "logit_bias", f"invalid logit_bias: token id {bad[0]} is out of range [0, {vocab_size})"
        )


def uses_logits_processors(params: LogitsFields) -> bool:
    """Whether ``params`` asks for a logit bias or a minimum length."""
    return bool(params.logit_bias) or params.min_tokens > 0
