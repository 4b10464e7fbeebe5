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

import torch

__all__ = ["SamplingParams", "Sampler", "SamplerOutput", "SequenceState"]

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """Per-request sampling settings (vLLM's names; ``temperature == 0`` is greedy)."""

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
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
                raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        if self.stop_token_ids is not None and not (
            isinstance(self.stop_token_ids, list)
            and all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids)
        ):
            raise bad("stop_token_ids", "must be a list of token ids (integers >= 0)")
        return self

    @property
    def is_greedy(self) -> bool:
        """``temperature == 0``."""
        return self.temperature == 0.0

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
    """Sampled tokens (``[B]`` list) and, where asked, the chosen tokens' logprobs."""

    token_ids: list[int]
    logprobs: list[float | None] = field(default_factory=list)


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
        """Temperature then top-k / top-p / min-p on one row ``[vocab]``; removed -> -inf."""
        logits = logits / params.temperature
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
        chosen_logits = logits
        if all(simple_greedy):
            tokens = logits.argmax(dim=-1).tolist()
        else:
            rows = []
            for i, s in enumerate(seqs):
                p = s.params
                row = self.apply_penalties(logits[i], p, s.prompt_ids, s.output_ids)
                rows.append(row)
                if p.is_greedy:
                    tokens[i] = int(row.argmax())
                    continue
                filtered = self.filter_logits(row, p)
                probs = torch.softmax(filtered, dim=-1)
                gen = s.generator
                if gen is None:
                    gen = s.generator = self.make_generator(p.seed, logits.device)
                tokens[i] = int(torch.multinomial(probs, 1, generator=gen))
            chosen_logits = torch.stack(rows)
        logprobs: list[float | None] = [None] * b
        want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if want:
            idx = torch.tensor(want, dtype=torch.long, device=logits.device)
            lp = torch.log_softmax(chosen_logits.index_select(0, idx), dim=-1)
            tok = torch.tensor([tokens[i] for i in want], dtype=torch.long, device=logits.device)
            vals = lp.gather(1, tok.unsqueeze(1)).squeeze(1).tolist()
            for i, v in zip(want, vals):
                logprobs[i] = float(v)
        return SamplerOutput(token_ids=tokens, logprobs=logprobs)
