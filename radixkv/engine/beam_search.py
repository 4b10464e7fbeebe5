"""Beam search over forked sequences: the beams share KV pages the way forked samples do.

One :class:`BeamSearch` per request. Its running beams are engine :class:`Sequence` objects that
form one *gang* (scheduled and preempted together, see the scheduler). Each beam step takes the
logits of every running beam's last token and keeps the best ``width`` continuations:

* a beam chosen by no continuation is dropped (its own pages go back; shared ones stay with the
  siblings that hold them);
* a beam chosen by one continuation goes on as itself;
* a beam chosen by ``c > 1`` continuations is forked ``c - 1`` times: the forks share every page
  by reference, and the partial tail page is copied on the next write (``KVManager.grow``).

Selection and ranking follow transformers' ``generate(num_beams=k, do_sample=False)``:
candidates are the top ``max(2, 1 + len(stop_ids)) * k`` of ``cum_logprob + log_softmax(raw
logits)`` over all beams; the best ``k`` candidates that do not stop become the next beams; a
stopping candidate (a stop token, or the ``max_tokens``-th token) among the top ``k`` becomes a
finished hypothesis scored ``cum_logprob / generated_len ** length_penalty``, where
``generated_len`` counts the new tokens including the stop token; ``k`` hypotheses are kept.
``early_stopping`` True stops once ``k`` hypotheses exist; False and ``"never"`` use
transformers' heuristics on whether a running beam can still beat the worst hypothesis.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from radixkv.engine.logprobs import PositionLogprobs, TokenTexts, chosen_and_top
from radixkv.engine.request import SeqStatus, Sequence
from radixkv.engine.sampling import SamplingParams

__all__ = ["BeamSearch", "BeamSearchParams", "Hypothesis"]


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters; :meth:`to_sampling_params` gives the engine's form.

    ``temperature`` is accepted for vLLM compatibility and ignored (beam search ranks by the raw
    logprobs). Beam search stops once ``beam_width`` beams have finished (``early_stopping``).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(
            n=self.beam_width,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            temperature=self.temperature,
            length_penalty=self.length_penalty,
            use_beam_search=True,
            early_stopping=True,
        )


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens, their logprobs (when asked) and its score."""

    token_ids: list[int]
    logprobs: list[PositionLogprobs]
    cum_logprob: float
    score: float
    finish_reason: str


@dataclass
class _Candidate:
    parent: int  # index into the running beams
    token: int
    cum_logprob: float
    stop: str | None  # the finish reason when this continuation ends its beam
    entry: PositionLogprobs | None  # its logprobs dict (``params.logprobs`` set)


@dataclass
class BeamSearch:
    """The beam search of one request (see the module docstring for the rules).

    Invariants: every running beam has the same number of output tokens; ``beams`` is sorted by
    ``cum_logprob`` (best first) and is the very list object of the beams' ``gang``;
    ``finished`` is sorted by score (best first) and holds at most ``width`` hypotheses.
    """

    params: SamplingParams
    stop_ids: set[int]
    beams: list[Sequence] = field(default_factory=list)
    finished: list[Hypothesis] = field(default_factory=list)
    improvable: bool = True
    done: bool = False
    rows: dict[int, torch.Tensor] = field(default_factory=dict)
    num_steps: int = 0
    texts: TokenTexts = field(default_factory=lambda: TokenTexts(None))

    @classmethod
    def start(
        cls, head: Sequence, eos_token_ids: set[int], texts: TokenTexts | None = None
    ) -> BeamSearch:
        """The search of ``head``'s request; ``head`` becomes the only beam (its gang).
        ``texts`` decodes the tokens of the logprobs (when asked)."""
        p = head.params
        stop = set() if p.ignore_eos else set(eos_token_ids)
        stop.update(p.stop_token_ids or ())
        search = cls(params=p, stop_ids=stop, texts=texts or TokenTexts(None))
        search.beams = [head]
        head.gang = search.beams
        return search

    @property
    def width(self) -> int:
        return self.params.beam_width

    @property
    def candidates_kept(self) -> int:
        """transformers' ``beams_to_keep``: enough that ``width`` candidates do not stop."""
        return max(2, 1 + len(self.stop_ids)) * self.width

    # -- the engine's side ------------------------------------------------------------------
    def offer(self, seq: Sequence, row: torch.Tensor) -> None:
        """``seq``'s logits for its last token (its KV is complete up to that token)."""
        self.rows[id(seq)] = row

    def ready(self) -> bool:
        """Every running beam is computed to its last token and has offered its logits."""
        return bool(self.beams) and all(
            b.status is SeqStatus.RUNNING and b.is_parked and id(b) in self.rows for b in self.beams
        )

    def advance(
        self, fork: Callable[[Sequence], Sequence], drop: Callable[[Sequence], None]
    ) -> None:
        """One beam step on the offered rows. ``fork(parent)`` returns a new running sequence
        sharing ``parent``'s pages and history; ``drop(seq)`` releases a beam's pages."""
        assert self.ready(), "advance() before every beam offered its logits"
        rows = torch.stack([self.rows.pop(id(b)) for b in self.beams]).float()
        self.rows.clear()
        cands = self._candidates(rows)
        gen_len = len(self.beams[0].output_ids) + 1
        self._collect_finished(cands, gen_len)
        running = [c for c in cands if c.stop is None][: self.width]
        self._update_heuristic(running, gen_len)
        all_stop = all(c.stop is not None for c in cands)
        full = len(self.finished) >= self.width
        self.done = (
            not running
            or all_stop
            or not self.improvable
            or (full and self.params.early_stopping is True)
        )
        self.num_steps += 1
        if self.done:
            for b in self.beams:
                drop(b)
            self.beams.clear()
            return
        # forks first (a fork copies its parent's history before the parent extends it)
        assigned: list[Sequence] = []
        used: set[int] = set()
        for c in running:
            parent = self.beams[c.parent]
            if c.parent in used:
                assigned.append(fork(parent))
            else:
                used.add(c.parent)
                assigned.append(parent)
        for seq, c in zip(assigned, running):
            seq.output_ids.append(c.token)
            if c.entry is not None:
                seq.output_logprobs.append(c.entry)
            seq.cum_logprob = c.cum_logprob
        for i, b in enumerate(self.beams):
            if i not in used:
                drop(b)
        self.beams[:] = assigned  # in place: the list is the beams' gang
        for b in self.beams:
            b.gang = self.beams

    def results(self) -> list[Hypothesis]:
        """The ``n`` best finished hypotheses, best first."""
        return self.finished[: self.params.n]

    # -- the rules ---------------------------------------------------------------------------
    def _candidates(self, rows: torch.Tensor) -> list[_Candidate]:
        lp = torch.log_softmax(rows, dim=-1)
        cum = torch.tensor(
            [b.cum_logprob for b in self.beams], dtype=torch.float32, device=rows.device
        )
        acc = (lp + cum[:, None]).reshape(-1)
        vocab = lp.shape[-1]
        vals, idx = acc.topk(min(self.candidates_kept, acc.numel()))
        picked = [divmod(i, vocab) for i in idx.tolist()]  # (parent, token)
        entries: list[PositionLogprobs | None] = [None] * len(picked)
        k = self.params.logprobs
        if k is not None:  # each candidate's dict: its parent row's top-k and itself
            parents = torch.tensor([p for p, _ in picked], dtype=torch.long, device=rows.device)
            tokens = [t for _, t in picked]
            own, ranks, tops = chosen_and_top(
                rows.index_select(0, parents), tokens, [k] * len(tokens)
            )
            entries = [self.texts.logprobs(*e) for e in zip(tokens, own, ranks, tops)]
        gen_len = len(self.beams[0].output_ids) + 1
        max_new = self.params.max_tokens
        out: list[_Candidate] = []
        for v, (parent, token), entry in zip(vals.tolist(), picked, entries):
            stop = "stop" if token in self.stop_ids else ("length" if gen_len >= max_new else None)
            out.append(_Candidate(parent, token, v, stop, entry))
        return out

    def _collect_finished(self, cands: list[_Candidate], gen_len: int) -> None:
        full = len(self.finished) >= self.width
        if not self.improvable or (full and self.params.early_stopping is True):
            return
        penalty = gen_len**self.params.length_penalty
        for c in cands[: self.width]:  # only the top `width` candidates may finish
            if c.stop is None:
                continue
            parent = self.beams[c.parent]
            self.finished.append(
                Hypothesis(
                    token_ids=parent.output_ids + [c.token],
                    logprobs=parent.output_logprobs + ([] if c.entry is None else [c.entry]),
                    cum_logprob=c.cum_logprob,
                    score=c.cum_logprob / penalty,
                    finish_reason=c.stop,
                )
            )
        self.finished.sort(key=lambda h: -h.score)  # stable: earlier hypotheses win ties
        del self.finished[self.width :]

    def _update_heuristic(self, running: list[_Candidate], gen_len: int) -> None:
        """transformers' ``_check_early_stop_heuristic`` (sticky once it says "no")."""
        if not running or len(self.finished) < self.width:
            return
        lp = self.params.length_penalty
        if self.params.early_stopping == "never" and lp > 0.0:
            best_len = self.params.max_tokens
        else:
            best_len = gen_len
        best_possible = running[0].cum_logprob / best_len**lp
        worst = min(h.score for h in self.finished)
        self.improvable = self.improvable and best_possible > worst
