"""Pinning a prompt for :meth:`radixkv.Engine.pin_prefix`: compute it first when it is not cached
(as a one-token greedy request inside the engine, so its pages end up cached, keeping the other
requests' outputs for their ``step()``), then pin its cached path in the tree."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from radixkv.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from radixkv.cache.radix_tree import RadixTree
    from radixkv.config import EngineConfig
    from radixkv.engine.lifecycle import SequenceLifecycle
    from radixkv.engine.request import Prompt, StepOutput

__all__ = [
    "PinnedCapacityError",
    "PinningEngine",
    "check_fits_beside_pins",
    "compute_prompt",
    "pin_prompt",
]


class PinningEngine(Protocol):
    """What pinning needs of the engine (:class:`radixkv.Engine` has it): its tree and
    capacity, and its public request calls (outputs of other requests are handed back with
    ``defer_outputs``, never by touching the engine's queue)."""

    @property
    def tree(self) -> RadixTree: ...
    @property
    def config(self) -> EngineConfig: ...
    @property
    def page_size(self) -> int: ...
    @property
    def kv_capacity_tokens(self) -> int: ...
    @property
    def lifecycle(self) -> SequenceLifecycle: ...
    @property
    def counters(self) -> dict[str, int]: ...

    def tokenize(self, prompt: Prompt) -> list[int]: ...
    def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams, salt: str | None
    ) -> None: ...
    def step(self) -> list[StepOutput]: ...
    def has_unfinished(self) -> bool: ...
    def abort(self, request_id: str) -> bool: ...
    def next_request_id(self, prefix: str) -> str: ...
    def defer_outputs(self, outputs: list[StepOutput]) -> None: ...
    def drop_outputs(self, request_id: str) -> list[StepOutput]: ...


class PinnedCapacityError(ValueError):
    """A request cannot fit in the KV cache beside the pinned prefixes (pins are never
    evicted): answered at once (HTTP 503 naming the pins) instead of waiting for pages that
    will not come while the pins stand."""


def check_fits_beside_pins(
    engine: PinningEngine, ids: list[int], total: int, salt: str | None
) -> None:
    """Raise :class:`PinnedCapacityError` when ``total`` tokens (prompt + max_tokens) do not fit
    in the KV cache beside the pinned tokens. The request's own cached prefix counts as space it
    reuses (it may be pinned itself). Costs a tree walk only while pins exist."""
    tree = engine.tree
    if not tree.num_pins:
        return
    pinned = tree.pinned_tokens(whole_tree=True)
    reused = min(pinned, tree.match_prefix(ids, salt=salt).num_tokens)
    room = engine.kv_capacity_tokens - pinned + reused
    if total > room:
        raise PinnedCapacityError(
            f"prompt ({len(ids)} tokens) + max_tokens = {total} tokens do not fit beside the "
            f"pinned prefixes: {pinned} of the KV cache's {engine.kv_capacity_tokens} tokens "
            f"are pinned (room: {room}); unpin some (POST /cache/unpin), lower max_tokens, or "
            "raise kv_cache_tokens"
        )


def compute_prompt(
    engine: PinningEngine, ids: list[int], salt: str | None, request_id: str
) -> None:
    """Step ``engine`` until the request ``request_id`` over ``ids`` has run its prefill (its
    pages then sit in the tree). Outputs of other requests are handed back to the engine
    (``defer_outputs``) for the next ``step()``; after 8 steps without progress the request is
    aborted (bounded)."""
    engine.add_request(
        request_id, ids + [ids[-1]], SamplingParams(max_tokens=1, temperature=0.0), salt
    )
    idle = 0
    while request_id in engine.lifecycle:
        before = engine.counters["steps"]
        # step() returns the outputs queued so far with this step's: keep the others' for later
        engine.defer_outputs([o for o in engine.step() if o.request_id != request_id])
        idle = idle + 1 if engine.counters["steps"] == before else 0
        if idle > 8 or not engine.has_unfinished():  # no progress: give up, bounded
            engine.abort(request_id)
            engine.drop_outputs(request_id)
            return


def pin_prompt(
    engine: PinningEngine,
    prompt: Prompt,
    salt: str | None,
    ttl: float | None,
    budget: int | None,
    namespace_budget: int | None,
    compute: bool = True,
) -> int:
    """The body of :meth:`radixkv.Engine.pin_prefix` (see there); returns the tokens pinned."""
    ids = engine.tokenize(prompt)
    if not ids:
        raise ValueError("the prompt to pin is empty")
    if not engine.config.enable_prefix_cache:
        raise ValueError("the prefix cache is disabled")
    page = engine.page_size
    if compute and engine.tree.match_prefix(ids, salt=salt).num_tokens < len(ids) // page * page:
        compute_prompt(engine, ids, salt, engine.next_request_id("pin"))
    return engine.tree.pin(
        ids, salt=salt, ttl=ttl, budget=budget, namespace_budget=namespace_budget
    )
