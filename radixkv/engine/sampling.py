"""Sampling parameters (vLLM's names) and a batched sampler.

:class:`Sampler` turns float32 logits ``[B, vocab]`` into one token per row. Rows whose
parameters are greedy and unpenalised take an argmax fast path (all at once); the rest apply, in
order: repetition / frequency / presence penalties (over each sequence's prompt + output history),
temperature, top-k, top-p, min-p, then draw with the row's ``torch.Generator`` (seeded rows are
reproducible: the same seed gives the same tokens).

Penalty definitions (as in vLLM / the CTRL paper):

* repetition_penalty ``r``: for every token seen in the prompt or output, a positive logit is
  divided by ``r`` and a negative one multiplied by ``r``;
* frequency_penalty ``f``: ``logit -= f * count_in_output``;
* presence_penalty ``p``: ``logit -= p * (count_in_output > 0)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from radixkv.engine.logprobs import chosen_and_top

__all__ = ["SamplingParams", "Sampler", "SamplerOutput", "SequenceState"]

MAX_LOGPROBS = 20
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

    def validate(self) -> SamplingParams:
        """Raise ``ValueError`` naming the first bad field; returns ``self`` when valid."""

        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"invalid {name}={getattr(self, name)!r}: {why}")

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
        if self.stop_token_ids is not None and not (
            isinstance(self.stop_token_ids, list)
            and all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids)
        ):
            raise bad("stop_token_ids", "must be a list of token ids (integers >= 0)")
        self._validate_beam_search(bad)
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


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # not NaN


@dataclass
class SequenceState:
    """What the sampler needs to know about one sequence besides its logits row.

    Attributes:
        params: its sampling parameters.
        prompt_ids: prompt token ids (repetition penalty only).
        output_ids: generated token ids so far (all penalties).
        generator: the sequence's RNG (created from ``params.seed`` by :meth:`Sampler.make_generator`).
    """

    params: SamplingParams
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    generator: torch.Generator | None = None


@dataclass
class SamplerOutput:
    """Sampled tokens (``[B]`` list) and, where asked (``params.logprobs`` set), the chosen
    tokens' logprobs and the top-``logprobs`` ``(token_id, logprob)`` alternatives."""

    token_ids: list[int]
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)


class Sampler:
    """Batched sampler over float32 logits ``[B, vocab]``."""

    @staticmethod
    def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator seeded with ``seed`` (random seed when None)."""
        gen = torch.Generator(device=device)
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(int(seed))
        return gen

    @staticmethod
    def apply_penalties(
        logits: torch.Tensor,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
    ) -> torch.Tensor:
        """Return ``logits [vocab]`` with the repetition/frequency/presence penalties applied."""
        if not params.has_penalties:
            return logits
        logits = logits.clone()
        dev = logits.device
        vocab = logits.shape[-1]
        out = torch.as_tensor(list(output_ids), dtype=torch.long, device=dev)
        if params.repetition_penalty != 1.0:
            seen = torch.cat([torch.as_tensor(list(prompt_ids), dtype=torch.long, device=dev), out])
            if seen.numel():
                seen = seen.unique()
                vals = logits[seen]
                r = params.repetition_penalty
                logits[seen] = torch.where(vals > 0, vals / r, vals * r)
        if out.numel() and (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0):
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
            logits -= params.frequency_penalty * counts
            logits -= params.presence_penalty * (counts > 0).to(logits.dtype)
        return logits

    @staticmethod
    def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Temperature then top-k / top-p / min-p on one row ``[vocab]``; removed -> -inf.

        Overflow is tamed first (a tiny temperature or repetition penalty makes logits +-inf or
        NaN): NaN -> -inf, +inf -> the largest float, so the result is always a distribution
        with at least one finite logit (the best raw one when nothing else is left)."""
        raw = logits
        logits = torch.nan_to_num(
            logits / params.temperature, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max
        )
        if not bool((logits > float("-inf")).any()):
            best = int(torch.nan_to_num(raw, nan=float("-inf")).argmax())
            logits = torch.full_like(logits, float("-inf"))
            logits[best] = 0.0
        vocab = logits.shape[-1]
        if 0 < params.top_k < vocab:
            kth = torch.topk(logits, params.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if params.top_p < 1.0 or params.min_p > 0.0:
            probs = torch.softmax(logits, dim=-1)
            if params.min_p > 0.0:
                logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
            if params.top_p < 1.0:
                sorted_probs, order = torch.sort(probs, descending=True)
                cum = sorted_probs.cumsum(-1)
                # keep a token if the mass strictly before it is < top_p (the top one always)
                drop_sorted = (cum - sorted_probs) >= params.top_p
                drop_sorted[0] = False  # even when top_p rounds to 0 in float32 (5e-324)
                drop = torch.zeros_like(drop_sorted).scatter_(0, order, drop_sorted)
                logits = logits.masked_fill(drop, float("-inf"))
        return logits

    def sample(self, logits: torch.Tensor, seqs: Sequence[SequenceState]) -> SamplerOutput:
        """Pick one token per row of ``logits [B, vocab]`` (float32)."""
        if logits.shape[0] != len(seqs):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(seqs)} sequences")
        logits = logits.float()
        b = len(seqs)
        simple_greedy = [s.params.is_greedy and not s.params.has_penalties for s in seqs]
        tokens: list[int] = [0] * b
        if all(simple_greedy):
            tokens = logits.argmax(dim=-1).tolist()
        else:
            for i, s in enumerate(seqs):
                p = s.params
                row = self.apply_penalties(logits[i], p, s.prompt_ids, s.output_ids)
                if p.is_greedy:
                    tokens[i] = int(row.argmax())
                    continue
                filtered = self.filter_logits(row, p)
                probs = torch.softmax(filtered, dim=-1)
                gen = s.generator
                if gen is None:
                    gen = s.generator = self.make_generator(p.seed, logits.device)
                tokens[i] = int(torch.multinomial(probs, 1, generator=gen))
        # logprobs come from the raw logits, before penalties and temperature (vLLM's default)
        logprobs: list[float | None] = [None] * b
        tops: list[list[tuple[int, float]] | None] = [None] * b
        want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if want:
            idx = torch.tensor(want, dtype=torch.long, device=logits.device)
            picked = logits if len(want) == b else logits.index_select(0, idx)
            vals, top = chosen_and_top(
                picked, [tokens[i] for i in want], [seqs[i].params.logprobs or 0 for i in want]
            )
            for i, v, t in zip(want, vals, top):
                logprobs[i] = v
                tops[i] = t
        return SamplerOutput(token_ids=tokens, logprobs=logprobs, top_logprobs=tops)
