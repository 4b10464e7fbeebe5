"""Where a decode step's time goes: one engine's steps at batch 1 and 8, by part.

    .venv/bin/python -m bench.bench_step_breakdown [--model smollm2] [--batch 1,8] [--steps 48]
        [--quantization gguf]

Each batch: ``--batch`` requests of a short prompt decode ``--steps`` greedy tokens together
(EOS ignored); each timed step's wall time is split by wrapping, with ``time.perf_counter``,
the calls a step makes: every linear by kind (qkv, o, gate_up, down, lm_head), the attention
(RoPE, K/V store and the kernel: the backend's ``forward_qkv``), the fused elementwise ops
(RMSNorm with its residual add, SiLU*mul), the embedding, the attention's per-step ``prepare``
and the RoPE tables; "model glue" is the rest of the model's forward (its Python between those
calls), "runner / engine" the rest of ``Engine.step`` (schedule, batch building, sampling,
bookkeeping). The wrappers cost ~0.3 us a call, counted in the parts they wrap.

``--plain``: only each batch's median step, nothing wrapped (for an A/B between checkouts; the
layers as one native call where the model allows it, as an engine runs them).

Then the fixed cost alone: the same model forward (batch 1, 8) with every decoder linear a
no-op returning a preallocated output of its shape (zeros: the model's other ops unchanged),
the median of ``--steps`` forwards, and the same with the real linears, so their difference is
the linears' share; and the forward with the layers as one native call
(radixkv/model/decoder_stack.py), which the breakdown itself turns off (its parts are inside it).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from radixkv import Engine, SamplingParams
from radixkv.model.linear import PackedLinear
from radixkv.model.platform_info import format_platform_info, platform_info
from radixkv.model.quant_linear import QuantLinear

PARTS = (
    "linear qkv",
    "linear o",
    "linear gate_up",
    "linear down",
    "linear lm_head",
    "attention (rope, store, kernel)",
    "rms_norm / add_rms_norm",
    "silu_mul",
    "embedding",
    "attention prepare + rope tables",
    "model glue (Python between ops)",
    "runner / engine (schedule, batch, sample)",
)


class Clock:
    """Seconds spent in each wrapped part during the timed steps (exclusive of nested parts)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self.stack: list[float] = []  # per open part, the nested parts' time so far

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - t0
                nested = self.stack.pop()
                self.spent[part] += took - nested
                if self.stack:
                    self.stack[-1] += took

        return timed


def _linear_kind(name: str) -> str:
    for kind in ("qkv", "o", "gate_up", "down", "lm_head"):
        if name.endswith(f"{kind}_proj") or name == kind:
            return f"linear {kind}"
    return "linear other"


class OpsProxy:
    """The native module with its fused elementwise ops timed."""

    def __init__(self, ops: Any, clock: Clock) -> None:
        self._ops = ops
        for name in ("rms_norm", "add_rms_norm"):
            setattr(self, name, clock.wrap("rms_norm / add_rms_norm", getattr(ops, name)))
        self.silu_mul = clock.wrap("silu_mul", ops.silu_mul)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ops, name)


def instrument(engine: Engine, clock: Clock) -> list[tuple[Any, str, Any]]:
    """Wrap the engine's model's calls; returns the (object, attribute, original) to restore."""
    runner = engine.runner
    model = runner.model
    undo: list[tuple[Any, str, Any]] = []

    def put(obj: Any, name: str, value: Any) -> None:
        undo.append((obj, name, obj.__dict__.get(name)))
        setattr(obj, name, value)

    # the layers as one native call would hide every per-layer part inside it
    put(model, "use_decoder_stack", False)
    for name, mod in model.named_modules():
        if isinstance(mod, (PackedLinear, QuantLinear, torch.nn.Linear)):
            put(mod, "forward", clock.wrap(_linear_kind(name.split(".")[-1]), mod.forward))
    put(model.embed_tokens, "forward", clock.wrap("embedding", model.embed_tokens.forward))
    backend = runner.backend
    put(
        backend,
        "forward_qkv",
        clock.wrap("attention (rope, store, kernel)", backend.forward_qkv),
    )
    put(backend, "prepare", clock.wrap("attention prepare + rope tables", backend.prepare))
    put(
        model,
        "_rope_tables",
        clock.wrap("attention prepare + rope tables", model._rope_tables),
    )
    fused = model._fused_ops

    def fused_ops(b: Any) -> Any:
        ops = fused(b)
        return None if ops is None else OpsProxy(ops, clock)

    put(model, "_fused_ops", fused_ops)
    put(runner, "forward", clock.wrap("model glue (Python between ops)", runner.forward))
    return undo


def restore(undo: list[tuple[Any, str, Any]]) -> None:
    for obj, name, old in reversed(undo):
        if old is None:
            delattr(obj, name)
        else:
            setattr(obj, name, old)


def breakdown(engine: Engine, batch: int, steps: int) -> tuple[dict[str, float], float]:
    """Mean ms per part over the timed decode steps, and the median step (ms)."""
    prompt = engine.tokenizer.encode("The history of the printing press began in")
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", prompt + [100 + i], params)
    engine.step()  # the prefill
    for _ in range(4):
        engine.step()
    clock = Clock()
    undo = instrument(engine, clock)
    walls: list[float] = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
    finally:
        restore(undo)
    while engine.has_unfinished():
        engine.step()
    total = sum(walls)
    parts = {p: clock.spent.get(p, 0.0) for p in PARTS}
    parts["runner / engine (schedule, batch, sample)"] = total - sum(clock.spent.values())
    return {p: s / steps * 1e3 for p, s in parts.items()}, statistics.median(walls) * 1e3


def plain_steps(engine: Engine, batch: int, steps: int) -> float:
    """The median decode step (ms) of ``batch`` requests decoding together, nothing wrapped."""
    prompt = engine.tokenizer.encode("The history of the printing press began in")
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"p{batch}-{i}", prompt + [100 + i], params)
    walls = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls[5:-2]) * 1e3


def forward_only(
    engine: Engine, batch: int, steps: int, no_linears: bool, stack: bool = False
) -> float:
    """Median ms of the model forward alone for a ``batch``-row decode (positions 40..),
    with the decoder's linears no-ops returning preallocated zeros when ``no_linears``, the
    layers as one native call where the model allows it when ``stack`` (the Python loop
    otherwise)."""
    from radixkv.model.runner import RequestSlice

    runner = engine.runner
    ps = runner.page_size
    pages_per = -(-(48 + steps) // ps)
    slices = [
        RequestSlice(
            token_ids=[100 + i],
            prefix_len=40,
            pages=list(range(i * pages_per, (i + 1) * pages_per)),
        )
        for i in range(batch)
    ]
    fb = runner.build_batch(slices)
    undo: list[tuple[Any, str, Any]] = [(runner.model, "use_decoder_stack", True)]
    runner.model.use_decoder_stack = stack
    if no_linears:
        for mod in runner.model.layers.modules():
            if isinstance(mod, (PackedLinear, QuantLinear)):
                out = torch.zeros(batch, mod.out_features, dtype=runner.dtype)
                undo.append((mod, "forward", mod.__dict__.get("forward")))
                mod.forward = lambda x, out=out: out  # type: ignore[method-assign]
    try:
        for _ in range(3):
            runner.forward(fb)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            runner.forward(fb)
            times.append(time.perf_counter() - t0)
    finally:
        restore(undo)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--quantization",
        default=None,
        help="the engine's weight quantization (e.g. gguf: the file's own blocks; "
        "RADIXKV_QUANT_ACTIVATIONS=int8 for integer dot products)",
    )
    ap.add_argument(
        "--plain",
        action="store_true",
        help="only each batch's median step, nothing wrapped (an A/B between checkouts)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(format_platform_info(platform_info()))
    knobs = {"quantization": args.quantization} if args.quantization else {}
    engine = Engine(args.model, kv_cache_tokens=8192, **knobs)
    print(
        f"dtype {engine.runner.dtype}, backend {engine.runner.backend.name}, threads {torch.get_num_threads()}"
    )
    batches = [int(b) for b in args.batch.split(",")]
    if args.plain:
        for b in batches:
            print(f"batch {b}: median step {plain_steps(engine, b, args.steps):.3f} ms", flush=True)
        return
    for b in batches:
        parts, median = breakdown(engine, b, args.steps)
        mean = sum(parts.values())
        print(f"\nbatch {b}: median step {median:.2f} ms, mean {mean:.2f} ms")
        for p, ms in parts.items():
            print(f"  {p:45s} {ms:7.3f} ms  {ms / mean * 100:5.1f}%")
    print()
    for b in batches:
        stacked = forward_only(engine, b, args.steps, no_linears=False, stack=True)
        full = forward_only(engine, b, args.steps, no_linears=False)
        bare = forward_only(engine, b, args.steps, no_linears=True)
        layers = engine.runner.config.num_layers
        print(
            f"forward batch {b}: layers in one native call {stacked:.2f} ms; Python loop "
            f"{full:.2f} ms; loop with decoder linears as no-ops {bare:.2f} ms "
            f"({bare / layers * 1e3:.0f} us a layer, lm_head included)"
        )


if __name__ == "__main__":
    main()
