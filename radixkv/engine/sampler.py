"""The batched sampler: logits ``[B, vocab]`` to one token per row in a few tensor calls.

Logits come float32, or bf16 from a bf16 model (the engine does not copy them): a plain batch
(greedy or temperature-only rows, nothing else asked) is read in bf16 by the native kernels
(:meth:`Sampler.plain_tokens`), any other batch gets a float32 copy first; the values, and so
the tokens, are the same either way.

Order of operations per row (vLLM's): ``logit_bias`` and ``min_tokens``
(:mod:`radixkv.engine.logits_processors`), repetition / frequency / presence penalties over the
sequence's prompt + output history, then greedy argmax, or temperature, top-k, min-p and top-p
(top-p over the top-k survivors' distribution, min-p against its largest probability), then one
draw. Every step runs on the whole batch at once; per-row settings are tensors, and the only
per-row Python work is one scalar draw from each row's own generator.

The draw is by inverse CDF: with ``u`` uniform in ``[0, 1)`` from the row's ``torch.Generator``,
the token is the first whose cumulative probability (float64) exceeds ``u`` times the total.
That is an exact draw from the filtered distribution, independent of the other rows in the batch
(a seeded row gives the same tokens alone or beside any neighbours), and reproducible per seed
on every host up to float rounding at a CDF boundary. Rows that filter nothing are drawn from
their softmax in vocabulary order (on the CPU by the native ``sample_rows``, one pass per row
with float64 sums, else by torch ops); rows with top-k / top-p / min-p in sorted order (the kept
tokens are then a prefix). Round 2's sampler drew with ``torch.multinomial`` per row, so a given
seed picks different tokens than it did then (same distribution).

Penalty definitions (as in vLLM / the CTRL paper):

* repetition_penalty ``r``: for every token seen in the prompt or output, a positive logit is
  divided by ``r`` and a negative one multiplied by ``r``;
* frequency_penalty ``f``: ``logit -= f * count_in_output``;
* presence_penalty ``p``: ``logit -= p * (count_in_output > 0)``.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from radixkv.engine.logits_processors import apply_logits_processors
from radixkv.engine.logprobs import chosen_and_top
from radixkv.engine.sampling import SamplingParams
from radixkv.model import native

__all__ = ["Sampler", "SamplerOutput", "SequenceState"]

_NEG_INF = float("-inf")
#: Candidates per filtered row (top-k / top-p / min-p): the largest logits the kept set is sought
#: among; a row whose kept set reaches past them is redone over the whole vocabulary.
CANDIDATES = 256


@dataclass
class SequenceState:
    """What the sampler needs to know about one sequence besides its logits row.

    Attributes:
        params: its sampling parameters.
        prompt_ids: prompt token ids (repetition penalty only).
        output_ids: generated token ids so far (all penalties).
        generator: the sequence's RNG (one uniform draw per sampled step); created from
            ``params.seed`` by :meth:`Sampler.make_generator` when None.
    """

    params: SamplingParams
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    generator: torch.Generator | None = None


@dataclass
class SamplerOutput:
    """Sampled tokens (``[B]`` list) and, where asked (``params.logprobs`` set), the chosen
    tokens' logprobs, their ranks (1 + the number of tokens strictly more likely) and the
    top-``logprobs`` ``(token_id, logprob)`` alternatives."""

    token_ids: list[int]
    logprobs: list[float | None] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)


def _flat_index(
    rows: list[int], ids: list[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row index, token id)`` tensors listing every id of ``ids[j]`` against ``rows[j]``."""
    lengths = torch.tensor([len(x) for x in ids])
    r_idx = torch.tensor(rows, device=device).repeat_interleave(lengths.to(device))
    t_idx = torch.tensor(list(itertools.chain.from_iterable(ids)), dtype=torch.long, device=device)
    return r_idx, t_idx


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]


class Sampler:
    """Batched sampler over float32 logits ``[B, vocab]`` (see the module docstring).

    ``eos_token_ids``: the model's EOS ids, masked for rows short of their ``min_tokens``
    (:mod:`radixkv.engine.logits_processors`, applied before everything else).
    ``kernels`` draws the rows that filter nothing (temperature only, the default of vLLM's
    client) with the native ``sample_rows`` (``radixkv/model/csrc/cpu_sample.cpp``: one pass per
    row, ~14x the torch ops at batch 64 on a Zen 4 host): ``"auto"`` (default) uses the host's
    native build when it loaded, ``None`` keeps the torch ops, a module uses that build (tests
    pass each ISA's).
    Both follow the same inverse-CDF rule, so they pick the same token for the same uniform
    except within float rounding of a CDF boundary.
    """

    def __init__(self, eos_token_ids: Collection[int] = (), kernels: Any = "auto") -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self._kernels = kernels

    def _native(self) -> Any | None:
        """The native build drawing plain CPU rows, or None for the torch ops."""
        return native.load() if self._kernels == "auto" else self._kernels

    def argmax(self, rows: torch.Tensor) -> list[int]:
        """``rows.argmax(-1)`` as a list: the native ``argmax_rows`` (rows in parallel, the same
        indices, NaN included) for float32 CPU rows, torch otherwise."""
        kernels = self._native() if rows.device.type == "cpu" else None
        if kernels is not None and rows.dtype == torch.float32 and rows.dim() == 2:
            return kernels.argmax_rows(rows.contiguous()).tolist()
        return rows.argmax(dim=-1).tolist()

    @staticmethod
    def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator seeded with ``seed`` (random seed when None)."""
        gen = torch.Generator(device=device)
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(int(seed))
        return gen

    # -- penalties -------------------------------------------------------------------------
    @staticmethod
    def penalize(logits: torch.Tensor, seqs: Sequence[SequenceState]) -> torch.Tensor:
        """``logits [B, vocab]`` with every row's penalties applied (a new tensor when any row
        has one; ``logits`` itself otherwise)."""
        rows = [i for i, s in enumerate(seqs) if s.params.has_penalties]
        if not rows:
            return logits
        logits = logits.clone()
        vocab, dev = logits.shape[-1], logits.device
        params = [seqs[i].params for i in rows]
        rep = [j for j, p in enumerate(params) if p.repetition_penalty != 1.0]
        if rep:  # every (row, seen token) of the history, duplicates harmless
            seen = [(*seqs[rows[j]].prompt_ids, *seqs[rows[j]].output_ids) for j in rep]
            r_idx, t_idx = _flat_index([rows[j] for j in rep], seen, dev)
            r = torch.tensor(
                [params[j].repetition_penalty for j in rep], dtype=logits.dtype, device=dev
            )
            r = r.repeat_interleave(torch.tensor([len(x) for x in seen], device=dev))
            vals = logits[r_idx, t_idx]
            logits[r_idx, t_idx] = torch.where(vals > 0, vals / r, vals * r)
        freq = [j for j, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
        outs = [tuple(seqs[rows[j]].output_ids) for j in freq]
        if any(outs):
            r_idx, t_idx = _flat_index([rows[j] for j in freq], outs, dev)
            slots, counts = (r_idx * vocab + t_idx).unique(return_counts=True)
            f_row, p_row = [0.0] * len(seqs), [0.0] * len(seqs)
            for j in freq:
                f_row[rows[j]] = params[j].frequency_penalty
                p_row[rows[j]] = params[j].presence_penalty
            f = torch.tensor(f_row, dtype=logits.dtype, device=dev)
            pres = torch.tensor(p_row, dtype=logits.dtype, device=dev)
            owner = slots // vocab
            delta = f[owner] * counts.to(logits.dtype) + pres[owner]
            logits.view(-1).index_add_(0, slots, -delta)
        return logits

    @classmethod
    def apply_penalties(
        cls,
        logits: torch.Tensor,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
    ) -> torch.Tensor:
        """One row ``[vocab]`` with its penalties applied (see :meth:`penalize`)."""
        state = SequenceState(params, prompt_ids, output_ids)
        return cls.penalize(logits[None], [state])[0]

    # -- temperature, filters and the draw -------------------------------------------------
    @staticmethod
    def sanitize(rows: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Rows that ``logits / temperature`` would overflow, tamed (a no-op for finite rows):
        NaN -> -inf, +inf -> the largest float, and a row left with no finite logit keeps only
        its best raw one. Returns the rows already divided by their temperature."""
        t = _column([p.temperature for p in params], rows)
        big = torch.finfo(rows.dtype).max
        scaled = torch.nan_to_num(rows / t, nan=_NEG_INF, posinf=big)
        dead = ~(scaled > _NEG_INF).any(-1)
        if bool(dead.any()):
            best = torch.nan_to_num(rows[dead], nan=_NEG_INF).argmax(-1)
            one_hot = torch.full_like(scaled[dead], _NEG_INF)
            one_hot.scatter_(1, best[:, None], 0.0)
            scaled[dead] = one_hot
        return scaled

    @staticmethod
    def candidates(
        rows: torch.Tensor,
        top: torch.Tensor,
        inv_t: torch.Tensor,
        params: Sequence[SamplingParams],
        width: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Top-k, min-p and top-p over each row's ``width`` largest logits: ``(weights, token
        ids, complete)``. ``weights [B, width]`` are the unnormalised probabilities of the kept
        tokens (0 for removed ones), descending; ``complete[i]`` is False where the row's kept
        set may reach beyond its ``width`` candidates (then it must be redone over the whole
        vocabulary). ``top`` is each row's largest logit."""
        vocab = rows.shape[-1]
        vals, ids = rows.topk(width, dim=-1)
        weights = ((vals - top) * inv_t).exp_()
        k = torch.tensor([_top_k(p, vocab) for p in params], device=rows.device)[:, None]
        pos = torch.arange(width, device=rows.device)[None]
        weights.masked_fill_(pos >= k, 0.0)
        truncated = (k[:, 0] > width).tolist()
        total = weights.sum(-1, keepdim=True)
        if any(truncated):  # no top-k: normalise over the whole vocabulary
            rest = [i for i, cut in enumerate(truncated) if cut]
            full = ((rows[rest] - top[rest]) * inv_t[rest]).exp_().sum(-1, keepdim=True)
            total[rest] = full
        probs = weights / total
        min_p = _column([p.min_p for p in params], probs)
        drop = probs < min_p * probs[:, :1]
        top_p = _column([p.top_p if p.top_p < 1.0 else 2.0 for p in params], probs)
        # keep a token if the mass strictly before it is < top_p (the top one always)
        drop |= (probs.cumsum(-1) - probs) >= top_p
        drop[:, 0] = False
        weights.masked_fill_(drop, 0.0)
        complete = ~(torch.tensor(truncated, device=rows.device) & (weights[:, -1] > 0))
        return weights, ids, complete

    @staticmethod
    def draw(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """Row ``i``'s index drawn with probability ``weights[i] / weights[i].sum()`` for the
        uniform ``uniforms[i]`` in ``[0, 1)``: the first index whose cumulative weight exceeds
        ``uniforms[i]`` times the total (a zero weight never does)."""
        cdf = weights.cumsum(-1)
        total = cdf[:, -1:]
        target = (uniforms.to(torch.float64)[:, None] * total.double()).to(cdf.dtype)
        idx = torch.searchsorted(cdf, torch.minimum(target, total), right=True)
        over = idx[:, 0] >= weights.shape[-1]  # u * total rounded up to the total
        if bool(over.any()):
            last = (weights[over] > 0).long().cumsum(-1).argmax(-1, keepdim=True)
            idx[over] = last
        return idx[:, 0]

    def sample(self, logits: torch.Tensor, seqs: Sequence[SequenceState]) -> SamplerOutput:
        """Pick one token per row of ``logits [B, vocab]`` (float32, or bf16: a plain batch is
        read as it is by :meth:`plain_tokens`, any other gets a float32 copy, the same values)."""
        if logits.shape[0] != len(seqs):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(seqs)} sequences")
        b = len(seqs)
        plain = self.plain_tokens(logits, seqs)
        if plain is not None:
            return SamplerOutput(plain, [None] * b, [None] * b, [None] * b)
        logits = logits.float()
        scores = apply_logits_processors(logits, seqs, self.eos_token_ids)  # logit_bias etc.
        if all(s.params.is_greedy and not s.params.has_penalties for s in seqs):
            tokens = self.argmax(scores)
        else:
            tokens = self._sample_mixed(scores, seqs)
        # logprobs come from the raw logits, before penalties and temperature (vLLM's default)
        out = SamplerOutput(tokens, [None] * b, [None] * b, [None] * b)
        want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if want:  # only the rows that asked pay for log_softmax, ranks and top-k
            idx = torch.tensor(want, dtype=torch.long, device=logits.device)
            picked = logits if len(want) == b else logits.index_select(0, idx)
            vals, ranks, top = chosen_and_top(
                picked, [tokens[i] for i in want], [seqs[i].params.logprobs or 0 for i in want]
            )
            for i, v, r, t in zip(want, vals, ranks, top):
                out.logprobs[i], out.ranks[i], out.top_logprobs[i] = v, r, t
        return out

    def plain_tokens(self, logits: torch.Tensor, seqs: Sequence[SequenceState]) -> list[int] | None:
        """The tokens of a *plain* batch straight from ``logits`` in their own dtype, by the
        native ``argmax_rows`` and ``sample_rows`` (a bf16 batch is not copied to float32: its
        12.6 MB at batch 64 cost ~2 ms a step); None when the batch is not plain or the logits
        are not on the CPU with the native build. Plain: every row greedy or sampled at a
        temperature alone (no top-k, top-p or min-p), no penalties, ``logit_bias``, ``min_tokens``
        still due or logprobs. The same tokens as the full path: each sampled row draws its one
        uniform from its own generator in batch order, and a row whose logits hold a NaN or +inf
        (or nothing above -inf), which ``sample_rows`` leaves to its caller, goes through
        :meth:`_sample_mixed` in float32 with the uniform it drew."""
        if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.bfloat16):
            return None
        vocab = logits.shape[-1]
        for s in seqs:
            p = s.params
            if (
                p.has_penalties
                or p.logit_bias
                or p.logprobs is not None
                or (p.min_tokens and len(s.output_ids) < p.min_tokens)
                or (not p.is_greedy and _filters(p, vocab))
            ):
                return None
        kernels = self._native()
        if kernels is None:
            return None
        logits = logits.contiguous()
        sampled = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
        if len(sampled) < len(seqs):
            tokens = kernels.argmax_rows(logits).tolist()  # the sampled rows' are replaced below
        else:
            tokens = [0] * len(seqs)
        if not sampled:
            return tokens
        uniforms = self._uniforms([seqs[i] for i in sampled])
        rows = logits if len(sampled) == len(seqs) else logits[sampled]
        inv_t = torch.tensor([1.0 / seqs[i].params.temperature for i in sampled])
        picked = kernels.sample_rows(rows, inv_t, uniforms).tolist()
        bad = [j for j, tok in enumerate(picked) if tok < 0]
        if bad:  # NaN or +inf in the row: the full path's taming, with the drawn uniforms
            redo = self._sample_mixed(
                rows[bad].float(), [seqs[sampled[j]] for j in bad], uniforms[bad]
            )
            for j, tok in zip(bad, redo):
                picked[j] = tok
        for i, tok in zip(sampled, picked):
            tokens[i] = tok
        return tokens

    def _uniforms(self, seqs: Sequence[SequenceState]) -> torch.Tensor:
        """One float64 uniform per sequence from the sequence's own (host) generator, in order;
        a sequence without one gets it from ``params.seed`` first."""
        uniforms = torch.empty(len(seqs), dtype=torch.float64)
        for j, s in enumerate(seqs):
            if s.generator is None:
                s.generator = self.make_generator(s.params.seed)
            uniforms[j] = torch.rand((), dtype=torch.float64, generator=s.generator)
        return uniforms

    def _sample_mixed(
        self,
        logits: torch.Tensor,
        seqs: Sequence[SequenceState],
        uniforms: torch.Tensor | None = None,
    ) -> list[int]:
        """Greedy rows by argmax of their penalised logits; the others drawn (see the module),
        with ``uniforms`` (one per sampled row, in order) when given, else drawn here."""
        penalized = self.penalize(logits, seqs)
        b, vocab = penalized.shape
        sampled = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
        greedy = [i for i, s in enumerate(seqs) if s.params.is_greedy]
        tokens = [0] * b
        if greedy:
            rows = penalized if len(greedy) == b else penalized[greedy]
            for i, tok in zip(greedy, self.argmax(rows)):
                tokens[i] = tok
        if not sampled:
            return tokens
        if uniforms is None:  # one scalar per row from the row's own (host) stream
            uniforms = self._uniforms([seqs[i] for i in sampled])
        uniforms = uniforms.to(logits.device)  # the same draws, so the same tokens, on any device
        params = [seqs[i].params for i in sampled]
        rows = penalized if len(sampled) == b else penalized[sampled]
        top = rows.amax(-1, keepdim=True)
        inv_t = _column([1.0 / p.temperature for p in params], rows)
        bad = (~torch.isfinite(top[:, 0])).nonzero()[:, 0].tolist()
        if bad:  # NaN or +-inf in the row: tamed and scaled once, here
            rows = rows.clone()
            rows[bad] = self.sanitize(rows[bad], [params[j] for j in bad])
            top[bad] = rows[bad].amax(-1, keepdim=True)
            inv_t[bad] = 1.0
        filtered = [j for j, p in enumerate(params) if _filters(p, vocab)]
        plain = [j for j in range(len(sampled)) if not _filters(params[j], vocab)]
        if plain:
            sub = rows if len(plain) == len(sampled) else rows[plain]
            kernels = self._native() if sub.device.type == "cpu" else None
            if kernels is not None:
                picked = kernels.sample_rows(
                    sub.contiguous(), inv_t[plain, 0].contiguous(), uniforms[plain].contiguous()
                )
            else:
                weights = ((sub - top[plain]) * inv_t[plain]).exp_()
                picked = self.draw(weights, uniforms[plain])
            for j, tok in zip(plain, picked.tolist()):
                tokens[sampled[j]] = tok
        if filtered:
            sub_params = [params[j] for j in filtered]
            ks = [k for k in (_top_k(p, vocab) for p in sub_params) if k < vocab]
            width = min(vocab, max([CANDIDATES, *ks]))
            sub, sub_top, sub_t = rows[filtered], top[filtered], inv_t[filtered]
            weights, ids, complete = self.candidates(sub, sub_top, sub_t, sub_params, width)
            redo = (~complete).nonzero()[:, 0].tolist()
            picked = ids.gather(1, self.draw(weights, uniforms[filtered])[:, None])[:, 0]
            for r in redo:  # a flat row whose kept set outgrew the candidates: all of it
                w, full_ids, _ = self.candidates(
                    sub[r : r + 1],
                    sub_top[r : r + 1],
                    sub_t[r : r + 1],
                    sub_params[r : r + 1],
                    vocab,
                )
                picked[r] = full_ids[0, self.draw(w, uniforms[filtered][r : r + 1])[0]]
            for j, tok in zip(filtered, picked.tolist()):
                tokens[sampled[j]] = tok
        return tokens


def _top_k(params: SamplingParams, vocab: int) -> int:
    """The tokens top-k keeps: ``top_k`` where it removes any, else the whole ``vocab``."""
    return params.top_k if 0 < params.top_k < vocab else vocab


def _filters(params: SamplingParams, vocab: int) -> bool:
    """Whether top-k, top-p or min-p removes anything for ``params``."""
    return _top_k(params, vocab) < vocab or params.top_p < 1.0 or params.min_p > 0.0
