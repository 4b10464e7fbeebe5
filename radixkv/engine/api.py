"""The engine as the HTTP server sees it: :class:`EngineAPI`, the one typed interface that
:class:`radixkv.Engine` and the tests' ``FakeEngine`` (tests/fake_engine.py) both implement and
``radixkv.server`` is written against (checked by mypy: tests/test_typecheck.py).

Single-threaded: the server's engine thread (:mod:`radixkv.server.engine_loop`) makes every call
but the read-only facts (``model_name``, ``max_model_len``, ...) and the tokenizer, which is
locked for the worker threads that tokenize prompts. Validation errors are ``ValueError``; a
wrong request field raises :class:`ParamError`, which names it (the server's 400 ``param``).

Optional capabilities are typed attributes that may be None: ``tree`` (the radix tree, for the
dashboard's view and the eviction counts), ``tiers`` (the offload tiers) and ``grammars``
(structured outputs). An engine without one answers None and the server says so (404, 400).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from radixkv.engine.errors import ParamError

if TYPE_CHECKING:
    from radixkv.cache.radix_tree import RadixTree
    from radixkv.cache.tiers import TieredCache
    from radixkv.engine.grammar import StructuredRuntime
    from radixkv.engine.request import StepOutput
    from radixkv.engine.sampling import SamplingParams

__all__ = ["EngineAPI", "ParamError", "Tokenizer"]


class Tokenizer(Protocol):
    """What the server calls on an engine's tokenizer (a transformers tokenizer has more; the
    chat template renders through it too, :mod:`radixkv.engine.chat_template`)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class EngineAPI(Protocol):
    """The engine's step API and what the server reads (docs/design.md, "Engine step API")."""

    # ---------------------------------------------------------------- facts (read-only)

    @property
    def model_name(self) -> str:
        """The model's name (``/v1/models``'s ``root``; always an accepted ``model``)."""
        ...

    @property
    def max_model_len(self) -> int:
        """The context length in tokens: prompt + max_tokens never exceed it."""
        ...

    @property
    def page_size(self) -> int:
        """Tokens per KV page."""
        ...

    @property
    def max_running_requests(self) -> int:
        """Sequences batched at most in one step (SGLang's ``/server_info``)."""
        ...

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer (None: a model that takes token ids only)."""
        ...

    @property
    def chat_template(self) -> str | None:
        """The engine's chat template text (``--chat-template``; None: the model's own)."""
        ...

    # ---------------------------------------------------------------- optional capabilities

    @property
    def tree(self) -> RadixTree | None:
        """The radix tree of cached prefixes (the dashboard's view, eviction counts)."""
        ...

    @property
    def tiers(self) -> TieredCache | None:
        """The offload tiers below the device pool (host, disk, remote), if any."""
        ...

    @property
    def grammars(self) -> StructuredRuntime | None:
        """Structured outputs' grammar compiler (None: structured outputs are refused)."""
        ...

    # ---------------------------------------------------------------- requests

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt as the engine computes it (text without special tokens)."""
        ...

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        salt: str | None = None,
        owner: str | None = None,
    ) -> None:
        """Validate and queue a request: ``ValueError`` (:class:`ParamError` for one field)
        saying what to fix. ``salt``: the cache namespace; ``owner``: the caller's key."""
        ...

    def abort(self, request_id: str) -> bool:
        """Stop a request (its pages go back); False if unknown."""
        ...

    def has_unfinished(self) -> bool:
        """Whether any request waits or runs."""
        ...

    def step(self) -> list[StepOutput]:
        """Run one batch; what each sequence made (aborted ones' last outputs too)."""
        ...

    # ---------------------------------------------------------------- administration

    def stats(self) -> dict[str, Any]:
        """Queue lengths, page occupancy and running totals (``/cache/stats``)."""
        ...

    def flush_cache(self, drop_pins: bool = False) -> bool:
        """Drop the cache (pins too with ``drop_pins``); False, nothing done, while requests
        are in flight."""
        ...

    def pin_prefix(
        self,
        prompt: str | list[int],
        salt: str | None = None,
        ttl: float | None = None,
        *,
        budget: int | None = None,
        namespace_budget: int | None = None,
        compute: bool = True,
    ) -> int:
        """Pin the cached part of ``prompt`` (computed first unless ``compute`` is False);
        returns the tokens pinned. Past a budget: :class:`~radixkv.cache.pins.PinBudgetError`."""
        ...

    def unpin_prefix(self, prompt: str | list[int], salt: str | None = None) -> int:
        """Remove the pins on ``prompt``'s cached path; returns the pins removed."""
        ...

    def check_integrity(self) -> None:
        """Raise AssertionError when an invariant of the pages is broken."""
        ...

    def integrity_report(self) -> dict[str, Any]:
        """``{"ok", "error", "leaked_pages", "leaked_host_pages", "pages_used",
        "pages_cached", "running", "waiting"}``; never raises (``/cache/integrity``)."""
        ...

    def close(self) -> object:
        """Make what outlives the process durable and stop background threads (idempotent;
        the server calls it once its engine thread has stopped)."""
        ...
