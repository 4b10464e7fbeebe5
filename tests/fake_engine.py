"""A small deterministic stand-in for :class:`radixkv.Engine`, implementing the step API.

It implements :class:`radixkv.engine.api.EngineAPI` (checked by mypy, tests/test_typecheck.py),
so the server can be tested without a model: a byte-level tokenizer, an echoing "model" (sequence ``i`` of a request emits the prompt's
tokens starting at offset ``i``), and page accounting with a toy prefix cache, so leak checks
(``pages_used == pages_cached`` when idle) and ``check_integrity()`` mean something.

Test hooks: ``step_delay`` (seconds slept per step), ``fail_steps`` (the next N calls of
``step()`` raise), ``paused`` (steps make no progress).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from server_thread import ServerThread

from radixkv.engine.request import Logprob, PositionLogprobs, StepOutput

if TYPE_CHECKING:
    from radixkv.engine.api import EngineAPI

__all__ = ["EOS_ID", "FakeEngine", "FakeTokenizer", "ServerThread"]

EOS_ID = 2
_OFFSET = 3
VOCAB_SIZE = 256 + _OFFSET


class FakeTokenizer:
    """Byte-level tokenizer: token id = byte value + 3 (0 pad, 1 bos, 2 eos)."""

    eos_token_id = EOS_ID
    bos_token_id = 1
    pad_token_id = 0
    chat_template = "fake"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``."""
        return [b + _OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True, **_: object) -> str:
        """Text of ``ids`` (special tokens dropped)."""
        return bytes(i - _OFFSET for i in ids if _OFFSET <= i < VOCAB_SIZE).decode(
            "utf-8", errors="replace"
        )

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **_: Any,
    ) -> Any:
        """Render ``<|role|>content\\n`` lines; returns a dict like transformers 5 does."""
        text = "".join(f"<|{m['role']}|>{m.get('content') or ''}\n" for m in messages)
        if add_generation_prompt:
            text += "<|assistant|>"
        if not tokenize:
            return text
        return {"input_ids": self.encode(text), "attention_mask": [1] * len(text.encode())}


@dataclass
class _Seq:
    request_id: str
    index: int
    prompt: list[int]
    params: Any
    salt: str | None
    output: list[int] = field(default_factory=list)
    text: str = ""
    owned: list[int] = field(default_factory=list)  # private pages, in order after `shared`
    shared: list[int] = field(default_factory=list)  # cache pages matched (locked)
    cached_tokens: int = 0
    running: bool = False
    finished: bool = False
    finish_reason: str | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


def _param(params: Any, name: str, default: Any) -> Any:
    value = getattr(params, name, default)
    return default if value is None else value


class FakeEngine:
    """Deterministic engine with the step API of ``radixkv.Engine``."""

    #: the model's own template (the tokenizer's); EngineAPI's optional capabilities: none
    chat_template: str | None = None
    tree: None = None
    tiers: None = None
    grammars: None = None

    def __init__(
        self,
        *,
        page_size: int = 4,
        num_pages: int = 2048,
        max_model_len: int = 512,
        max_running_requests: int = 64,
        step_delay: float = 0.0,
        model_name: str = "fake-model",
    ) -> None:
        self.tokenizer = FakeTokenizer()
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_model_len = max_model_len
        self.max_running_requests = max_running_requests
        self.model_name = model_name
        self.step_delay = step_delay
        self.fail_steps = 0
        self.paused = False
        self.aborted: list[str] = []
        self._free: list[int] = list(range(num_pages))
        self._cache: OrderedDict[tuple[Any, ...], int] = OrderedDict()  # LRU order
        self._locks: dict[int, int] = {}
        self._pinned: set[int] = set()
        self._requests: dict[str, list[_Seq]] = {}
        self._waiting: list[_Seq] = []
        self._running: list[_Seq] = []
        self._pending: list[StepOutput] = []
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0

    # ------------------------------------------------------------------ requests

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: Any = None,
        salt: str | None = None,
        owner: str | None = None,
    ) -> None:
        """Validate and queue a request (``ValueError`` says what to fix)."""
        validate = getattr(params, "validate", None)
        if callable(validate):
            validate()
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        bad = [t for t in ids if not 0 <= t < VOCAB_SIZE]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range [0, {VOCAB_SIZE})")
        max_tokens = int(_param(params, "max_tokens", 16))
        if len(ids) + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                f"context length of {self.max_model_len} tokens"
            )
        n = int(_param(params, "n", 1))
        seqs = [_Seq(request_id, i, ids, params, salt) for i in range(n)]
        self._requests[request_id] = seqs
        self._waiting.extend(seqs)

    def abort(self, request_id: str) -> bool:
        """Stop a request; its pages are released. False if unknown."""
        seqs = self._requests.pop(request_id, None)
        if seqs is None:
            return False
        self.aborted.append(request_id)
        for seq in seqs:
            if seq.finished:
                continue
            if seq in self._waiting:
                self._waiting.remove(seq)
            if seq.running:
                self._running.remove(seq)
                self._release(seq)
            seq.finished, seq.finish_reason = True, "abort"
            self._pending.append(self._out(seq, [], ""))
        return True

    def has_unfinished(self) -> bool:
        """Whether any request waits or runs."""
        return bool(self._waiting or self._running)

    def step(self) -> list[StepOutput]:
        """Admit waiting sequences, then emit one token for every running one."""
        if self.fail_steps > 0:
            self.fail_steps -= 1
            raise RuntimeError("injected step failure")
        if self.step_delay:
            time.sleep(self.step_delay)
        outputs, self._pending = self._pending, []
        if self.paused:
            time.sleep(0.005)
            return outputs
        while self._waiting and len(self._running) < self.max_running_requests:
            seq = self._waiting.pop(0)
            self._admit(seq)
        for seq in list(self._running):
            self._advance(seq, outputs)
        return outputs

    # ------------------------------------------------------------------ model + pages

    def _key(self, seq: _Seq, num_pages: int) -> tuple[Any, ...]:
        return (seq.salt, tuple(seq.tokens[: num_pages * self.page_size]))

    def _alloc(self) -> int:
        if not self._free:
            for key, page in list(self._cache.items()):
                if not self._locks.get(page) and page not in self._pinned:
                    del self._cache[key]
                    self._free.append(page)
                    break
        if not self._free:
            raise RuntimeError("fake engine out of pages")
        return self._free.pop()

    def _admit(self, seq: _Seq) -> None:
        p = self.page_size
        matched = 0
        limit = (len(seq.prompt) - 1) // p  # keep at least one prompt token to compute
        while matched < limit and self._key(seq, matched + 1) in self._cache:
            matched += 1
        for i in range(matched):
            page = self._cache[self._key(seq, i + 1)]
            self._cache.move_to_end(self._key(seq, i + 1))
            self._locks[page] = self._locks.get(page, 0) + 1
            seq.shared.append(page)
        seq.cached_tokens = matched * p
        self._running.append(seq)
        seq.running = True
        if seq.index == 0:
            self.prompt_tokens_total += len(seq.prompt)
            self.cached_tokens_total += seq.cached_tokens
        self._ensure_pages(seq, len(seq.prompt))

    def _ensure_pages(self, seq: _Seq, num_tokens: int) -> None:
        need = -(-num_tokens // self.page_size)
        while len(seq.shared) + len(seq.owned) < need:
            seq.owned.append(self._alloc())

    def _advance(self, seq: _Seq, outputs: list[StepOutput]) -> None:
        params = seq.params
        pos = len(seq.output) + seq.index
        token = seq.prompt[pos % len(seq.prompt)]
        seq.output.append(token)
        self._ensure_pages(seq, len(seq.tokens))
        before = seq.text
        seq.text = self.tokenizer.decode(seq.output)
        reason = None
        stops = _param(params, "stop", None) or []
        if isinstance(stops, str):
            stops = [stops]
        for stop in stops:
            at = seq.text.find(stop)
            if at >= 0:
                seq.text = seq.text[:at]
                reason = "stop"
                break
        if reason is None:
            if (
                token == EOS_ID
                and not _param(params, "ignore_eos", False)
                or token in (_param(params, "stop_token_ids", None) or [])
            ):
                reason = "stop"
            elif len(seq.output) >= int(_param(params, "max_tokens", 16)):
                reason = "length"
        delta = seq.text[len(before) :] if seq.text.startswith(before) else seq.text
        if reason is not None:
            self._finish(seq, reason)
        # vLLM's shape: the token's dict, here only itself (the most likely, logprob -0.5)
        lp = [{token: Logprob(-0.5, 1)}] if getattr(params, "logprobs", None) is not None else None
        outputs.append(self._out(seq, [token], delta, lp))

    def _finish(self, seq: _Seq, reason: str) -> None:
        seq.finished, seq.finish_reason = True, reason
        self._running.remove(seq)
        seq.running = False
        self._release(seq)
        seqs = self._requests.get(seq.request_id, [])
        if all(s.finished for s in seqs):
            self._requests.pop(seq.request_id, None)

    def _release(self, seq: _Seq) -> None:
        """Full computed pages go to the cache (or are freed as duplicates); the rest is freed."""
        for page in seq.shared:
            self._locks[page] -= 1
            if not self._locks[page]:
                del self._locks[page]
        full = len(seq.tokens) // self.page_size
        for i, page in enumerate(seq.owned):
            page_no = len(seq.shared) + i
            key = self._key(seq, page_no + 1)
            if page_no < full and key not in self._cache:
                self._cache[key] = page
            else:
                self._free.append(page)
        seq.shared, seq.owned = [], []

    def _out(
        self,
        seq: _Seq,
        tokens: list[int],
        delta: str,
        logprobs: list[PositionLogprobs] | None = None,
    ) -> StepOutput:
        return StepOutput(
            request_id=seq.request_id,
            index=seq.index,
            new_token_ids=tokens,
            new_text=delta,
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            prompt_tokens=len(seq.prompt),
            cached_tokens=seq.cached_tokens,
            cached_tokens_by_tier={"device": seq.cached_tokens},
            logprobs=logprobs,
        )

    # ------------------------------------------------------------------ administration

    def flush_cache(self, drop_pins: bool = False) -> bool:
        """Drop the cache (pins too with ``drop_pins``); False (nothing done) while requests are
        in flight."""
        if self.has_unfinished():
            return False
        if drop_pins:
            self._pinned.clear()
        for key, page in list(self._cache.items()):
            if page not in self._pinned:
                del self._cache[key]
                self._free.append(page)
        return True

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
        """Pin the cached full pages of ``prompt``; returns the tokens pinned (no ttl, no
        budgets, never computes: the real engine's pins are tested on the real tree)."""
        ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("the prompt to pin is empty")
        probe = _Seq("pin", 0, ids, None, salt)
        pinned = 0
        while pinned < len(ids) // self.page_size and self._key(probe, pinned + 1) in self._cache:
            self._pinned.add(self._cache[self._key(probe, pinned + 1)])
            pinned += 1
        return pinned * self.page_size

    def unpin_prefix(self, prompt: str | list[int], salt: str | None = None) -> int:
        """Unpin the cached full pages of ``prompt``; returns the pages unpinned."""
        ids = self.tokenize(prompt)
        probe = _Seq("unpin", 0, ids, None, salt)
        removed = 0
        for i in range(len(ids) // self.page_size):
            page = self._cache.get(self._key(probe, i + 1))
            if page is None:
                break
            if page in self._pinned:
                self._pinned.discard(page)
                removed += 1
        return removed

    def stats(self) -> dict[str, Any]:
        """Counters and page usage, with the keys of ``radixkv.Engine.stats()``."""
        used = self.num_pages - len(self._free)
        return {
            "model": self.model_name,
            "running": len(self._running),
            "waiting": len(self._waiting),
            "page_size": self.page_size,
            "pages_total": self.num_pages,
            "pages_used": used,
            "pages_cached": len(self._cache),
            "pages_evictable": sum(
                1 for p in self._cache.values() if not self._locks.get(p) and p not in self._pinned
            ),
            "pages_free": len(self._free),
            "prompt_tokens_total": self.prompt_tokens_total,
            "cached_tokens_total": self.cached_tokens_total,
            "cached_tokens_by_tier": {"device": self.cached_tokens_total, "host": 0, "disk": 0},
            "hit_rate": (
                self.cached_tokens_total / self.prompt_tokens_total
                if self.prompt_tokens_total
                else 0.0
            ),
        }

    def check_integrity(self) -> None:
        """Every page is exactly one of: free, cached, owned by a running sequence."""
        owned = [p for s in self._running for p in s.owned]
        cached = list(self._cache.values())
        everything = self._free + cached + owned
        assert len(everything) == len(set(everything)), "a page is in two places"
        assert set(everything) == set(range(self.num_pages)), "a page leaked"
        for page, count in self._locks.items():
            assert count > 0 and page in set(cached), "a lock on a page outside the cache"

    def integrity_report(self) -> dict[str, Any]:
        """:meth:`check_integrity` as ``radixkv.Engine.integrity_report()`` answers it (a page
        nobody owns fails the check: none is ever counted leaked beside it)."""
        error = None
        try:
            self.check_integrity()
        except AssertionError as exc:
            error = f"AssertionError: {exc}"
        stats = self.stats()
        return {
            "ok": error is None,
            "error": error,
            "leaked_pages": 0,
            "leaked_host_pages": 0,
            **{k: stats[k] for k in ("pages_used", "pages_cached", "running", "waiting")},
        }

    def close(self) -> None:
        """Nothing outlives the process here."""


def _implements_engine_api(engine: FakeEngine) -> EngineAPI:
    """Never called: mypy (tests/test_typecheck.py) checks here that FakeEngine is an
    :class:`~radixkv.engine.api.EngineAPI`."""
    return engine
