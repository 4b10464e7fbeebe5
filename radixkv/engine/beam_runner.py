"""The engine's side of beam search: beams as running sequences, forked and dropped per step.

:class:`BeamRunner` keeps one :class:`~radixkv.engine.beam_search.BeamSearch` per request. The
engine offers it each beam's logits row as the beam's last token is computed; once every beam of
a request has offered (normally in the same step: the scheduler runs a request's beams as one
gang), the search advances, forking beams chosen twice (``KVManager.fork``: shared pages by
reference, the tail page copied on write) and dropping beams chosen by none (their own pages are
freed at once, ``publish=False``: a dropped beam is not worth caching). A finished search emits
its ``n`` best beams as one final :class:`StepOutput` each (beam search does not stream).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixkv.engine.beam_search import BeamSearch
from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.engine.outputs import prefill_time, queue_time
from radixkv.engine.request import (
    CompletionOutput,
    RequestOutput,
    Sequence,
    StepOutput,
    now,
)

if TYPE_CHECKING:
    from radixkv.engine.lifecycle import SequenceLifecycle
    from radixkv.engine.logprobs import TokenTexts
    from radixkv.engine.request import PositionLogprobs, Prompt
    from radixkv.engine.sampling import SamplingParams

__all__ = ["BeamRunner", "beam_request_output"]


class BeamRunner:
    """Beam searches in flight, by request id."""

    def __init__(
        self,
        lifecycle: SequenceLifecycle,
        eos_token_ids: set[int],
        token_texts: TokenTexts,
        counters: dict[str, int],
        page_size: int,
        num_pages: int,
        prefix_cache: bool,
    ) -> None:
        self.lifecycle = lifecycle
        self.eos_token_ids = eos_token_ids
        self.token_texts = token_texts
        self.counters = counters
        self.page_size, self.num_pages, self.prefix_cache = page_size, num_pages, prefix_cache
        self.searches: dict[str, BeamSearch] = {}

    def check_capacity(self, prompt_len: int, params: SamplingParams) -> None:
        """Refuse a search that may need more pages at once than the pool has (worst case: each
        beam recomputed after preemption; with the prefix cache the prompt's pages are shared)."""
        P, k, pages = self.page_size, params.beam_width, self.num_pages
        if self.prefix_cache:
            need = -(-prompt_len // P) + k * (-(-params.max_tokens // P) + 1)
        else:
            need = k * -(-(prompt_len + params.max_tokens) // P)
        if need > pages:
            raise ValueError(
                f"beam search with {k} beams over a {prompt_len}-token prompt and max_tokens="
                f"{params.max_tokens} may need {need} KV pages, the cache has {pages}: raise "
                "kv_cache_tokens or lower the beam width"
            )

    def start(self, head: Sequence) -> None:
        """``head`` (queued, not yet prefilled) becomes the first beam of its request."""
        search = BeamSearch.start(head, self.eos_token_ids, self.token_texts)
        self.searches[head.request_id] = search

    def offer(self, seq: Sequence, row: torch.Tensor) -> None:
        """The logits of beam ``seq``'s last token, computed this step."""
        self.searches[seq.request_id].offer(seq, row)

    def advance_ready(self, outputs: list[StepOutput]) -> None:
        """Advance every search whose beams all offered; finished ones append their outputs."""
        for rid, search in list(self.searches.items()):
            if not search.ready():
                continue
            search.advance(self._fork, self._drop)
            if search.done:
                outputs.extend(self._finish(rid, search))

    def abort(self, request_id: str) -> list[StepOutput]:
        """Stop a search: every beam's pages go back (computed full pages stay cached)."""
        search = self.searches.pop(request_id)
        head = self.lifecycle.pop(request_id)[0]
        for b in [*search.beams, head]:
            self.lifecycle.end(b, "abort")
        search.beams.clear()
        return [_output(head, i, [], "", "abort", None) for i in range(search.params.n)]

    # -- the search's callbacks ----------------------------------------------------------------
    def _fork(self, parent: Sequence) -> Sequence:
        return self.lifecycle.fork(parent, parent.index, beam=True)

    def _drop(self, seq: Sequence) -> None:
        self.lifecycle.end(seq, "dropped", publish=False)

    def _finish(self, rid: str, search: BeamSearch) -> list[StepOutput]:
        del self.searches[rid]
        head = self.lifecycle.pop(rid)[0]
        head.first_token_time = head.first_token_time or now()
        p = search.params
        outs = []
        for i, h in enumerate(search.results()):
            detok = IncrementalDetokenizer(self.lifecycle.tokenizer, None)
            detok.update(h.token_ids, final=True)
            want = p.logprobs is not None
            out = _output(
                head,
                i,
                list(h.token_ids),
                detok.text,
                h.finish_reason,
                list(h.logprobs) if want else None,
            )
            out.cumulative_logprob = h.cum_logprob
            out.score = h.score
            outs.append(out)
            self.counters["generated_tokens"] += len(h.token_ids)
        for i in range(len(outs), p.n):  # fewer finished beams than asked (a tiny vocabulary)
            outs.append(_output(head, i, [], "", "stop", None))
        if head.prompt_logprobs is not None and outs:
            outs[0].prompt_logprobs = list(head.prompt_logprobs)
        return outs


def _output(
    head: Sequence,
    index: int,
    tokens: list[int],
    text: str,
    reason: str,
    logprobs: list[PositionLogprobs] | None,
) -> StepOutput:
    return StepOutput(
        request_id=head.request_id,
        index=index,
        new_token_ids=tokens,
        new_text=text,
        finished=True,
        finish_reason=reason,
        prompt_tokens=len(head.prompt_ids),
        cached_tokens=head.cached_tokens or 0,
        cached_tokens_by_tier=dict(head.cached_by_tier),
        logprobs=logprobs,
        queue_time=queue_time(head),
        prefill_time=prefill_time(head),
    )


def beam_request_output(
    request_id: str, prompt: Prompt, head: Sequence, outs: list[StepOutput]
) -> RequestOutput:
    """The offline :class:`RequestOutput` of a finished (or aborted) beam search."""
    outs = sorted(outs, key=lambda o: o.index)
    first = outs[0] if outs else None
    return RequestOutput(
        request_id=request_id,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=head.prompt_ids,
        outputs=[
            CompletionOutput(
                index=o.index,
                token_ids=o.new_token_ids,
                text=o.new_text,
                finish_reason=o.finish_reason,
                logprobs=o.logprobs,
                cumulative_logprob=o.cumulative_logprob,
                score=o.score,
            )
            for o in outs
        ],
        cached_tokens=head.cached_tokens or 0,
        cached_tokens_by_tier=dict(head.cached_by_tier),
        ttft=(head.first_token_time - head.arrival) if head.first_token_time else None,
        latency=now() - head.arrival,
        prompt_logprobs=first.prompt_logprobs if first else None,
    )
