"""Cost of structured outputs (xgrammar): the batch-64 decode step with every row constrained vs
none, and grammar compile time cold vs cached.

Decode: ``--batch`` (64) chat requests on SmolLM2-135M-Instruct (the host's default dtype: bf16
with native bf16, else float32; ``--dtype`` to choose), greedy, decoding
together; once every prompt is prefilled, the median wall time of ``--steps`` engine steps
(forward, masks, sampling) is taken twice, with no constraint and with every row constrained to
a JSON schema whose one long string keeps every row in the grammar for the whole measurement.
Printed: both medians, their ratio (target <= 1.15x), and the grammar's own share of a
constrained step on the engine thread (starting the bitmask fill, which then runs beside the
forward pass; waiting for what the forward did not hide; the apply; accepting the sampled
tokens).

Compile: each of a few schemas, regexes and a grammar compiled on a cleared cache (cold) and
again (cached, the LRU's hit), medians; the one-off vocabulary read (xgrammar's TokenizerInfo of
the 49,152-token vocabulary) is printed apart. The host's ISA and torch threads are printed.

Run from the repository root: ``python -m bench.bench_structured`` (``--batch N``,
``--steps N``, ``--rounds N``: rounds of unconstrained then constrained steps, interleaved).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from radixkv import Engine, SamplingParams, StructuredOutputs
from radixkv.engine.grammar import GrammarCompilerPool, GrammarState
from radixkv.model import native

LONG_TEXT = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 400, "maxLength": 800}},
    "required": ["story"],
}
COMPILE_CASES: list[StructuredOutputs] = [
    StructuredOutputs(json=LONG_TEXT),
    StructuredOutputs(
        json={
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 20},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 5},
                "address": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"],
                },
            },
            "required": ["name", "age"],
        }
    ),
    StructuredOutputs(json_object=True),
    StructuredOutputs(regex=r"[a-z]{1,8}@[a-z]{1,8}\.(com|org|net)"),
    StructuredOutputs(choice=["red", "green", "blue", "yellow"]),
    StructuredOutputs(grammar='root ::= item ("," item)*\nitem ::= [a-z]+'),
]


class Timer:
    """Wall time summed over calls of the wrapped functions (reset per step)."""

    def __init__(self) -> None:
        self.total = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - start

        return timed


def decode_steps(
    engine: Engine,
    batch: int,
    steps: int,
    spec: StructuredOutputs | None,
    timer: Timer,
    skip: int = 0,
) -> tuple[list[float], list[float]]:
    """Per-step wall seconds and grammar seconds of ``steps`` decode steps of ``batch`` rows,
    after ``skip`` decode steps (0: from the first token, where a JSON grammar is in its
    structural states; 16: inside the schema's long string)."""
    prompt = engine.apply_chat_template([{"role": "user", "content": "Tell me a long story."}])
    params = SamplingParams(
        max_tokens=steps + skip + 8, temperature=0.0, ignore_eos=True, structured_outputs=spec
    )
    engine.grammars.wait_all([params])
    for i in range(batch):
        engine.add_request(f"bench-{spec is not None}-{i}", prompt, params)
    while engine.scheduler.waiting or any(s.in_prefill for s in engine.scheduler.running):
        engine.step()
    engine.step()  # the first decode (a few rows may still take their first token)
    for _ in range(skip):
        engine.step()
    walls, grammar = [], []
    for _ in range(steps):
        timer.total = 0.0
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
        grammar.append(timer.total)
        assert len(engine.scheduler.running) == batch, "a row finished during the measurement"
    while engine.has_unfinished():
        engine.step()
    return walls, grammar


def bench_compile(engine: Engine) -> None:
    pool = GrammarCompilerPool(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    start = time.perf_counter()
    pool.compiler()
    print(
        f"vocabulary read (TokenizerInfo, once per engine): {(time.perf_counter() - start) * 1e3:.0f} ms"
    )
    start = time.perf_counter()
    for i in range(pool.workers):  # each compiler process started and used once
        pool.compile(StructuredOutputs(regex=f"warm{i}").validate(), timeout=300)
    pool.clear()
    print(
        f"compiler processes started (xgrammar's import, once per engine): "
        f"{(time.perf_counter() - start) * 1e3:.0f} ms"
    )
    print("cold = the bounded probe in a compiler process, then the compile in this one")
    print(f"{'constraint':48s} {'cold ms':>9s} {'cached ms':>10s}")
    for spec in COMPILE_CASES:
        cold, warm = [], []
        for _ in range(3):
            pool.clear()
            start = time.perf_counter()
            pool.compile(spec)
            cold.append(time.perf_counter() - start)
            start = time.perf_counter()
            pool.compile(spec)
            warm.append(time.perf_counter() - start)
        print(
            f"{spec.describe()[:48]:48s} {statistics.median(cold) * 1e3:9.2f} "
            f"{statistics.median(warm) * 1e3:10.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    args = parser.parse_args()
    from radixkv.model.runner import default_dtype

    dtype = args.dtype or str(default_dtype("cpu")).removeprefix("torch.")
    print(
        f"host ISA: {native.host_isa()}, dtype: {dtype}, torch threads: {torch.get_num_threads()}"
    )
    engine = Engine("smollm2", dtype=dtype, max_running_requests=max(args.batch, 1))
    timer = Timer()
    engine.grammars.mask = timer.wrap(engine.grammars.mask)  # type: ignore[method-assign]
    engine.grammars.prefetch = timer.wrap(engine.grammars.prefetch)  # type: ignore[method-assign]
    GrammarState.accept = timer.wrap(GrammarState.accept)  # type: ignore[method-assign]
    spec = StructuredOutputs(json=LONG_TEXT)
    decode_steps(engine, args.batch, 2, spec, timer)  # warm-up (kernels, allocator, grammar)
    for skip, where in (
        (0, "from the first token (the JSON's structure)"),
        (16, "tokens 17+ (inside the string)"),
    ):
        free: list[float] = []
        constrained: list[float] = []
        grammar: list[float] = []
        for _ in range(args.rounds):  # interleaved: a shared host's drift hits both alike
            free += decode_steps(engine, args.batch, args.steps, None, timer, skip)[0]
            walls, spent = decode_steps(engine, args.batch, args.steps, spec, timer, skip)
            constrained += walls
            grammar += spent
        f, c, g = (statistics.median(x) * 1e3 for x in (free, constrained, grammar))
        print(f"decode step, batch {args.batch}, {where}, median of {args.rounds} x {args.steps}:")
        print(f"  no constraint        {f:9.1f} ms")
        print(f"  every row constrained {c:8.1f} ms   ratio {c / f:.3f}x (target <= 1.15x)")
        print(
            f"  of which grammar      {g:8.1f} ms   (on the engine thread: starting the fill, "
            "waiting for what the forward did not hide, apply, token accept)"
        )
    bench_compile(engine)


if __name__ == "__main__":
    main()
