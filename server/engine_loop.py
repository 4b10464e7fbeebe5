"""The engine thread: the only thread that ever touches the engine.

The engine is single-threaded (see docs/design.md, "Engine step API"). :class:`EngineLoop` owns
it on one background thread that

* takes commands (add, abort, or any ``fn(engine)``) from a thread-safe queue,
* calls ``engine.step()`` in a loop while work exists, and sleeps on a condition otherwise,
* routes each ``StepOutput`` to the asyncio queue of its request with
  ``loop.call_soon_threadsafe`` (one call per step, not per output),
* updates the per-request metrics (TTFT, inter-token latency, end-to-end latency, token counts)
  and the usage of each request's ``owner`` (an API key's id: :meth:`EngineLoop.usage`).

Admission bounds: ``max_waiting`` requests accepted but not yet producing output in all
(:class:`QueueFullError`, 503), and ``max_waiting_per_owner`` of them per owner
(:class:`OwnerLimitError`, 429), so one key cannot fill the queue for every other.

An exception inside ``engine.step()`` never kills the thread: it is logged, every in-flight
request fails with a 500 (its engine request is aborted so its pages are released), and the
loop keeps serving. An error the engine can pin on one request (a ``StepOutput`` with
``error`` set) fails that request alone with a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from radixkv.engine.structured import CompileQueueFullError
from radixkv.model.omp_threads import release_omp_workers

from .metrics import ServerMetrics
from .redaction import internal_error
from .request_log import TrackedRequest, log_finished
from .request_stream import (
    EngineRequestError,
    OwnerLimitError,
    QueueFullError,
    RequestStream,
    StreamFailure,
)

if TYPE_CHECKING:
    from radixkv.engine.api import EngineAPI
    from radixkv.engine.request import StepOutput
    from radixkv.engine.sampling import SamplingParams

__all__ = [
    "EngineLoop",
    "EngineRequestError",
    "OwnerLimitError",
    "QueueFullError",
    "RequestStream",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_STEP_ERROR_BACKOFF_S = 0.05


class EngineLoop:
    """Runs an engine on a dedicated thread and bridges it to an asyncio event loop.

    ``max_waiting`` bounds the number of requests accepted but not yet producing output
    (waiting for a slot or still in prefill); past it :meth:`add_request` raises
    :class:`QueueFullError`. ``None`` means unbounded.
    """

    def __init__(
        self,
        engine: EngineAPI,
        *,
        metrics: ServerMetrics | None = None,
        max_waiting: int | None = None,
        max_waiting_per_owner: int | None = None,
        log_requests: bool = False,
    ) -> None:
        self.engine = engine
        #: one INFO line per finished request (ids, token counts, latencies; never its text)
        self.log_requests = log_requests
        self.metrics = metrics or ServerMetrics()
        self.max_waiting = max_waiting
        self.max_waiting_per_owner = max_waiting_per_owner
        self._commands: deque[Callable[[], None]] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Engine-thread only.
        self._tracked: dict[str, TrackedRequest] = {}
        # Event-loop-thread only: accepted requests that have produced no output yet.
        self._not_started: set[str] = set()
        self._streams: dict[str, RequestStream] = {}
        self._owner_of: dict[str, str] = {}  # not-started request -> its owner
        self._waiting_by_owner: Counter[str] = Counter()
        # Engine-thread only: owner -> usage counters (read them through call()).
        self._usage: dict[str, Counter[str]] = {}

    # ---------------------------------------------------------------- lifecycle

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; outputs are delivered to ``loop`` (default: the running one)."""
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._stopping = False
        # the engine thread takes over torch's parallel work: the OpenMP workers of the thread
        # that loaded the model would make libgomp throttle the engine's workers' spin-waits
        release_omp_workers()
        self._thread = threading.Thread(target=self._run, name="radixkv-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread after the current step; in-flight requests fail with 503."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("engine thread did not stop within %.0f s", timeout)
        self._thread = None

    @property
    def idle(self) -> bool:
        """Whether the engine has nothing in flight and no command queued (any thread; a
        snapshot, for background work that must not compete with steps)."""
        return not self._tracked and not self._commands

    @property
    def alive(self) -> bool:
        """Whether the engine thread is running."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_pending(self) -> int:
        """Requests accepted that have produced no output yet (event-loop view)."""
        return len(self._not_started)

    @property
    def num_in_flight(self) -> int:
        """Requests accepted and not finished (event-loop view)."""
        return len(self._streams)

    # ---------------------------------------------------------------- asyncio-side API

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        salt: str | None = None,
        arrival: float | None = None,
        owner: str | None = None,
    ) -> RequestStream:
        """Queue a request on the engine thread and wait until the engine accepted it.

        Raises ``ValueError`` (engine validation, answered 400), :class:`QueueFullError` (503),
        :class:`OwnerLimitError` (429: ``owner`` has ``max_waiting_per_owner`` waiting) or
        :class:`EngineRequestError`. If the caller is cancelled meanwhile, the request is aborted.
        """
        if self.max_waiting is not None and len(self._not_started) >= self.max_waiting:
            raise QueueFullError(
                f"the server is overloaded: {len(self._not_started)} requests are already "
                f"waiting (max_waiting={self.max_waiting}); retry later"
            )
        limit = self.max_waiting_per_owner
        if owner is not None and limit is not None and self._waiting_by_owner[owner] >= limit:
            raise OwnerLimitError(
                f"this API key already has {self._waiting_by_owner[owner]} requests waiting for "
                f"their first token (the limit per key is {limit}); retry when some have started"
            )
        if not self.alive:
            raise EngineRequestError(503, "the engine thread is not running")
        loop = asyncio.get_running_loop()
        stream = RequestStream(
            request_id=request_id,
            n=max(1, int(params.n or 1)),
            arrival=arrival if arrival is not None else time.monotonic(),
        )
        accepted: asyncio.Future[None] = loop.create_future()
        self._not_started.add(request_id)
        self._streams[request_id] = stream
        if owner is not None:
            self._owner_of[request_id] = owner
            self._waiting_by_owner[owner] += 1

        def command() -> None:
            self._do_add(stream, prompt, params, salt, accepted, owner)

        self._submit(command)
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except BaseException:
            self._forget(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished). Safe from the event loop only."""
        self._forget(request_id)
        self._submit(lambda: self._do_abort(request_id))

    def release(self, request_id: str) -> None:
        """Forget a request whose stream completed normally."""
        self._forget(request_id)

    async def call(self, fn: Callable[[EngineAPI], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between two steps and return its result."""
        if not self.alive:
            raise EngineRequestError(503, "the engine thread is not running")
        loop = asyncio.get_running_loop()
        result: asyncio.Future[T] = loop.create_future()

        def command() -> None:
            try:
                value = fn(self.engine)
            except BaseException as exc:  # handed to the caller, not raised here
                self._resolve(result, exc=exc)
            else:
                self._resolve(result, value=value)

        self._submit(command)
        return await result

    def call_sync(self, fn: Callable[[EngineAPI], T], timeout: float | None = 60.0) -> T:
        """Run ``fn(engine)`` on the engine thread from any *other* thread and wait for it.

        For tests, tooling and the CLI; never call it from the event loop (it blocks).
        """
        if not self.alive:
            raise EngineRequestError(503, "the engine thread is not running")
        done = threading.Event()
        box: dict[str, Any] = {}

        def command() -> None:
            try:
                box["value"] = fn(self.engine)
            except BaseException as exc:  # handed to the caller
                box["exc"] = exc
            finally:
                done.set()

        self._submit(command)
        if not done.wait(timeout):
            raise TimeoutError(f"engine thread did not run the call within {timeout} s")
        if "exc" in box:
            raise box["exc"]
        return box["value"]

    # ---------------------------------------------------------------- internals (any thread)

    def usage(self, owner: str) -> dict[str, int]:
        """What ``owner``'s requests used so far (engine thread: call it through :meth:`call`):
        ``requests``, ``prompt_tokens``, ``cached_tokens``, ``completion_tokens``."""
        got = self._usage.get(owner, Counter())
        keys = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")
        return {k: int(got[k]) for k in keys}

    def _started(self, request_id: str) -> None:
        """``request_id`` produced output, failed or left: it no longer counts as waiting."""
        self._not_started.discard(request_id)
        owner = self._owner_of.pop(request_id, None)
        if owner is not None:
            self._waiting_by_owner[owner] -= 1
            if self._waiting_by_owner[owner] <= 0:
                del self._waiting_by_owner[owner]

    def _forget(self, request_id: str) -> None:
        self._started(request_id)
        self._streams.pop(request_id, None)

    def _submit(self, command: Callable[[], None]) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def _resolve(
        self,
        future: asyncio.Future[Any],
        *,
        value: Any = None,
        exc: BaseException | None = None,
    ) -> None:
        """Complete an asyncio future from the engine thread."""

        def done() -> None:
            if future.done():
                return
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(value)

        self._call_in_loop(done)

    def _call_in_loop(self, fn: Callable[[], None]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # loop closed meanwhile (shutdown)
            loop.call_soon_threadsafe(fn)

    # ---------------------------------------------------------------- engine thread

    def _busy(self) -> bool:
        if self._tracked:
            return True
        try:
            return bool(self.engine.has_unfinished())
        except Exception:  # pragma: no cover - defensive
            logger.exception("engine.has_unfinished() failed")
            return False

    def _run(self) -> None:
        logger.info("engine thread started")
        try:
            self._loop_forever()
        except Exception:  # never leave streams hanging on a dead thread
            logger.exception("engine thread crashed")
            self._fail_all(500, "the engine thread crashed; see the server log")
            raise

    def _loop_forever(self) -> None:
        while True:
            with self._cond:
                while not self._commands and not self._stopping and not self._busy():
                    self._cond.wait()
                if self._stopping:
                    break
                commands = list(self._commands)
                self._commands.clear()
            for command in commands:
                try:
                    command()
                except Exception:  # a command must never take the thread down
                    logger.exception("engine command failed")
            if self._busy():
                self._step()
        self._fail_all(503, "the server is shutting down")
        logger.info("engine thread stopped")

    def _do_add(
        self,
        stream: RequestStream,
        prompt: str | list[int],
        params: SamplingParams,
        salt: str | None,
        accepted: asyncio.Future[None],
        owner: str | None = None,
    ) -> None:
        rid = stream.request_id
        try:
            self.engine.add_request(rid, prompt, params, salt=salt, owner=owner)
        except ValueError as exc:
            self._resolve(accepted, exc=exc)
            return
        except CompileQueueFullError as exc:  # this key's grammar compiles: a 429
            self._resolve(accepted, exc=OwnerLimitError(str(exc)))
            return
        except Exception as exc:
            why = internal_error(f"engine.add_request({rid}) failed: {exc!r}")  # + traceback
            self._resolve(accepted, exc=EngineRequestError(500, why))
            return
        self._tracked[rid] = TrackedRequest(
            stream=stream, n=stream.n, arrival=stream.arrival, owner=owner,
            max_tokens=params.max_tokens,
        )  # fmt: skip
        if owner is not None:
            self._usage.setdefault(owner, Counter())["requests"] += 1
        self._resolve(accepted)

    def _do_abort(self, request_id: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return  # already finished, failed, or never accepted
        try:
            self.engine.abort(request_id)
        except Exception:
            logger.exception("engine.abort(%s) failed", request_id)
        self.metrics.requests.labels(finish_reason="abort").inc()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self.metrics.engine_errors.inc()
            why = internal_error(  # logs the traceback under the id the clients get
                f"engine.step() raised {type(exc).__name__}: {exc}; failing "
                f"{len(self._tracked)} in-flight requests"
            )
            self._fail_all(500, why)
            time.sleep(_STEP_ERROR_BACKOFF_S)  # no hot loop if the engine keeps failing
            return
        if outputs:
            self._dispatch(outputs)

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        now = time.monotonic()
        batch: list[tuple[RequestStream, StepOutput | StreamFailure]] = []
        m = self.metrics
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue  # aborted meanwhile
            if out.error:  # the engine failed this request alone; the others go on
                del self._tracked[out.request_id]
                m.requests.labels(finish_reason="error").inc()
                batch.append(
                    (
                        tracked.stream,
                        StreamFailure(
                            500, internal_error(f"request {out.request_id}: {out.error}")
                        ),
                    )
                )
                continue
            index = int(out.index or 0)
            new_tokens = len(out.new_token_ids or ())
            if not tracked.prompt_recorded:
                tracked.prompt_recorded = True
                tracked.prompt_tokens = int(out.prompt_tokens or 0)
                tracked.cached_tokens = int(out.cached_tokens or 0)
                m.record_prompt(
                    int(out.prompt_tokens or 0),
                    int(out.cached_tokens or 0),
                    out.cached_tokens_by_tier,
                )
                if tracked.owner is not None:
                    usage = self._usage[tracked.owner]  # made by _do_add
                    usage["prompt_tokens"] += int(out.prompt_tokens or 0)
                    usage["cached_tokens"] += int(out.cached_tokens or 0)
            if new_tokens:
                tracked.generated += new_tokens
                m.record_generated(new_tokens)
                if tracked.owner is not None:
                    self._usage[tracked.owner]["completion_tokens"] += new_tokens
                m.record_token(tracked, index, now)
            if tracked.queue_time is None:
                tracked.queue_time = out.queue_time
            if tracked.prefill_time is None:
                tracked.prefill_time = out.prefill_time
            if out.finished:
                tracked.finished.add(index)
                tracked.reasons.append(str(out.finish_reason or "stop"))
                m.requests.labels(finish_reason=str(out.finish_reason or "stop")).inc()
                if len(tracked.finished) >= tracked.n:
                    del self._tracked[out.request_id]
                    m.record_finished(tracked, now)
                    if self.log_requests:
                        log_finished(out.request_id, tracked, now)
            batch.append((tracked.stream, out))
        if batch:
            self._call_in_loop(lambda: self._deliver(batch))

    def _deliver(self, batch: list[tuple[RequestStream, StepOutput | StreamFailure]]) -> None:
        """Event-loop side of :meth:`_dispatch`."""
        for stream, item in batch:
            self._started(stream.request_id)
            stream.queue.put_nowait(item)

    def _fail_all(self, status_code: int, message: str) -> None:
        """Fail every tracked request and abort it in the engine (engine thread)."""
        failed = list(self._tracked.items())
        self._tracked.clear()
        batch: list[tuple[RequestStream, StepOutput | StreamFailure]] = []
        for rid, tracked in failed:
            try:
                self.engine.abort(rid)
            except Exception:
                logger.exception("engine.abort(%s) failed while failing requests", rid)
            self.metrics.requests.labels(finish_reason="error").inc()
            batch.append((tracked.stream, StreamFailure(status_code, message)))
        if batch:
            self._call_in_loop(lambda: self._deliver(batch))
