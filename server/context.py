"""The shared request path of every route family: model check, submit (with the queue's
4xx/503 answers), collect a whole answer, guard a stream (abort on disconnect or error)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from radixkv.engine.pinning import PinnedCapacityError

from .engine_loop import (
    EngineLoop,
    EngineRequestError,
    OwnerLimitError,
    QueueFullError,
    RequestStream,
)
from .intake import named_field
from .metrics import ServerMetrics
from .protocol import APIError, error_body
from .streaming import SSE_DONE, ClientDisconnected, Collected, Seq, sse, unless_disconnected
from .tenancy import REQUEST_CALLER, effective_salt

if TYPE_CHECKING:
    from radixkv.engine.api import EngineAPI
    from radixkv.engine.sampling import SamplingParams


@dataclass
class ServerContext:
    """What the routes of one app share: the engine, its loop thread, metrics and names.

    ``auth`` is the ``dependencies`` list of every route that needs an API key (all but
    ``/health``), ``admin`` that of the admin routes; ``accepted_names`` are the model names
    requests may ask for; ``keyed``: the server has keys (requests then count against their
    key's waiting limit and usage).
    """

    engine: EngineAPI
    engine_loop: EngineLoop
    metrics: ServerMetrics
    served_name: str
    accepted_names: set[str]
    created: int
    auth: list[Any]
    admin: list[Any] = field(default_factory=list)
    #: Every name ``/v1/models`` lists (``served_name`` first).
    served_names: list[str] = field(default_factory=list)
    #: The dashboard's ring buffer of cache samples (:class:`.stats_history.StatsHistory`).
    history: Any = None
    keyed: bool = False
    #: chat requests may bring their own ``chat_template`` (``--trust-request-chat-template``)
    trust_request_chat_template: bool = False
    #: where those templates render (:class:`~radixkv.engine.template_sandbox.TemplateSandbox`,
    #: started with the app when they are trusted)
    template_sandbox: Any = None
    #: the reasoning parser (``--reasoning-parser``; :mod:`.reasoning`), or None
    reasoning: Any = None
    #: the tool-call parser of ``tool_choice: "auto"`` (``--tool-call-parser``), or None
    tool_parser: str | None = None

    def check_model(self, name: str | None) -> None:
        """A request's ``model``: None (the served model) or one of ``accepted_names``."""
        if name is not None and name not in self.accepted_names:
            raise APIError(
                404,
                f"The model `{name}` does not exist. This server serves `{self.served_name}`.",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )

    def owner(self) -> str | None:
        """The calling key's id, for per-key bounds (None on a keyless server: one trust
        domain)."""
        caller = REQUEST_CALLER.get()
        return caller.key_id if self.keyed and caller is not None else None

    def template_options(self, body: Any) -> dict[str, Any]:
        """A chat body's template options (``ChatTemplateFields``); its own ``chat_template``
        is a 400 unless the server trusts request templates, and renders in the template
        sandbox, bounded in time and memory, one render in flight per key (issue 59)."""
        options = dict(body.template_options())
        if body.chat_template is None:
            return options
        if not self.trust_request_chat_template:
            raise APIError(
                400,
                "a chat_template in the request is refused: this server was not started with "
                "--trust-request-chat-template",
                param="chat_template",
            )
        if self.template_sandbox is None:
            raise APIError(503, "the chat template sandbox is not running", type="server_error")
        options["sandbox"] = self.template_sandbox
        options["sandbox_key"] = self.owner()
        return options

    async def submit(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        salt: str | None,
        arrival: float,
    ) -> RequestStream:
        salt = effective_salt(salt)  # with tenants (salt_from_api_key): the caller's namespace
        owner = self.owner()
        try:
            return await self.engine_loop.add_request(
                request_id, prompt, params, salt=salt, arrival=arrival, owner=owner
            )
        except PinnedCapacityError as exc:  # capacity, not a bad request: it may fit later
            self.metrics.rejected.labels(reason="pinned_capacity").inc()
            raise APIError(503, str(exc), type="server_error", code="pinned_capacity") from exc
        except ValueError as exc:
            self.metrics.rejected.labels(reason="invalid").inc()
            raise APIError(400, str(exc), param=named_field(exc)) from exc
        except OwnerLimitError as exc:
            self.metrics.rejected.labels(reason="key_limit").inc()
            raise APIError(429, str(exc), type="rate_limit_error", code="key_limit") from exc
        except QueueFullError as exc:
            self.metrics.rejected.labels(reason="queue_full").inc()
            raise APIError(503, str(exc), type="server_error", code="queue_full") from exc
        except EngineRequestError as exc:
            raise APIError(exc.status_code, exc.message, type="server_error") from exc

    async def collect(self, request: Request, stream: RequestStream, n: int) -> Collected:
        """Gather a whole request; abort it if the client disconnects."""
        result = Collected(seqs=[Seq() for _ in range(n)])

        async def consume() -> None:
            async for out in stream.outputs():
                result.add(out)

        try:
            await unless_disconnected(request, consume())
        except ClientDisconnected:
            self.engine_loop.abort(stream.request_id)
            raise
        except EngineRequestError as exc:
            self.engine_loop.release(stream.request_id)
            raise APIError(exc.status_code, exc.message, type="server_error") from exc
        except BaseException:
            self.engine_loop.abort(stream.request_id)
            raise
        self.engine_loop.release(stream.request_id)
        return result

    async def guarded_stream(
        self,
        streams: RequestStream | Sequence[RequestStream],
        body: Callable[[], AsyncIterator[str]],
    ) -> AsyncIterator[str]:
        """Run a streaming body over one engine request or several (a completions request's
        prompts); on disconnect or error they are aborted."""
        streams = [streams] if isinstance(streams, RequestStream) else list(streams)
        completed = False
        try:
            async for chunk in body():
                yield chunk
            completed = True
        except EngineRequestError as exc:
            # the loop already dropped the failed request; others of the batch are aborted
            completed = len(streams) == 1
            yield sse(error_body(exc.message, type="server_error", code=exc.status_code))
            yield SSE_DONE
        finally:
            for stream in streams:
                if completed:
                    self.engine_loop.release(stream.request_id)
                else:
                    self.engine_loop.abort(stream.request_id)

    def token_str(self, token_id: int) -> str:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            return f"<{token_id}>"
        return str(tokenizer.decode([token_id]))
