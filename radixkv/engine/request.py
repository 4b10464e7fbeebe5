"""A request's life in the engine: its sequences, their KV pages and what is reported back."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixkv.engine.detokenizer import IncrementalDetokenizer
    from radixkv.engine.sampling import SamplingParams

#: A prompt as the offline API takes it: text, or token ids.
Prompt = str | list[int]


@dataclass(frozen=True, slots=True)
class Logprob:
    """One token at one position (vLLM's ``Logprob``), in a dict keyed by its token id.

    ``rank``: 1 + the number of tokens with a strictly greater logprob (1 is the most likely;
    tied tokens share a rank). ``decoded_token``: the tokenizer's decode of that one id (None
    without a tokenizer). See :mod:`radixkv.engine.logprobs` for what a position's dict holds.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: One position's logprobs as vLLM gives them: token id -> :class:`Logprob`.
PositionLogprobs = dict[int, Logprob]


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued; holds no pages and no locks
    RUNNING = "running"  # admitted; holds pages and a lock on its cached path
    FINISHED = "finished"  # done; everything released


@dataclass(eq=False)
class Sequence:
    """One generation stream (a request with ``n > 1`` has n of them).

    KV ownership: ``pages[i]`` holds the K/V of tokens ``[i*P, (i+1)*P)``. The first
    ``num_tree_tokens // P`` pages belong to the radix tree and are protected by a lock on
    ``lock_node``; the remaining pages are the sequence's own (one allocator reference each, shared
    with forked siblings by reference count). ``num_computed`` tokens of ``tokens`` have their K/V in
    ``pages``; the next forward feeds ``tokens[num_computed:]`` (one token while decoding).

    ``gang``: the sequences (this one included) that the scheduler admits, runs and preempts
    only together, one list object shared by all of them (a beam search's beams); None alone.
    A gang member whose tokens are all computed (``num_computed == num_tokens``) is *parked*:
    it waits, holding its pages, until its siblings' logits are ready too.
    ``skip_cache_read``: the prompt must be computed, not read from the prefix cache (prompt
    logprobs asked and not collected yet); its computed pages are still published.
    """

    request_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    salt: str | None
    arrival: float
    detok: IncrementalDetokenizer
    output_ids: list[int] = field(default_factory=list)
    #: per output token, when ``params.logprobs`` is set: vLLM's ``{token_id: Logprob}``
    output_logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    gang: list[Sequence] | None = None
    skip_cache_read: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    status: SeqStatus = SeqStatus.WAITING
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_tree_tokens: int = 0
    lock_node: Any = None
    cached_tokens: int | None = None  # prompt tokens served from cache at first admission
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    finish_reason: str | None = None
    #: what stopped it (vLLM's): the stop string or stop token id; None for EOS or length
    stop_reason: int | str | None = None
    generator: Any = None
    fork_children: int = 0  # siblings still to be forked from this sequence's prefill
    preemptions: int = 0
    accounted: bool = False  # prompt/cached tokens counted in the engine's totals
    first_token_time: float | None = None
    #: when the scheduler first admitted it (vLLM's ``scheduled_ts``; a preemption keeps it)
    scheduled_time: float | None = None
    admit_order: int = 0
    #: its output constraint (:class:`~radixkv.engine.grammar.GrammarState`); not scheduled
    #: until ``grammar.ready``
    grammar: Any = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        """True while more than one token awaits its forward (prompt not yet fully computed)."""
        return self.num_tokens - self.num_computed > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def is_parked(self) -> bool:
        """Every token computed and none to feed (a gang member waiting for its siblings)."""
        return self.num_computed >= self.num_tokens


@dataclass
class StepOutput:
    """What one engine step produced for one sequence."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    cached_tokens_by_tier: dict[str, int]
    #: per new token, when ``params.logprobs`` is set: its top-K and itself, vLLM's
    #: ``{token_id: Logprob}`` (:mod:`radixkv.engine.logprobs`)
    logprobs: list[PositionLogprobs] | None = None
    #: on a sequence's first output, when ``prompt_logprobs`` was asked (None at position 0)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    #: beam search: the finished beam's summed logprob and its length-penalised score
    cumulative_logprob: float | None = None
    score: float | None = None
    #: set (with ``finished`` and ``finish_reason == "error"``) when the engine failed this
    #: request alone inside a step: the message says why; the other requests go on
    error: str | None = None
    #: once finished: the stop string or stop token id that ended it (None: EOS or length)
    stop_reason: int | str | None = None
    #: seconds from arrival to first admission (vLLM's queue time), once admitted
    queue_time: float | None = None
    #: seconds from first admission to the first token (vLLM's prefill time), once it exists
    prefill_time: float | None = None


@dataclass
class CompletionOutput:
    """One finished sequence of a request (vLLM's fields; ``score``: beam search's
    length-penalised rank). With ``logprobs=K``: ``logprobs`` holds per token its
    ``{token_id: Logprob}`` (the top-K and the sampled token) and ``cumulative_logprob`` the
    sampled tokens' sum; both None otherwise (beam search: ``cumulative_logprob`` always)."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    score: float | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    """The result of :meth:`Engine.generate` for one prompt (vLLM's shape, flattened for n == 1)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    cached_tokens: int
    cached_tokens_by_tier: dict[str, int]
    ttft: float | None = None
    latency: float = 0.0
    #: with ``prompt_logprobs=K``: None at position 0, then per prompt token its
    #: ``{token_id: Logprob}`` (the top-K and the prompt token)
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


def now() -> float:
    return time.perf_counter()
