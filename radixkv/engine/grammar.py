"""Grammar-constrained decoding with xgrammar: compiling, caching, and masking a step's logits.

Three parts, each with its invariants:

* :class:`~radixkv.engine.grammar_compiler.GrammarCompilerPool` compiles the constraints, off
  the engine's thread, bounded in time and memory, cached (its module says how).
* :class:`GrammarState` is one sequence's grammar: the compile ``Future`` until it is ready,
  then an xgrammar ``GrammarMatcher`` that has accepted exactly the sequence's output tokens
  after its gate (``accepted == len(seq.output_ids) - offset`` after every step; ``offset`` is
  0 unless the constraint waits for a reasoning block to end, ``StructuredOutputs
  .after_reasoning``: while ``gate`` holds the end marker's ids the row is neither masked nor
  matched, and the step that outputs the marker opens it). Recompute preemption keeps
  ``output_ids`` and so the matcher stays valid; ``n > 1`` siblings each get their own matcher
  (forked before any output exists). Engine thread only.
* :class:`StructuredRuntime` is what the engine calls: it starts a request's grammar, holds it
  out of the batch until compiled (the scheduler skips a sequence whose ``grammar`` is not
  ready), fails it on a compile error or past ``timeout_s``, and per step fills the bitmasks of
  the constrained rows into one tensor and applies them in one call (unconstrained rows are
  never touched).

Masked logits are what the sampler sees, so reported logprobs are those of the constrained
distribution (vLLM's behaviour); :func:`~radixkv.engine.logprobs.chosen_and_top` clamps a
masked ``-inf`` alternative to ``-9999.0`` as vLLM does.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import time
from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from radixkv.engine.grammar_compiler import (
    COMPILE_TIMEOUT_S,
    WAIT_FACTOR,
    CompileQueueFullError,
    GrammarCompilerPool,
    compile_error_message,
    failure,
    timeout_message,
)
from radixkv.engine.structured import StructuredOutputs
from radixkv.model import native

if TYPE_CHECKING:
    from radixkv.engine.request import Sequence

__all__ = [
    "COMPILE_TIMEOUT_S",
    "WAIT_FACTOR",
    "CompileQueueFullError",
    "GrammarCompilerPool",
    "GrammarState",
    "StructuredRuntime",
    "compile_error_message",
    "failure",
    "timeout_message",
]


class GrammarState:
    """One sequence's grammar (module docstring): compile future, then a matcher that has
    accepted exactly ``accepted`` tokens, the sequence's outputs."""

    def __init__(
        self,
        spec: StructuredOutputs,
        future: cf.Future[Any],
        timeout: float,
        deadline: float,
        gate: tuple[int, ...] | None = None,
    ) -> None:
        self.spec = spec
        self.future = future
        self.timeout = timeout
        self.deadline = deadline
        self.matcher: Any = None
        self.accepted = 0
        #: the reasoning end marker's token ids still awaited (None: the constraint applies)
        self.gate = gate
        #: output tokens before the constraint applied (the reasoning and its end marker)
        self.offset = 0

    @property
    def active(self) -> bool:
        """The constraint applies to the next token (no reasoning block left to end)."""
        return self.gate is None

    @property
    def ready(self) -> bool:
        """Compiled successfully (the sequence may be scheduled)."""
        return self.future.done() and failure(self.future) is None

    def error(self, now: float) -> str | None:
        """Why this grammar cannot be used (compile error, or still compiling past its
        deadline); None while it compiles in time or once it is ready."""
        if self.future.done():
            return failure(self.future)
        if now > self.deadline:
            return timeout_message(self.spec, self.timeout)
        return None

    def fork(self) -> GrammarState:
        """A fresh state on the same compile for a sibling (``n > 1``): forks are made after
        the prompt and before the first output, so the new matcher starts empty too."""
        assert self.accepted == 0 and self.offset == 0, "forked only before any output"
        return GrammarState(self.spec, self.future, self.timeout, self.deadline, self.gate)

    def live_matcher(self) -> Any:
        """The xgrammar matcher (made on first use, from the compiled grammar)."""
        if self.matcher is None:
            import xgrammar as xgr

            self.matcher = xgr.GrammarMatcher(self.future.result())
        return self.matcher

    def accept(self, token: int, output_ids: list[int] | tuple[int, ...] = ()) -> bool:
        """Advance by ``token``, the last of ``output_ids``: while gated, only watch for the
        end marker (the constraint applies from the next token once ``output_ids`` ends with
        it); else advance the matcher. True when the grammar has terminated (its stop token
        accepted: the sequence is done); ``ValueError`` if the grammar rejects the token."""
        if self.gate is not None:
            n = len(self.gate)
            if len(output_ids) >= n and tuple(output_ids[-n:]) == self.gate:
                self.gate, self.offset = None, len(output_ids)
            return False
        m = self.live_matcher()
        if not m.accept_token(int(token)):
            raise ValueError(f"token {token} was sampled but the grammar does not allow it")
        self.accepted += 1
        return bool(m.is_terminated())


def last_at(ids: list[int], marker: tuple[int, ...]) -> int:
    """Where ``marker`` last occurs in ``ids`` (its start index), -1 where it does not."""
    n, first = len(marker), marker[0]
    for i in range(len(ids) - n, -1, -1):
        if ids[i] == first and tuple(ids[i : i + n]) == marker:
            return i
    return -1


@dataclasses.dataclass
class _FillAhead:
    """A bitmask fill running on the worker thread: ``rows`` maps ``id(matcher)`` to its row in
    ``bitmask`` and the ``accepted`` count it was filled at."""

    future: cf.Future[Any]
    bitmask: torch.Tensor
    rows: dict[int, tuple[int, int]]


class StructuredRuntime:
    """The engine's side of structured outputs (module docstring). The compiler pool is made on
    the first constrained request, so an engine that never sees one never loads xgrammar."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = list(stop_token_ids)
        self.timeout_s = COMPILE_TIMEOUT_S
        self._pool: GrammarCompilerPool | None = None
        self._bitmask: torch.Tensor | None = None
        self._batch: Any = None  # xgrammar BatchGrammarMatcher, made on first use
        self._ahead: _FillAhead | None = None  # the fill started by prefetch(), if any
        self._ahead_pool: cf.ThreadPoolExecutor | None = None
        self._ahead_bitmask: torch.Tensor | None = None
        self._ahead_batch: Any = None  # the worker's BatchGrammarMatcher, made on first use

    @property
    def pool(self) -> GrammarCompilerPool:
        """The compiler pool (``ValueError`` for a model without a tokenizer)."""
        if self._pool is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer; it has none")
            self._pool = GrammarCompilerPool(
                self.tokenizer, self.vocab_size, self.stop_token_ids,
                compile_timeout=self.timeout_s,
            )  # fmt: skip
        return self._pool

    def start(
        self, params: Any, owner: Hashable = None, prompt_ids: list[int] | None = None
    ) -> GrammarState | None:
        """The grammar of a new request (None when ``params`` has no constraint); its compile
        is queued, and a constraint already known not to compile raises ``ValueError``, one
        past ``owner``'s compile bound :class:`CompileQueueFullError`. With
        ``after_reasoning``, it is gated on the end marker unless ``prompt_ids`` closed the
        reasoning block already."""
        spec = getattr(params, "structured_outputs", None)
        if spec is None:
            return None
        gate = self._gate(spec, prompt_ids or [])
        fut = self.pool.submit(spec, owner)
        if fut.done() and (why := failure(fut)) is not None:
            raise ValueError(why)
        # the compile itself is bounded (its process is killed at timeout_s); this deadline is
        # the backstop for one queued behind other keys' compiles or a child's start-up
        deadline = time.monotonic() + self.timeout_s * WAIT_FACTOR
        return GrammarState(spec, fut, self.timeout_s, deadline, gate)

    def _gate(self, spec: StructuredOutputs, prompt_ids: list[int]) -> tuple[int, ...] | None:
        """The end marker's ids a constraint waits for (``after_reasoning``), or None: no
        markers, or the prompt's last end marker comes after its last start marker."""
        if spec.after_reasoning is None:
            return None
        if self.tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer; it has none")
        start, end = (
            tuple(self.tokenizer.encode(m, add_special_tokens=False)) for m in spec.after_reasoning
        )
        if not start or not end:
            raise ValueError("structured_outputs.after_reasoning: a marker encodes to no tokens")
        if last_at(prompt_ids, end) > last_at(prompt_ids, start):
            return None
        return end

    def wait_all(self, params: Iterable[Any]) -> None:
        """Compile every constraint of ``params`` (the offline API, before queueing anything):
        ``ValueError`` naming the first that fails or times out."""
        specs = [s for p in params if (s := getattr(p, "structured_outputs", None)) is not None]
        for spec in specs:
            if not isinstance(spec, StructuredOutputs):
                raise ValueError("structured_outputs must be a StructuredOutputs or None")
            self.pool.submit(spec.validate())
        for spec in specs:
            self.pool.compile(spec, self.timeout_s)

    def fail_broken(self, waiting: Iterable[Sequence], fail: Callable[[str, str], Any]) -> None:
        """``fail(request id, why)`` each request with a waiting sequence whose grammar failed
        to compile or is still compiling past its deadline."""
        now = time.monotonic()
        out: dict[str, str] = {}
        for seq in waiting:
            if seq.grammar is not None and (why := seq.grammar.error(now)) is not None:
                out.setdefault(seq.request_id, why)
        for request_id, why in out.items():
            fail(request_id, why)

    def wait_pending(self, waiting: Iterable[Sequence], timeout: float = 0.05) -> bool:
        """If some waiting sequence's grammar is still compiling, wait up to ``timeout``
        seconds for one to finish and return True (the step had nothing else to run)."""
        pending = [
            s.grammar.future for s in waiting if s.grammar is not None and not s.grammar.ready
        ]
        if not pending:
            return False
        cf.wait(pending, timeout=timeout, return_when=cf.FIRST_COMPLETED)
        return True

    def prefetch(self, seqs: Iterable[Sequence], keep_started: bool = False) -> None:
        """Start filling the bitmasks of ``seqs``' constrained rows on a worker thread, so that
        the fill runs while the forward pass does (xgrammar releases the GIL; vLLM and SGLang
        overlap the same way). Called with the sequences that will sample this step, before
        their forward; :meth:`mask` takes a row from it only when that row's matcher has not
        moved since (same matcher, same ``accepted``), and fills any other row itself.
        ``keep_started``: leave a fill already under way (the engine starts the next step's fill
        at the end of a step, for the rows decoding then, and again before the forward)."""
        if keep_started and self._ahead is not None:
            return
        self._drop_ahead()
        if self._pool is None:  # no request has ever had a constraint
            return
        rows = [s for s in seqs if s.grammar is not None and s.grammar.ready and s.grammar.active]
        if not rows:
            return
        import xgrammar as xgr

        if self._ahead_pool is None:
            self._ahead_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="radixkv-bitmask")
        matchers = [s.grammar.live_matcher() for s in rows]
        if self._ahead_bitmask is None or self._ahead_bitmask.shape[0] < len(rows):
            self._ahead_bitmask = xgr.allocate_token_bitmask(max(len(rows), 64), self.vocab_size)
        bitmask = self._ahead_bitmask[: len(rows)]  # free again: the last fill-ahead was taken
        if self._ahead_batch is None:  # one thread: the forward has the others
            self._ahead_batch = xgr.BatchGrammarMatcher(max_threads=1)
        self._ahead = _FillAhead(
            self._ahead_pool.submit(
                self._ahead_batch.batch_fill_next_token_bitmask, matchers, bitmask
            ),
            bitmask,
            {id(m): (i, s.grammar.accepted) for i, (s, m) in enumerate(zip(rows, matchers))},
        )

    def _drop_ahead(self) -> None:
        """Wait for an unused fill-ahead and forget it (its matchers must not be filled and
        advanced at once)."""
        if self._ahead is not None:
            cf.wait([self._ahead.future])
            self._ahead = None

    def mask(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """``logits [B, vocab]`` (row ``i`` is ``seqs[i]``'s) with every constrained row masked
        to its grammar's allowed tokens, in place when float32 (one fill per row into one
        bitmask, one apply for all rows); returned as is when no row is constrained."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None and s.grammar.active]
        if not rows:
            self._drop_ahead()
            return logits
        import xgrammar as xgr

        if logits.dtype != torch.float32:
            logits = logits.float()
        b = logits.shape[0]
        if self._bitmask is None or self._bitmask.shape[0] < b:
            self._bitmask = xgr.allocate_token_bitmask(max(b, 64), self.vocab_size)
        bitmask = self._bitmask[:b]
        to_fill = self._take_ahead(bitmask, seqs, rows)
        if to_fill:  # one C++ call fills every row the fill-ahead did not (no per-row Python)
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher(max_threads=max(1, torch.get_num_threads()))
            matchers = [seqs[i].grammar.live_matcher() for i in to_fill]
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, to_fill)
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        elif logits.is_contiguous() and logits.shape[1] == self.vocab_size:
            module = native.load()
            if module is not None:  # one multi-threaded pass that skips all-allowed words
                module.apply_token_bitmask_(logits, bitmask, torch.tensor(rows))
                return logits
        xgr.apply_token_bitmask_inplace(
            logits,
            bitmask,
            vocab_size=self.vocab_size,
            indices=None if len(rows) == b else rows,
        )
        return logits

    def _take_ahead(
        self, bitmask: torch.Tensor, seqs: list[Sequence], rows: list[int]
    ) -> list[int]:
        """Copy into ``bitmask`` the rows of ``rows`` that the fill-ahead filled for the same
        matcher state; return the rows still to fill."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return rows
        ahead.future.result()  # a fill error is raised here, on the engine thread
        src, dst, rest = [], [], []
        for i in rows:
            g = seqs[i].grammar
            hit = ahead.rows.get(id(g.matcher))
            if hit is not None and hit[1] == g.accepted:
                src.append(hit[0])
                dst.append(i)
            else:
                rest.append(i)
        if dst:
            bitmask[dst] = ahead.bitmask[src]
        return rest
