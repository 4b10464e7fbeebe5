"""The batch-64 decode step with greedy vs default sampling, and engine start-up, side by side.

Step: SmolLM2 in the host's default dtype (bf16 with native bf16, else float32; ``--dtype`` to
choose), 64 requests of 4 shared 768-token prefixes + 64 own tokens, 32 output tokens, EOS
ignored (issue 31's shape); the median decode step (all 64 running) with greedy requests and with
the default temperature 1.0, run one after the other, and their ratio. Each engine's pool is
fresh, so the steps' K/V stores also pay the first writes to its memory (a fault per new page);
``--touched-pool`` runs the burst once untimed first, so the measured steps write pages already
touched (a server that has run a while, or committed its pool with ``--prefault-kv``).

Start-up (``--startup``): ``Engine(smollm2, dtype="float32", kv_cache_tokens=65536)`` (a 3 GB KV
pool) timed in a fresh process each, after a small warm-up engine, with the pool in lazily zeroed
anonymous memory (radixkv's) and with it zero-filled up front (round 2's), and their ratio.

First touch (with ``--startup``): one prefill step's K/V stores into pool memory never written
before vs committed ahead (``radixkv.model.prefault``), and their ratio.

Run from the repository root: ``python -m bench.bench_step`` (``--startup`` for start-up only,
``--step-only`` for the step only, ``--runs N`` to repeat, ``--dtype`` to pick). The host's ISA is printed.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from typing import Any

STARTUP = """
import sys, time, torch
from radixkv import Engine
from radixkv.model import hugepages, kv_pool
from radixkv.model.loader import load_model
model = load_model("smollm2", dtype=torch.float32)
Engine(model, dtype="float32", kv_cache_tokens=1024)  # one-time costs out of the timing
if sys.argv[1] == "zero-filled":
    def eager(shape, dtype, device="cpu"):
        t = torch.empty(shape, dtype=dtype, device=device)
        hugepages.advise_huge(t)
        return t.zero_()
    kv_pool.huge_zeros = eager
start = time.perf_counter()
Engine(model, dtype="float32", kv_cache_tokens=65536)
print(time.perf_counter() - start)
"""


def startup(runs: int) -> None:
    times: dict[str, list[float]] = {"lazy": [], "zero-filled": []}
    for _ in range(runs):
        for variant in times:
            out = subprocess.run(
                [sys.executable, "-c", STARTUP, variant], capture_output=True, text=True, check=True
            )
            times[variant].append(float(out.stdout.strip().splitlines()[-1]))
    lazy, eager = (statistics.median(times[v]) for v in ("lazy", "zero-filled"))
    print(
        f"start-up, 3 GB fp32 pool: zero-filled {eager:.2f} s, lazy {lazy:.2f} s, "
        f"{eager / lazy:.1f}x (runs: {times})"
    )


def first_touch(runs: int) -> None:
    """One prefill step's K/V stores (2,048 tokens, 30 layers x K and V, SmolLM2's shapes, bf16)
    into lazily zeroed pool memory never written before, and into the same amount committed
    ahead by ``hugepages.populate`` (what ``radixkv.model.prefault`` does in idle time)."""
    import torch

    from radixkv.model.hugepages import huge_zeros, populate

    tokens, rows = 2048, 65536
    src = torch.randn(tokens, 3, 64).to(torch.bfloat16)
    idx = torch.arange(tokens)
    times: dict[str, list[float]] = {"fresh": [], "committed": []}
    for _ in range(runs):
        for variant in times:
            pools = [huge_zeros((rows, 3, 64), torch.bfloat16) for _ in range(60)]
            if variant == "committed":
                for pool in pools:
                    populate(pool, 0, tokens * 3 * 64 * 2)
            start = time.perf_counter()
            for pool in pools:
                pool.index_copy_(0, idx, src)
            times[variant].append((time.perf_counter() - start) * 1e3)
    fresh, done = (statistics.median(times[v]) for v in ("fresh", "committed"))
    print(
        f"first touch, one 2,048-token step's K/V stores: fresh pool memory {fresh:.1f} ms, "
        f"committed ahead {done:.1f} ms ({fresh / done:.0f}x) (runs: {times})"
    )


def shared_prefix_prompts(seed: int = 0) -> list[list[int]]:
    """64 prompts: 4 random 768-token prefixes, each with 16 prompts of 64 own tokens."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 40000) for _ in range(768)] for _ in range(4)]
    return [prefixes[i % 4] + [rng.randrange(100, 40000) for _ in range(64)] for i in range(64)]


def full_batch_step_ms(engine: Any, prompts: list[list[int]], params: Any) -> float:
    """Run ``prompts`` to the end; the median step (ms) while all of them decode together,
    without the first 3 and the last 2 such steps."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    steps = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        took = time.perf_counter() - start
        stats = engine.stats()
        if stats["running"] == len(prompts) and stats["waiting"] == 0:
            steps.append(took)
    return statistics.median(steps[3:-2]) * 1e3


def lockstep_full_batch_steps(
    engines: dict[str, Any], prompts: list[list[int]], params: Any, rotation: int = 0
) -> dict[str, list[float]]:
    """Run ``prompts`` on every engine in lockstep, one step of each in turn (the order rotated
    every round, starting ``rotation`` places on), and return each engine's step times (ms)
    for the rounds where every engine had all of them decoding together, without the first 3
    and the last 2 such rounds. Index ``i`` of every list is the same round: the steps of a
    round ran within a few hundred ms of each other, so a shared host's drift cancels in their
    ratio."""
    names = list(engines)
    for engine in engines.values():
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
    rounds: list[dict[str, float]] = []
    turn = rotation
    while any(e.has_unfinished() for e in engines.values()):
        took: dict[str, float] = {}
        full = True
        for k in range(len(names)):
            name = names[(turn + k) % len(names)]
            engine = engines[name]
            if not engine.has_unfinished():
                full = False
                continue
            start = time.perf_counter()
            engine.step()
            took[name] = (time.perf_counter() - start) * 1e3
            stats = engine.stats()
            full = full and stats["running"] == len(prompts) and stats["waiting"] == 0
        turn += 1
        if full:
            rounds.append(took)
    rounds = rounds[3:-2]
    return {name: [r[name] for r in rounds] for name in names}


def paired_ratio(
    base: list[float], other: list[float], seed: int = 0
) -> tuple[float, float, float]:
    """The median of ``other[i] / base[i]`` over paired samples, and a 95% bootstrap interval of
    that median (2,000 resamples of the pairs, seeded): (median, low, high)."""
    import random

    ratios = [o / b for b, o in zip(base, other, strict=True)]
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    return statistics.median(ratios), meds[49], meds[1949]


def decode_step(runs: int, dtype_name: str | None, touched_pool: bool = False) -> None:
    import torch

    from radixkv import Engine, SamplingParams
    from radixkv.model import native
    from radixkv.model.loader import load_model
    from radixkv.model.runner import default_dtype

    dtype = getattr(torch, dtype_name) if dtype_name else default_dtype("cpu")
    dtype_name = str(dtype).removeprefix("torch.")
    print(f"host ISA: {native.host_isa()}, dtype: {dtype_name}, threads: {torch.get_num_threads()}")
    model = load_model("smollm2", dtype=dtype)
    prompts = shared_prefix_prompts()
    cases = {
        "greedy": SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
        "temperature 1.0": SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True),
    }
    medians: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(runs):
        for name, params in cases.items():
            engine = Engine(model, dtype=dtype_name, max_running_requests=64)
            if touched_pool:  # the same burst once, untimed: its pages are the ones reused
                full_batch_step_ms(engine, prompts, params)
                assert engine.flush_cache()
            medians[name].append(full_batch_step_ms(engine, prompts, params))
    greedy, sampled = (statistics.median(medians[n]) for n in cases)
    pool = "pool pages touched before" if touched_pool else "fresh pool"
    print(
        f"batch-64 decode step ({pool}): greedy {greedy:.1f} ms, temperature 1.0 {sampled:.1f} ms, "
        f"sampling adds {sampled - greedy:.1f} ms ({sampled / greedy:.2f}x) (runs: {medians})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--startup", action="store_true", help="start-up only")
    parser.add_argument("--step-only", action="store_true", help="the decode step only")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    parser.add_argument(
        "--touched-pool",
        action="store_true",
        help="each engine runs the burst once untimed (then flushes its cache) first, so the "
        "measured steps write pool pages already touched, as in a server that has run a while "
        "or committed its pool (--prefault-kv)",
    )
    args = parser.parse_args()
    from radixkv.model import native

    print(f"host ISA: {native.host_isa()}")
    if not args.step_only:
        startup(args.runs)
        first_touch(args.runs)
    if not args.startup:
        decode_step(args.runs, args.dtype, args.touched_pool)


if __name__ == "__main__":
    main()
