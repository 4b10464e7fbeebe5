"""Sampling parameters (vLLM's names), validated; :mod:`radixkv.engine.sampler` applies them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixkv.engine.errors import ParamError
from radixkv.engine.logits_fields import check_logits_fields
from radixkv.engine.structured import StructuredOutputs

__all__ = ["SamplingParams"]

MAX_LOGPROBS = 20
#: Bounds on stop conditions (each output token is checked against every one of them); OpenAI's
#: API takes at most 4 stop strings.
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """Per-request sampling settings (vLLM's names; ``temperature == 0`` is greedy).

    ``logprobs=K`` reports each generated token's logprob and its K most likely alternatives;
    ``prompt_logprobs=K`` the same for every prompt token (such a request computes its whole
    prompt: it does not read the prefix cache). Logprobs are ``log_softmax`` of the raw logits.
    ``use_beam_search=True`` runs beam search with ``best_of`` (or ``n``) beams and returns the
    ``n`` best finished beams, ranked by ``sum(logprobs) / generated_len ** length_penalty``
    (transformers' scorer; ``early_stopping`` True / False / "never" as transformers has it).
    Beam search is deterministic: ``temperature`` and ``seed`` are ignored.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    #: keep the stop string that ended the text in it (vLLM's name)
    include_stop_str_in_output: bool = False
    #: leave special tokens (e.g. ``<|im_end|>``) out of the text
    skip_special_tokens: bool = True
    #: constrain the output to a JSON schema, regex, choice or grammar (not with beam search)
    structured_outputs: StructuredOutputs | None = None
    #: token id -> bias added to its logit before sampling, in [-100, 100] (OpenAI's)
    logit_bias: dict[int, float] | None = None
    #: EOS and ``stop_token_ids`` are masked, and stop strings not honoured, until this many
    #: tokens are generated (vLLM's)
    min_tokens: int = 0

    def validate(self) -> SamplingParams:
        """Raise :class:`~radixkv.engine.errors.ParamError` (a ``ValueError``) naming the first
        bad field; returns ``self`` when valid."""

        def bad(name: str, why: str) -> ParamError:
            return ParamError(name, f"invalid {name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise bad("max_tokens", "must be an integer >= 1")
        if self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "must be in [0, 100] (0 is greedy)")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            raise bad("top_k", "must be an integer: -1 (disabled) or >= 1")
        if self.top_k == 0 or self.top_k < -1:
            raise bad("top_k", "must be -1 (disabled) or >= 1")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", "must be in (0, 10] (1 disables it)")
        if not _is_number(self.frequency_penalty) or not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not _is_number(self.presence_penalty) or not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool)
        ):
            raise bad("seed", "must be an integer or None")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int)
            or isinstance(self.logprobs, bool)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad("logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int)
            or isinstance(self.prompt_logprobs, bool)
            or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise bad("prompt_logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
                raise bad("stop", "must be a non-empty string or a list of non-empty strings")
            if len(stops) > MAX_STOP_STRINGS or max(map(len, stops)) > MAX_STOP_CHARS:
                raise bad(
                    "stop",
                    f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters"
                    " (every output token is checked against each)",
                )
        if self.stop_token_ids is not None and not (
            isinstance(self.stop_token_ids, list)
            and all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids)
        ):
            raise bad("stop_token_ids", "must be a list of token ids (integers >= 0)")
        if self.stop_token_ids is not None and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids")
        for flag in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, flag), bool):
                raise bad(flag, "must be true or false")
        check_logits_fields(self)
        self._validate_beam_search(bad)
        if self.structured_outputs is not None:
            _validate_structured(self)
        return self

    def _validate_beam_search(self, bad: Any) -> None:
        if not isinstance(self.use_beam_search, bool):
            raise bad("use_beam_search", "must be true or false")
        if self.best_of is not None:
            if not isinstance(self.best_of, int) or isinstance(self.best_of, bool):
                raise bad("best_of", "must be None or an integer >= n")
            if self.best_of < self.n:
                raise bad("best_of", f"must be >= n ({self.n})")
            if self.best_of != self.n and not self.use_beam_search:
                raise bad("best_of", "best_of > n is supported with use_beam_search only")
        if not _is_number(self.length_penalty) or abs(self.length_penalty) > 1e6:
            raise bad("length_penalty", "must be a finite number")
        if self.early_stopping not in (True, False, "never") or (
            isinstance(self.early_stopping, int) and not isinstance(self.early_stopping, bool)
        ):
            raise bad("early_stopping", 'must be true, false or "never"')
        if not self.use_beam_search:
            return
        # Beam search ranks by the raw logprobs (transformers' do_sample=False): knobs that
        # would reshape the distribution are refused rather than silently ignored.
        if self.top_p != 1.0:
            raise bad("top_p", "must be 1 with use_beam_search")
        if self.top_k != -1:
            raise bad("top_k", "must be -1 with use_beam_search")
        if self.min_p != 0.0:
            raise bad("min_p", "must be 0 with use_beam_search")
        for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"):
            if getattr(self, name) != (1.0 if name == "repetition_penalty" else 0.0):
                raise bad(name, "penalties are not supported with use_beam_search")
        if self.stop_list:
            raise bad(
                "stop", "stop strings are not supported with use_beam_search (use stop_token_ids)"
            )
        if self.logit_bias or self.min_tokens:
            name = "logit_bias" if self.logit_bias else "min_tokens"
            raise bad(name, "is not supported with use_beam_search")

    @property
    def beam_width(self) -> int:
        """Beams kept by beam search: ``best_of`` (vLLM) or ``n``."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def is_greedy(self) -> bool:
        """``temperature`` below 1e-5 (vLLM's epsilon): dividing by it would overflow."""
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty is active (needs the token history)."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @property
    def stop_list(self) -> list[str]:
        """``stop`` as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def _validate_structured(params: SamplingParams) -> None:
    if not isinstance(params.structured_outputs, StructuredOutputs):
        raise ValueError("structured_outputs must be a StructuredOutputs or None")
    params.structured_outputs.validate()
    if params.use_beam_search:
        raise ValueError("structured outputs are not supported with use_beam_search")
    if params.min_tokens:
        # a finished grammar allows only its stop token, which min_tokens masks: no token is left
        raise ValueError(
            "min_tokens is not supported with structured_outputs (the grammar decides where the "
            "output ends); drop min_tokens"
        )


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # not NaN
