"""Compiling structured-output constraints with xgrammar, bounded and cached.

:class:`GrammarCompilerPool` compiles a :class:`~radixkv.engine.structured.StructuredOutputs`
off the engine's thread, one ``Future`` per constraint. A constraint is a program whose
compile xgrammar cannot interrupt (a 200-property schema compiled for 6.5 s over SmolLM2's
vocabulary), so each of the ``workers`` threads first compiles it in a child process of its
own (:mod:`~radixkv.engine.grammar_worker`), killed at ``compile_timeout`` s (the work stops,
not just the wait) and capped at ``memory_bytes`` past its start-up size; only a constraint
that compiled there within both bounds is compiled again here (the compiled grammar cannot
come back: serialized it is tens to hundreds of times its size). A cold constraint costs its
compile twice (a cached one nothing). One key (``owner``) has at most ``per_key`` compiles
queued or running (more: :class:`CompileQueueFullError`), so one key holds at most ``per_key``
of the workers. The futures are kept in an LRU of at most ``cache_size`` entries and
``cache_bytes`` of compiled grammars, keyed by
:meth:`StructuredOutputs.key` (the same schema twice compiles once; a failure is cached too,
compile errors being deterministic). Thread-safe.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Any

from radixkv.engine.child_pool import ChildPool, KeyLimit
from radixkv.engine.grammar_worker import compile_job
from radixkv.engine.structured import CompileQueueFullError, StructuredOutputs

__all__ = [
    "CACHE_BYTES",
    "CACHE_SIZE",
    "COMPILE_MEMORY_BYTES",
    "COMPILE_TIMEOUT_S",
    "WAIT_FACTOR",
    "WORKERS",
    "CompileQueueFullError",
    "GrammarCompilerPool",
    "compile_error_message",
    "failure",
    "timeout_message",
]

#: A grammar not compiled within this many seconds fails its request (a 400 over HTTP).
COMPILE_TIMEOUT_S = 10.0
#: Compiled grammars kept (least recently used dropped first), and their bytes at most (one
#: JSON schema over SmolLM2's 49,152-token vocabulary takes 2 to 3 MB).
CACHE_SIZE = 256
CACHE_BYTES = 256 << 20
#: A request waits for its grammar up to this many times the compile bound (queued behind other
#: keys' compiles, a child starting) before it fails.
WAIT_FACTOR = 3
#: Compile worker threads (each with its child process).
WORKERS = 2
#: Memory a compile may take past its child's start-up size.
COMPILE_MEMORY_BYTES = 1 << 30


_XGR_PREFIX = re.compile(r"^\s*\[[\d:.]+\]\s+\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


def compile_error_message(spec: StructuredOutputs, exc: BaseException) -> str:
    """``exc`` (an xgrammar compile error) as a message for the client: the constraint's kind
    and xgrammar's reason, without its source-file prefix."""
    why = _XGR_PREFIX.sub("", str(exc)).strip() or type(exc).__name__
    return f"invalid structured output constraint ({spec.kind}): {why}"


def _choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar accepting exactly one of ``choices`` (JSON string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompilerPool:
    """Compiles constraints off the calling thread, caching the results (module docstring).

    ``tokenizer`` is a Hugging Face tokenizer (or a :class:`LockedTokenizer` around one: its
    lock is held while xgrammar reads the vocabulary); ``vocab_size`` is the model's (the
    logits' width, which may exceed the tokenizer's); ``stop_token_ids`` end a finished grammar.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        *,
        cache_size: int = CACHE_SIZE,
        cache_bytes: int = CACHE_BYTES,
        workers: int = WORKERS,
        compile_timeout: float = COMPILE_TIMEOUT_S,
        memory_bytes: int = COMPILE_MEMORY_BYTES,
        per_key: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.compile_timeout = float(compile_timeout)
        self.memory_bytes = int(memory_bytes)
        #: compiles one key may have queued or running (default: all workers but one)
        self.keys = KeyLimit(per_key if per_key is not None else max(1, workers - 1))
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str, bool], cf.Future[Any]] = OrderedDict()
        self._sizes: dict[tuple[str, str, bool], int] = {}  # compiled entries' bytes
        self._pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="radixkv-grammar")
        self._info: Any = None
        self._info_json: str | None = None
        self._compiler: Any = None
        self._info_lock = threading.Lock()
        self.workers = int(workers)
        #: one compile process a worker thread, started with the vocabulary (compiler())
        self.children = ChildPool("radixkv.engine.grammar_worker", memory_bytes, workers)
        self._spawn_lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def per_key(self) -> int:
        """Compiles one key may have queued or running."""
        return self.keys.limit

    @property
    def killed(self) -> int:
        """Compile processes stopped at the time or memory bound (or found dead)."""
        return self.children.killed

    def tokenizer_info(self) -> Any:
        """xgrammar's ``TokenizerInfo`` of the vocabulary (built on first use; the children get
        it serialized)."""
        with self._info_lock:
            if self._info is None:
                import xgrammar as xgr

                hf = getattr(self.tokenizer, "wrapped", self.tokenizer)
                lock = getattr(self.tokenizer, "lock", None)
                with lock if lock is not None else contextlib.nullcontext():
                    try:
                        info = xgr.TokenizerInfo.from_huggingface(
                            hf, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                        )
                    except Exception as exc:
                        raise ValueError(
                            "structured outputs need a Hugging Face tokenizer; this model's "
                            f"tokenizer ({type(hf).__name__}) could not be read: {exc}"
                        ) from exc
                self._info_json = info.serialize_json()
                self._info = info
            return self._info

    def compiler(self) -> Any:
        """xgrammar's ``GrammarCompiler`` over the vocabulary (built on first use), after
        starting the ``workers`` child processes (each imports xgrammar, ~2 s on the AVX2 Zen 3
        host, while the caller goes on). Idempotent."""
        import xgrammar as xgr

        info = self.tokenizer_info()
        with self._spawn_lock:
            try:
                self.children.start({"tokenizer_info": self._info_json})
            except RuntimeError as exc:  # closed
                raise ValueError("the grammar compiler is closing") from exc
            if self._compiler is None:
                # no xgrammar-side cache: this pool's LRU is the one bound
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def submit(self, spec: StructuredOutputs, owner: Hashable = None) -> cf.Future[Any]:
        """The compile of ``spec`` (validated): a cached ``Future``, or a new one queued.
        Raises :class:`CompileQueueFullError` when ``owner`` (a key; None: no per-key bound)
        already has ``per_key`` compiles queued or running."""
        key = spec.key()
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return fut
            if not self.keys.acquire(owner):
                raise CompileQueueFullError(
                    f"this API key already has {self.keys.in_flight(owner)} structured output "
                    f"constraint(s) compiling (the limit per key is {self.per_key}); retry when "
                    "they have finished"
                )
            self.misses += 1
            fut = self._pool.submit(self._compile, spec)
            self._cache[key] = fut
            self._evict()
        fut.add_done_callback(lambda _f: self.keys.release(owner))
        return fut

    def _evict(self) -> None:
        """Drop least recently used entries past either bound (the lock held); the newest
        stays. Waiters keep their own reference to a dropped future."""
        while len(self._cache) > 1 and (
            len(self._cache) > self.cache_size or sum(self._sizes.values()) > self.cache_bytes
        ):
            key, _ = self._cache.popitem(last=False)
            self._sizes.pop(key, None)

    @property
    def cached_bytes(self) -> int:
        """Bytes of the compiled grammars in the cache."""
        with self._lock:
            return sum(self._sizes.values())

    def compile(self, spec: StructuredOutputs, timeout: float = COMPILE_TIMEOUT_S) -> Any:
        """The compiled grammar of ``spec``, waiting up to ``timeout`` seconds; ``ValueError``
        naming the problem when it does not compile or takes longer."""
        fut = self.submit(spec)
        try:
            return fut.result(timeout)
        except cf.TimeoutError:
            raise ValueError(timeout_message(spec, timeout)) from None
        except cf.CancelledError:
            raise ValueError(failure(fut) or "cancelled") from None

    def _compile(self, spec: StructuredOutputs) -> Any:
        compiled = self._compile_uncached(spec)
        key = spec.key()
        with self._lock:
            if key in self._cache:  # not dropped while compiling
                self._sizes[key] = int(compiled.memory_size_bytes)
                self._evict()
        return compiled

    def _compile_uncached(self, spec: StructuredOutputs) -> Any:
        """Probe the compile in a child process (bounded; started on first use, replaced after
        it is killed at a bound or dies), then compile here (see the module docstring)."""
        kind, text, compact = spec.key()
        job: dict[str, Any] = {"kind": kind, "text": text, "compact": compact}
        if kind == "choice":
            job = {"kind": "grammar", "text": _choice_grammar(list(spec.choice or []))}
        compiler = self.compiler()
        child = self.children.lend()  # one per worker thread: never waits long
        assert child is not None
        try:
            answer = child.ask(job, self.compile_timeout)
        except (OSError, ValueError) as exc:
            answer = {"error": f"its compiler process ended ({exc})", "limit": 1}
        spent = answer is None or answer.get("limit") or answer.get("exit")
        self.children.give_back(child, keep=not spent)  # a spent one is killed and replaced
        if answer is None:
            raise ValueError(timeout_message(spec, self.compile_timeout))
        if "compile_error" in answer:
            raise ValueError(compile_error_message(spec, RuntimeError(answer["compile_error"])))
        if "error" in answer:
            raise ValueError(
                f"the structured output constraint ({spec.describe()}) was stopped: "
                f"{answer['error']} (a compile may take {self.memory_bytes >> 20} MiB); "
                "simplify it"
            )
        try:
            return compile_job(compiler, job)
        except Exception as exc:
            raise ValueError(compile_error_message(spec, exc)) from exc

    def child_pids(self) -> list[int]:
        """The pids of the compiler processes running now."""
        return self.children.pids()

    def check_integrity(self) -> None:
        """Raises ``AssertionError`` unless every key's pending count is in ``(0, per_key]``
        and the cache holds sizes only for cached entries, within its bounds."""
        self.keys.check_integrity()
        self.children.check_integrity()
        with self._lock:
            assert set(self._sizes) <= set(self._cache), "a size for an uncached entry"
            assert len(self._cache) <= max(1, self.cache_size), len(self._cache)

    def clear(self) -> None:
        """Forget every cached compile (the bench's cold start)."""
        with self._lock:
            self._cache.clear()
            self._sizes.clear()

    def close(self) -> None:
        """Stop the worker threads (queued compiles are cancelled) and their processes."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.children.close()


def timeout_message(spec: StructuredOutputs, timeout: float) -> str:
    """The error for a constraint that did not compile within ``timeout`` seconds."""
    return (
        f"the structured output constraint ({spec.describe()}) did not compile within "
        f"{timeout:g} s; simplify the schema, regex or grammar"
    )


def failure(future: cf.Future[Any]) -> str | None:
    """Why a finished compile failed (its message), or None when it succeeded."""
    if future.cancelled():
        return "the grammar compile was cancelled (the engine is closing)"
    exc = future.exception()
    return None if exc is None else str(exc)
