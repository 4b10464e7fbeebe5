"""The child process of :class:`~radixkv.engine.grammar.GrammarCompilerPool`: xgrammar's
compiler over the vocabulary it is given at start (a serialized ``TokenizerInfo``), compiling one
constraint per job as a probe, answering whether it compiled (with its seconds and bytes) or
xgrammar's reason it does not. The compiled grammar stays here: serialized it is far larger
than compiled (a 100-property schema over a 320-token vocabulary: 1.3 MB compiled, 32 MB as
JSON in 1.7 s; 400 properties, 544 MB in 48 s), so the server compiles it again itself once the
probe has shown it finishes within the bounds (:func:`compile_job`, the one compile path). Run as ``python -m
radixkv.engine.grammar_worker`` by :class:`~radixkv.engine.bounded_child.BoundedChild`, which
bounds its time and memory."""

from __future__ import annotations

import time
from typing import Any

from radixkv.engine.bounded_child import serve
from radixkv.engine.structured import MAX_JSON_WHITESPACE

_compiler: Any = None


def _setup(init: dict[str, Any]) -> None:
    global _compiler
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(init["tokenizer_info"])
    # no xgrammar-side cache: the parent's LRU is the one bound
    _compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def compile_job(compiler: Any, job: dict[str, Any]) -> Any:
    """``job`` (``kind``: json, json_object, regex or grammar; ``text``; ``compact``: JSON
    without free whitespace) compiled by xgrammar's ``compiler``."""
    kind, text = job["kind"], job["text"]
    if kind in ("json", "json_object"):
        compact = bool(job.get("compact"))
        return compiler.compile_json_schema(
            text if kind == "json" else '{"type": "object"}',
            any_whitespace=not compact,
            max_whitespace_cnt=None if compact else MAX_JSON_WHITESPACE,
        )
    if kind == "regex":
        return compiler.compile_regex(text)
    return compiler.compile_grammar(text)


def _handle(job: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        compiled = compile_job(_compiler, job)
    except MemoryError:
        raise
    except Exception as exc:  # xgrammar's reason; the parent words it for the client
        if "bad_alloc" in str(exc):  # C++ out of memory, raised as RuntimeError
            raise MemoryError from exc
        return {"compile_error": str(exc) or type(exc).__name__}
    return {"seconds": time.perf_counter() - t0, "bytes": int(compiled.memory_size_bytes)}


if __name__ == "__main__":
    serve(_handle, _setup)
