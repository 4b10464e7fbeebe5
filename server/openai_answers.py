"""From a parsed OpenAI request and its engine outputs to OpenAI's answer: the whole JSON body
(``stream: false``) or the SSE chunks (``stream: true``) of ``/v1/completions`` and
``/v1/chat/completions``.

A request is parsed (:class:`~.routes_openai.OpenAIRoutes`) into a plan, :class:`CompletionPlan`
or :class:`ChatPlan`: its prompt token ids and sampling params, nothing submitted yet. Once its
engine requests are submitted, an answer (:class:`CompletionAnswer`, :class:`ChatAnswer`) turns
their outputs into OpenAI's shapes; it holds no engine state and makes no engine call, so the
same outputs always give the same bytes (but ``created``, the answer's clock second).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .completion_batch import echo_logprobs, merged, summed_usage
from .intake import now
from .logprob_format import chat_logprobs, completion_logprobs, vllm_prompt_logprobs
from .protocol import ChatCompletionRequest, CompletionRequest
from .reasoning import ReasoningParser, ReasoningStream, split_reasoning
from .streaming import SSE_DONE, Collected, Seq, sse
from .tool_calls import ToolCallStream, ToolPlan

if TYPE_CHECKING:
    from radixkv.engine.sampling import SamplingParams

    from .engine_loop import RequestStream

#: a token id's text, for logprobs (:meth:`~.context.ServerContext.token_str`)
TokenStr = Callable[[int], str]


def prompt_logprobs(
    result: Collected, prompt_ids: list[int] | None, k: int, token_str: TokenStr
) -> Any:
    """vLLM's ``prompt_logprobs`` of one engine request (None when it has none)."""
    if result.prompt_logprobs is None or prompt_ids is None:
        return None
    return vllm_prompt_logprobs(prompt_ids, result.prompt_logprobs, k, token_str)


def _include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def envelope(
    rid: str, obj: str, created: int, model: str, choices: list[Any], with_usage: bool, usage: Any
) -> dict[str, Any]:
    """An answer or chunk of OpenAI's shape, its keys in OpenAI's order (``usage`` last, only
    ``with_usage``)."""
    payload: dict[str, Any] = {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": choices,
    }
    if with_usage:
        payload["usage"] = usage
    return payload


# ---------------------------------------------------------------- /v1/completions


@dataclass
class CompletionPlan:
    """A parsed ``/v1/completions`` request: one engine request per prompt (``plans[p]``: its
    token ids and sampling params), each with ``body.n`` choices; choice ``i`` of prompt ``p``
    is answered at index ``p * n + i``."""

    body: CompletionRequest
    prompts: list[str | list[int]]
    plans: list[tuple[list[int], SamplingParams]]

    @property
    def zero(self) -> bool:
        """``max_tokens: 0`` (with echo): the prompt alone is answered, the one token run is
        not (:mod:`.completion_batch`)."""
        return self.body.max_tokens == 0

    @property
    def want_logprobs(self) -> bool:
        return self.body.logprobs is not None

    @property
    def top(self) -> int:
        """The logprobs' top-k (0: the chosen token's alone)."""
        return self.body.logprobs or 0

    @property
    def echo_lp(self) -> bool:
        """Echo with logprobs: the prompt's logprobs lead each choice's."""
        return self.body.echo and self.want_logprobs


@dataclass
class CompletionAnswer:
    """The answer of one :class:`CompletionPlan` whose engine requests went out as ``rid``
    (``echoed[p]``: prompt ``p``'s echoed text, "" without echo)."""

    plan: CompletionPlan
    rid: str
    echoed: list[str]
    model: str
    token_str: TokenStr
    created: int = field(default_factory=now)

    def choice_logprobs(self, p: int, result: Collected, ids: list[int], lps: list[Any]) -> Any:
        plan = self.plan
        if plan.echo_lp:
            prompt_ids = plan.plans[p][0]
            return echo_logprobs(
                prompt_ids, result.prompt_logprobs, ids, lps, plan.top, self.token_str
            )
        if plan.want_logprobs:
            return completion_logprobs(ids, lps, plan.top, self.token_str, 0)
        return None

    def whole(self, results: Sequence[Collected]) -> dict[str, Any]:
        """The JSON answer, ``results[p]`` prompt ``p``'s collected outputs."""
        plan, body, n = self.plan, self.plan.body, self.plan.body.n
        zero = plan.zero
        choices = []
        for p, result in enumerate(results):
            for i, seq in enumerate(result.seqs):
                ids, lps, text = ([], [], "") if zero else (seq.token_ids, seq.logprobs, seq.text)
                choice = {
                    "index": p * n + i,
                    "text": self.echoed[p] + text,
                    "logprobs": self.choice_logprobs(p, result, ids, lps),
                    "finish_reason": "length" if zero else seq.finish_reason,
                    "stop_reason": None if zero else seq.stop_reason,
                }
                if body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs(
                        result, plan.plans[p][0], body.prompt_logprobs, self.token_str
                    )
                choices.append(choice)
        usage = summed_usage(results, completion=not zero)
        return envelope(self.rid, "text_completion", self.created, self.model, choices, True, usage)

    def text_chunk(
        self, index: int, text: str, logprobs: Any = None, finish: Any = None, stop: Any = None
    ) -> dict[str, Any]:
        """One streamed chunk of choice ``index``."""
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None or stop is not None:
            choice["stop_reason"] = stop
        with_usage = _include_usage(self.plan.body)
        return envelope(
            self.rid, "text_completion", self.created, self.model, [choice], with_usage, None
        )

    async def stream(self, streams: Sequence[RequestStream]) -> AsyncIterator[str]:
        """The SSE chunks, ``streams[p]`` prompt ``p``'s engine request, ending with
        ``[DONE]``."""
        plan, n, echoed = self.plan, self.plan.body.n, self.echoed
        zero, top, token_str = plan.zero, plan.top, self.token_str
        results = [Collected(seqs=[Seq() for _ in range(n)]) for _ in plan.plans]
        # the echo goes first; with logprobs once the prompt's logprobs are known (they come
        # with its first output)
        echo_due = set(range(len(plan.plans))) if plan.body.echo else set()
        if not plan.echo_lp:
            for p in sorted(echo_due):
                for i in range(n):
                    yield sse(self.text_chunk(p * n + i, echoed[p]))
            echo_due.clear()
        async for p, out in merged([st.outputs() for st in streams]):
            result = results[p]
            local = int(out.index or 0)
            seq = result.seqs[local]
            offset = len(echoed[p]) + len(seq.text) if plan.echo_lp else len(seq.text)
            result.add(out)
            if p in echo_due:
                echo_due.discard(p)
                for i in range(n):
                    elp = echo_logprobs(plan.plans[p][0], result.prompt_logprobs, [], [], top,
                                        token_str)  # fmt: skip
                    yield sse(self.text_chunk(p * n + i, echoed[p], elp))
            if zero:  # the one token run is not the answer
                if out.finished:
                    yield sse(self.text_chunk(p * n + local, "", None, "length"))
                continue
            if not (out.new_text or out.finished or out.new_token_ids):
                continue
            lp = (
                completion_logprobs(
                    list(out.new_token_ids or ()), list(out.logprobs or ()), top, token_str, offset
                )
                if plan.want_logprobs
                else None
            )
            finish = out.finish_reason if out.finished else None
            yield sse(
                self.text_chunk(p * n + local, out.new_text or "", lp, finish, out.stop_reason)
            )
        if _include_usage(plan.body):
            usage = summed_usage(results, completion=not zero)
            yield sse(
                envelope(self.rid, "text_completion", self.created, self.model, [], True, usage)
            )
        yield SSE_DONE


# ---------------------------------------------------------------- /v1/chat/completions


@dataclass
class ChatPlan:
    """A parsed ``/v1/chat/completions`` request: its rendered prompt's token ids and sampling
    params (one engine request, ``body.n`` choices); ``tools``: how its output becomes tool
    calls (None: text); ``reasoner``: how its ``<think>`` block becomes ``reasoning_content``
    (None: it stays in the content)."""

    body: ChatCompletionRequest
    prompt_ids: list[int]
    params: SamplingParams
    tools: ToolPlan | None
    reasoner: ReasoningParser | None

    @property
    def top(self) -> int:
        """The logprobs' top-k (0: the chosen token's alone)."""
        return self.body.top_logprobs or 0


@dataclass
class ChatAnswer:
    """The answer of one :class:`ChatPlan` whose engine request went out as ``rid``."""

    plan: ChatPlan
    rid: str
    model: str
    token_str: TokenStr
    created: int = field(default_factory=now)

    def whole(self, result: Collected) -> dict[str, Any]:
        """The JSON answer of the collected outputs."""
        plan, body = self.plan, self.plan.body
        reasoner, tools = plan.reasoner, plan.tools
        choices = []
        for i, seq in enumerate(result.seqs):
            thought, text = split_reasoning(reasoner, seq.text) if reasoner else (None, seq.text)
            message, finish = (
                tools.message(text or "", seq.finish_reason)
                if tools
                else ({"role": "assistant", "content": text}, seq.finish_reason)
            )
            if reasoner:
                message["reasoning_content"] = thought
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": chat_logprobs(seq.token_ids, seq.logprobs, plan.top, self.token_str)
                    if body.logprobs
                    else None,
                    "finish_reason": finish,
                    "stop_reason": seq.stop_reason,
                }
            )
        usage = result.usage()
        answer = envelope(
            self.rid, "chat.completion", self.created, self.model, choices, True, usage
        )
        if body.prompt_logprobs is not None:  # vLLM's extra: top-level, once per request
            answer["prompt_logprobs"] = prompt_logprobs(
                result, plan.prompt_ids, body.prompt_logprobs, self.token_str
            )
        return answer

    def chunk(
        self, index: int, delta: dict[str, Any], finish: str | None, lp: Any, stop: Any = None
    ) -> str:
        """One streamed SSE chunk of choice ``index``."""
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop
        with_usage = _include_usage(self.plan.body)
        return sse(
            envelope(
                self.rid,
                "chat.completion.chunk",
                self.created,
                self.model,
                [choice],
                with_usage,
                None,
            )
        )

    async def stream(self, stream: RequestStream) -> AsyncIterator[str]:
        """The SSE chunks of the engine request ``stream``: each choice's role first, then its
        deltas, ending with ``[DONE]``."""
        plan, n, chunk = self.plan, self.plan.body.n, self.chunk
        result = Collected(seqs=[Seq() for _ in range(n)])
        for i in range(n):
            result.seqs[i].sent_role = True
            yield chunk(i, {"role": "assistant", "content": ""}, None, None)
        tool_stream = ToolCallStream(plan.tools) if plan.tools else None
        reasoner = plan.reasoner
        thinking = [ReasoningStream(reasoner) for _ in range(n)] if reasoner else None
        async for out in stream.outputs():
            index = int(out.index or 0)
            result.add(out)
            text = out.new_text or ""
            if thinking is not None:  # the <think> block's deltas go as reasoning_content
                thought, text = thinking[index].feed(text)
                if out.finished:
                    rest = thinking[index].finish()
                    thought, text = thought + rest[0], text + rest[1]
                if thought:
                    yield chunk(index, {"reasoning_content": thought}, None, None)
            if tool_stream is not None:  # tool-call deltas instead of content
                stop = out.stop_reason
                for delta, end in tool_stream.deltas(index, text, out.finished, out.finish_reason):
                    yield chunk(index, delta, end, None, stop)
                continue
            lp = (
                chat_logprobs(
                    list(out.new_token_ids or ()),
                    list(out.logprobs or ()),
                    plan.top,
                    self.token_str,
                )
                if plan.body.logprobs and out.new_token_ids
                else None
            )
            if text or lp is not None:
                yield chunk(index, {"content": text}, None, lp)
            if out.finished:
                yield chunk(index, {}, out.finish_reason, None, out.stop_reason)
        if _include_usage(plan.body):
            usage = result.usage()
            obj = "chat.completion.chunk"
            yield sse(envelope(self.rid, obj, self.created, self.model, [], True, usage))
        yield SSE_DONE
