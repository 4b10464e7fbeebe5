"""Speed benchmark of the prefix cache: replay a generated-shared-prefix trace.

    python -m bench.bench_simulator            # 64 groups x 16 prompts, 2048 + 128 tokens
    python -m bench.bench_simulator --profile  # also print the top cProfile entries

Replays ~2.2M prompt tokens through RadixTree + BlockAllocator at page size 16 and 1, with ample
capacity (no eviction) and with a bounded capacity (a quarter of the distinct tokens, so LRU
eviction runs constantly), and prints prompt tokens/s of each replay (tokenization excluded;
the trace is prepared once). Targets: >= 5M tokens/s at page size 16, >= 1M at page size 1.
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


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-groups", type=int, default=64)
    ap.add_argument("--prompts-per-group", type=int, default=16)
    ap.add_argument("--system-prompt-len", type=int, default=2048)
    ap.add_argument("--question-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="best of N replays")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)

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
