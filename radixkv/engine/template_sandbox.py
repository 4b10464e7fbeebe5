"""Chat templates a request brings (``--trust-request-chat-template``), rendered in worker
processes whose time and memory are bounded and whose work is stopped at the bound.

A Jinja template is a program: ``{% for i in range(100000) %}`` nested twice, or ``{{ "a" *
10**9 }}``, runs as long or takes as much memory as it likes, and Jinja's sandbox bounds neither.
Rendered in the server's process it holds the GIL (and, before issue 59, the tokenizer lock the
engine thread decodes under); a timeout on the wait would leave the work running. So a request's
own template is rendered here instead:

* **Processes.** :class:`TemplateSandbox` keeps ``workers`` child processes (``python -m
  radixkv.engine.template_sandbox``: transformers' own ``render_jinja_template``, the renderer
  ``apply_chat_template`` uses, and nothing of the engine), each serving one render at a time
  over its stdin/stdout as JSON lines.
* **Time.** A render not answered within ``timeout`` s has its process SIGKILLed (the work
  stops), a fresh one is started in its place, and the caller gets :class:`TemplateLimitError`.
* **Memory.** Each child sets ``RLIMIT_AS`` to its size after start-up plus ``memory_bytes``: a
  template that allocates past it gets a ``MemoryError`` (answered as :class:`TemplateLimitError`;
  the child then exits and is replaced).
* **Output.** Rendered text over ``max_chars`` characters is refused in the child, before it is
  sent back (:class:`TemplateLimitError`).
* **Queueing.** One key has at most ``per_key`` renders in flight (more: :class:`TemplateBusyError`
  with status 429; a keyless server's requests are one tenant, bounded by the pool alone, as the
  grammar compiler's are); a render waits at most ``timeout`` s for a free process (then 503), so the
  queue in front of the pool is bounded in time and one key holds at most ``per_key`` of its
  processes.

The server's own template (the model's or ``--chat-template``) is the operator's and renders in
the calling thread (:func:`radixkv.engine.chat_template.render_chat_text`).

Invariants: every process in the pool is idle or serving exactly one render; a process that timed
out, died or broke the protocol is never reused; ``check_integrity`` holds between calls.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

from radixkv.engine.bounded_child import OUT_OF_MEMORY, serve
from radixkv.engine.child_pool import ChildPool, KeyLimit

__all__ = ["TemplateBusyError", "TemplateLimitError", "TemplateSandbox"]

#: a render's default time bound, seconds
DEFAULT_TIMEOUT = 2.0
#: a render's default memory bound beyond the child's start-up size, bytes
DEFAULT_MEMORY_BYTES = 256 << 20


class TemplateLimitError(ValueError):
    """A request's chat template ran past a bound (time, memory, output size) and was stopped."""


class TemplateBusyError(RuntimeError):
    """No render slot: this key has its renders in flight (``status`` 429) or every process
    stayed busy for the whole wait (503)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class TemplateSandbox:
    """Renders request-supplied chat templates in bounded worker processes (see the module
    docstring).

    Args:
        workers: child processes (each renders one template at a time).
        timeout: seconds a render may run (and may wait for a free process).
        memory_bytes: memory a render may take beyond the child's start-up size.
        max_chars: rendered text longer than this is refused in the child.
        per_key: renders one key may have in flight (key None, a keyless server: no bound but
            the pool's).
    """

    def __init__(
        self,
        workers: int = 2,
        timeout: float = DEFAULT_TIMEOUT,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
        max_chars: int = 1 << 22,
        per_key: int = 1,
    ) -> None:
        if workers < 1 or per_key < 1 or timeout <= 0 or memory_bytes <= 0 or max_chars <= 0:
            raise ValueError("workers, per_key, timeout, memory_bytes and max_chars must be > 0")
        self.timeout = float(timeout)
        self.max_chars = int(max_chars)
        self.keys = KeyLimit(per_key)
        self.children = ChildPool("radixkv.engine.template_sandbox", memory_bytes, workers)
        # started now: their import (~1 s) overlaps the server's start
        self.children.start({})

    @property
    def memory_bytes(self) -> int:
        return self.children.memory_bytes

    @property
    def killed(self) -> int:
        """Processes stopped at a bound (time, memory) or for a broken protocol."""
        return self.children.killed

    def render(
        self,
        *,
        chat_template: str,
        messages: list[dict[str, Any]],
        template_kwargs: Mapping[str, Any],
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: list[dict[str, Any]] | None = None,
        key: Hashable = None,
    ) -> str:
        """``chat_template`` rendered over ``messages`` (transformers' ``render_jinja_template``
        with ``template_kwargs``) in a child process. Raises :class:`TemplateBusyError` when
        ``key`` has ``per_key`` renders in flight or no process frees up within ``timeout``,
        :class:`TemplateLimitError` when the render passes a bound (its process is killed), and
        ``ValueError`` when the template fails."""
        if not self.keys.acquire(key):
            raise TemplateBusyError(
                f"this key already has {self.keys.limit} request chat template(s) rendering; "
                "retry when they have finished",
                429,
            )
        try:
            return self._render(
                {
                    "chat_template": chat_template,
                    "messages": messages,
                    "template_kwargs": dict(template_kwargs),
                    "add_generation_prompt": add_generation_prompt,
                    "continue_final_message": continue_final_message,
                    "tools": tools,
                    "max_chars": self.max_chars,
                }
            )
        finally:
            self.keys.release(key)

    def _render(self, request: dict[str, Any]) -> str:
        worker = self.children.lend(self.timeout)
        if worker is None:
            raise TemplateBusyError(
                f"every chat template process stayed busy for {self.timeout:g} s; retry later", 503
            )
        keep = False
        try:
            try:
                answer = worker.ask(request, self.timeout)
            except (OSError, ValueError) as exc:
                raise TemplateLimitError(
                    f"the chat template's process ended while rendering ({exc}); a template "
                    f"may use {self.memory_bytes >> 20} MiB"
                ) from exc
            if answer is None:
                raise TemplateLimitError(
                    f"the chat template ran past {self.timeout:g} s and was stopped"
                )
            if answer.get("limit"):
                raise TemplateLimitError(str(answer["error"]))
            keep = not answer.get("exit")
            if "error" in answer:
                raise ValueError(str(answer["error"]))
            return str(answer["text"])
        finally:
            self.children.give_back(worker, keep)

    def pids(self) -> list[int]:
        """The pids of the pool's processes (idle and busy)."""
        return self.children.pids()

    def check_integrity(self) -> None:
        """Raises ``AssertionError`` unless every key's in-flight count is in ``(0, per_key]``
        and no process is both idle and busy."""
        self.keys.check_integrity()
        self.children.check_integrity()

    def close(self) -> None:
        """Kill every process (busy ones when their render returns); idempotent."""
        self.children.close()


# ----------------------------------------------------------------------------- the child


def _answer(request: dict[str, Any]) -> dict[str, Any]:
    from transformers.utils.chat_template_utils import (
        _normalize_chat_messages,
        render_jinja_template,
    )

    try:
        rendered, _ = render_jinja_template(
            conversations=[_normalize_chat_messages(request["messages"])],
            tools=request.get("tools"),
            chat_template=request["chat_template"],
            add_generation_prompt=request["add_generation_prompt"],
            continue_final_message=request["continue_final_message"],
            **request["template_kwargs"],
        )
        text = rendered[0]
    except MemoryError:
        return {**OUT_OF_MEMORY, "error": "the chat template ran out of its memory and was stopped"}
    except Exception as exc:  # the template's (or its messages') fault, as transformers says
        return {"error": f"cannot apply the chat template: {exc}"}
    if len(text) > request["max_chars"]:
        return {
            "error": f"the chat template rendered {len(text)} characters, over the "
            f"{request['max_chars']} a render may return",
            "limit": 1,
        }
    return {"text": text}


def _setup(init: dict[str, Any]) -> None:
    import transformers.utils.chat_template_utils  # noqa: F401  (before the memory bound)


if __name__ == "__main__":
    serve(_answer, _setup)
