"""The one owner of a sequence's lifecycle: admit, fork, end (finish, abort, drop), release.

Every path that starts or ends a sequence goes through :class:`SequenceLifecycle`: the engine's
intake, its finish and abort, parallel sampling's forks (``n > 1``) and beam search's forks and
dropped beams. Preemption stays with the scheduler (a scheduling decision: the sequence lives
on and is requeued), through the same :meth:`~radixkv.engine.kv_manager.KVManager.release`.

Invariants (``check_integrity`` asserts them):

* a request id is in :attr:`requests` from :meth:`admit` until every one of its sequences has
  ended and none has forks still to make; then it is dropped (by :meth:`finish`,
  :meth:`end_request` or, for a finished beam search, :meth:`pop`);
* a sequence is ``FINISHED`` only after it left the scheduler's queues and, if it was running,
  its pages went back through ``KVManager.release`` (published, unless a dropped beam);
* an ended sequence is never ended again (its ``finish_reason`` is the first one given).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Set

from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.engine.kv_manager import KVManager
from radixkv.engine.request import SeqStatus, Sequence
from radixkv.engine.scheduler import Scheduler

__all__ = ["SequenceLifecycle", "finish_reason"]


class SequenceLifecycle:
    """Sequences by request id, and every transition that starts or ends one."""

    def __init__(self, scheduler: Scheduler, kv: KVManager, tokenizer: object) -> None:
        self.scheduler = scheduler
        self.kv = kv
        self.tokenizer = tokenizer
        self.requests: dict[str, list[Sequence]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    # -- start -----------------------------------------------------------------------------
    def admit(self, seq: Sequence) -> None:
        """Queue a new request's first sequence."""
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in flight")
        self.requests[seq.request_id] = [seq]
        self.scheduler.add(seq)

    def fork(
        self, parent: Sequence, index: int, generator: object = None, beam: bool = False
    ) -> Sequence:
        """A running sibling of ``parent`` on its pages (copy-on-write). A parallel-sampling
        child (``n > 1``) starts after the prompt and is listed under the request; a beam
        carries the parent's output, logprobs and gang and is listed by its search."""
        child = Sequence(
            request_id=parent.request_id,
            index=index,
            prompt_ids=parent.prompt_ids,
            params=parent.params,
            salt=parent.salt,
            arrival=parent.arrival,
            scheduled_time=parent.scheduled_time,
            detok=IncrementalDetokenizer.for_params(self.tokenizer, parent.params, stops=not beam),
            generator=generator,
            cached_tokens=parent.cached_tokens,
            cached_by_tier=dict(parent.cached_by_tier),
            accounted=True,
            grammar=None if parent.grammar is None else parent.grammar.fork(),
        )
        if beam:
            child.output_ids = list(parent.output_ids)
            child.output_logprobs = list(parent.output_logprobs)
            child.cum_logprob = parent.cum_logprob
            child.gang = parent.gang
        self.scheduler.start_fork(parent, child)
        if not beam:
            self.requests.setdefault(parent.request_id, []).append(child)
        return child

    # -- end -------------------------------------------------------------------------------
    def end(self, seq: Sequence, reason: str, publish: bool = True) -> bool:
        """End ``seq`` with ``reason``: out of the queues, its pages back (``publish`` keeps its
        computed full pages in the cache), ``FINISHED``. False if it had already ended."""
        if seq.is_finished:
            return False
        running = seq.status is SeqStatus.RUNNING
        self.scheduler.remove(seq)
        if running:
            self.kv.release(seq, publish=publish)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.gang = None
        return True

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (its computed pages published); the request is forgotten once all its
        sequences have ended and none has forks still to make."""
        self.end(seq, reason)
        seqs = self.requests.get(seq.request_id, [])
        if all(s.is_finished for s in seqs) and not any(s.fork_children for s in seqs):
            self.requests.pop(seq.request_id, None)

    def end_request(self, request_id: str, reason: str) -> list[Sequence]:
        """End every live sequence of ``request_id`` with ``reason`` and forget the request;
        returns the sequences this ended (empty if the request is unknown)."""
        return [seq for seq in self.requests.pop(request_id, []) if self.end(seq, reason)]

    def pop(self, request_id: str) -> list[Sequence]:
        """Forget a request whose sequences have all ended (a finished beam search)."""
        return self.requests.pop(request_id)

    def live(self, request_id: str) -> list[Sequence]:
        """The request's listed sequences (empty if unknown or done)."""
        return self.requests.get(request_id, [])

    def check_integrity(
        self, in_queues: Callable[[Sequence], bool], searching: Collection[str] = ()
    ) -> None:
        """Listed requests have a live sequence or forks to make, or are a beam search in
        flight (``searching``: its beams live in the search); no finished sequence is still
        queued (``in_queues`` tells whether the scheduler holds a sequence)."""
        for rid, seqs in self.requests.items():
            assert seqs, f"request {rid} is listed with no sequence"
            assert rid in searching or any(not s.is_finished or s.fork_children for s in seqs), (
                f"request {rid} is listed but every sequence has ended"
            )
            for s in seqs:
                assert not (s.is_finished and in_queues(s)), f"{rid}/{s.index} ended but queued"


def finish_reason(
    seq: Sequence, token: int, eos_token_ids: Set[int], max_model_len: int
) -> str | None:
    """Why ``seq`` ends with the ``token`` it just sampled (``"stop"``, ``"length"``), or None
    (it goes on). A stop token id is noted as ``seq.stop_reason``; a grammar that the token
    completes ends it. Stop strings are the detokenizer's (:mod:`radixkv.engine.detokenizer`)."""
    p = seq.params
    if seq.grammar is not None and seq.grammar.accept(token, seq.output_ids):
        return "stop"  # the grammar is complete and its stop token was sampled
    if not p.ignore_eos and token in eos_token_ids:
        return "stop"
    if p.stop_token_ids and token in p.stop_token_ids:
        seq.stop_reason = token
        return "stop"
    if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None
