"""Speed benchmark of the prefix cache: replay a generated-shared-prefix trace.

    python -m bench.bench_simulator            # 64 groups x 16 prompts, 2048 + 128 tokens
    python -m bench.bench_simulator --profile  # also print the top cProfile entries
    python -m bench.bench_simulator --capacity-check   # issue 13: speed vs configured capacity

Replays ~2.2M prompt tokens through RadixTree + BlockAllocator at page size 16 and 1, with ample
capacity (no eviction) and with a bounded capacity (a quarter of the distinct tokens, so LRU
eviction runs constantly), and prints prompt tokens/s of each replay (tokenization excluded;
the trace is prepared once). Targets: >= 5M tokens/s at page size 16, >= 1M at page size 1.

``--capacity-check`` replays the issue-13 trace (12 groups x 10 prompts, 700-token prefix + 40)
with capacity 100,000 and 100,000,000 tokens at page 16 and 1, side by side in one run, and prints
tokens/s of each (wall time of the whole ``replay`` call: pool construction, loop, final flush),
the ratio big/small (target >= 0.8x), and the tracemalloc peak of each. Targets: >= 5M tok/s at
page 16 and >= 2M at page 1 with the big capacity.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from collections.abc import Sequence

from radixkv.sim.simulator import prepare_trace, replay, unbounded_capacity
from radixkv.sim.workloads import generated_shared_prefix


def capacity_check(repeats: int) -> int:
    """Replay speed and peak memory at capacity 1e5 vs 1e8 (see the module docstring)."""
    import tracemalloc

    reqs = prepare_trace(generated_shared_prefix(12, 10, 700, 40, 0, seed=0))
    prompt_tokens = sum(len(r.prompt) for r in reqs)
    print(f"trace: {len(reqs)} requests (12 groups x 10, 700 + 40 tokens), {prompt_tokens} tokens")
    print(
        f"{'page':>4}  {'capacity':>11}  {'hit_rate':>8}  {'tokens/s':>9}  {'peak MiB':>8}  ratio"
    )
    ok = True
    for page_size in (16, 1):
        speed: dict[int, float] = {}
        for cap in (100_000, 100_000_000):
            best = float("inf")
            res: dict = {}
            for _ in range(max(1, repeats)):
                t = time.perf_counter()
                res = replay(reqs, cap, page_size, "lru")
                best = min(best, time.perf_counter() - t)
            tracemalloc.start()
            replay(reqs, cap, page_size, "lru")
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            speed[cap] = prompt_tokens / best
            ratio = speed[cap] / speed[100_000]
            print(
                f"{page_size:>4}  {cap:>11,}  {res['cached_tokens'] / prompt_tokens:>8.4f}  "
                f"{speed[cap] / 1e6:>8.2f}M  {peak / 2**20:>8.2f}  {ratio:.2f}x"
            )
        target = 5e6 if page_size == 16 else 2e6
        met = speed[100_000_000] >= target and speed[100_000_000] >= 0.8 * speed[100_000]
        ok = ok and met
        print(
            f"page {page_size}: 1e8/1e5 = {speed[100_000_000] / speed[100_000]:.2f}x (>= 0.8x), "
            f"{speed[100_000_000] / 1e6:.2f}M tok/s (>= {target / 1e6:.0f}M): "
            f"{'met' if met else 'NOT met'}"
        )
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-groups", type=int, default=64)
    ap.add_argument("--prompts-per-group", type=int, default=16)
    ap.add_argument("--system-prompt-len", type=int, default=2048)
    ap.add_argument("--question-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="best of N replays")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--capacity-check",
        action="store_true",
        help="issue-13 trace at capacity 1e5 vs 1e8: speed ratio and peak memory",
    )
    args = ap.parse_args(argv)
    if args.capacity_check:
        return capacity_check(args.repeats)

    t = time.perf_counter()
    trace = generated_shared_prefix(
        args.num_groups,
        args.prompts_per_group,
        args.system_prompt_len,
        args.question_len,
        args.output_len,
        seed=0,
    )
    reqs = prepare_trace(trace)
    prompt_tokens = sum(len(r.prompt) for r in reqs)
    print(
        f"trace: {len(reqs)} requests, {prompt_tokens} prompt tokens "
        f"(generated + prepared in {time.perf_counter() - t:.2f}s)"
    )
    distinct = args.num_groups * (
        args.system_prompt_len + args.prompts_per_group * (args.question_len + args.output_len)
    )
    print(f"{'page':>4}  {'capacity':>9}  {'policy':>6}  {'hit_rate':>8}  {'evicted':>9}  tokens/s")
    for page_size in (16, 1):
        ample = unbounded_capacity(reqs, page_size)
        for label, cap in (("ample", ample), ("bounded", distinct // 4)):
            best = None
            for _ in range(args.repeats):
                res = replay(reqs, cap, page_size, "lru")
                if best is None or res["seconds"] < best["seconds"]:
                    best = res
            assert best is not None
            tps = best["prompt_tokens"] / best["seconds"]
            hit = best["cached_tokens"] / best["prompt_tokens"]
            print(
                f"{page_size:>4}  {label:>9}  {'lru':>6}  {hit:>8.4f}  {best['evictions']:>9}  "
                f"{tps / 1e6:.1f}M"
            )
            if args.profile:
                prof = cProfile.Profile()
                prof.enable()
                replay(reqs, cap, page_size, "lru")
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(8)
    return 0


if __name__ == "__main__":
    sys.exit(main())
