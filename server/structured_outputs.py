"""From a request's constraint fields (:mod:`radixkv.server.structured_fields`) to the engine's
:class:`~radixkv.engine.structured.StructuredOutputs`, compiled before the request is queued.

Invariants: a request carries at most one constraint (two different fields is a 400 naming
both); a constraint that does not compile, or not within the engine's compile bound
(:data:`~radixkv.engine.grammar.COMPILE_TIMEOUT_S`), is a 400 naming the problem before the
engine sees the request, so no batch ever waits on it. Compiling runs on the engine's grammar
worker threads, never on the event loop or the engine thread.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from radixkv.engine.structured import CompileQueueFullError, StructuredOutputs

from .protocol import APIError

if TYPE_CHECKING:
    from radixkv.engine.api import EngineAPI
    from radixkv.engine.sampling import SamplingParams

__all__ = ["compile_constraint", "structured_kwargs"]


def _sources(body: Any) -> list[tuple[str, StructuredOutputs]]:
    """Every constraint ``body`` sets, as ``(field name, constraint)``."""
    found: list[tuple[str, StructuredOutputs]] = []
    rf = getattr(body, "response_format", None)
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", StructuredOutputs(json_object=True)))
    elif rf is not None and rf.type == "json_schema":
        found.append(("response_format", StructuredOutputs(json=rf.json_schema.schema_)))
    so = getattr(body, "structured_outputs", None)
    if so is not None:
        spec = StructuredOutputs(
            json=so.json_,
            regex=so.regex,
            choice=so.choice,
            grammar=so.grammar,
            json_object=bool(so.json_object),
            disable_any_whitespace=so.disable_any_whitespace,
        )
        found.append(("structured_outputs", spec))
    for name, kind in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
        ("json_schema", "json"),  # SGLang /generate (a JSON text)
        ("regex", "regex"),
        ("ebnf", "grammar"),
    ):
        value = getattr(body, name, None)
        if value is not None:
            found.append((name, StructuredOutputs(**{kind: value})))
    return found


def structured_kwargs(body: Any, extra: tuple[str, StructuredOutputs] | None = None) -> dict:
    """``{"structured_outputs": ...}`` for ``SamplingParams`` when ``body`` (or ``extra``, the
    tools' constraint) sets one, else ``{}``; a 400 naming the field when two are set or the
    one set is malformed."""
    found = _sources(body) + ([extra] if extra is not None else [])
    if not found:
        return {}
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise APIError(400, f"give at most one output constraint; got {names}", param=found[1][0])
    name, spec = found[0]
    try:
        spec.validate()
    except ValueError as exc:
        raise APIError(400, f"{name}: {exc}", param=name) from exc
    return {"structured_outputs": spec}


async def compile_constraint(
    engine: EngineAPI, params: SamplingParams, owner: str | None = None
) -> None:
    """Compile ``params.structured_outputs`` (if any) on the engine's grammar workers and wait
    for it here, off the engine thread: a 400 naming the problem when it does not compile or
    takes longer than the engine's bound (the compile is stopped there), a 429 when ``owner``
    (the caller's key) already has its compiles in flight. The engine then finds it in its
    compile cache."""
    spec = params.structured_outputs
    if spec is None:
        return
    grammars = engine.grammars
    if grammars is None:
        raise APIError(400, "this engine does not support structured outputs")
    from radixkv.engine.grammar import WAIT_FACTOR

    try:
        future = grammars.pool.submit(spec, owner)
        # shielded: a client gone must not cancel the cached compile. The compile stops itself
        # at timeout_s (its process is killed); the wait's bound is the backstop for one queued
        # behind other keys' compiles or a compiler process starting
        waited = asyncio.wrap_future(future)
        await asyncio.wait_for(asyncio.shield(waited), grammars.timeout_s * WAIT_FACTOR)
    except CompileQueueFullError as exc:
        raise APIError(429, str(exc), type="rate_limit_error", code="key_limit") from exc
    except asyncio.TimeoutError as exc:
        from radixkv.engine.grammar import timeout_message

        raise APIError(400, timeout_message(spec, grammars.timeout_s * WAIT_FACTOR)) from exc
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
