"""Engine throughput on a generated-shared-prefix burst: cache on vs off vs transformers.

    .venv/bin/python -m bench.bench_engine [--groups 8 --prompts-per-group 8 --system-len 512
                                            --question-len 32 --output-len 16 --dtype bfloat16]

All requests arrive at once. radixkv runs them with continuous batching, with the prefix cache and
without it; the baseline is transformers ``generate`` answering one request at a time (greedy, no
prefix reuse), in the same dtype. Prints throughput, mean TTFT and the ratios, measured in one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from radixkv import Engine, SamplingParams
from radixkv.model.loader import load_model
from radixkv.sim.workloads import generated_shared_prefix


def run_radixkv(loaded, prompts, warmup, output_len, **knobs) -> dict:
    engine = Engine(loaded, **knobs)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.generate(warmup, params)  # same shapes, other tokens: warms oneDNN's kernel caches
    assert engine.flush_cache()
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    engine.check_integrity()
    stats = engine.stats()
    return {
        "wall_s": wall,
        "output_tokens": sum(len(o.token_ids) for o in outs),
        "mean_ttft_s": statistics.mean(o.ttft for o in outs),
        "hit_rate": stats["cached_tokens_total"] / max(1, stats["prompt_tokens_total"]),
        "outputs": [o.token_ids for o in outs],
    }


class _FirstTokenClock:
    """A transformers streamer that notes when the first generated token appears."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value) -> None:  # first call carries the prompt, the second the first token
        self.calls += 1
        if self.calls == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def run_transformers(loaded, prompts, output_len, dtype) -> dict:
    """transformers generate, one request at a time (all arrived at t=0, as for radixkv)."""
    model = loaded.hf_model.to(dtype)
    ttfts, total_out = [], 0
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            clock = _FirstTokenClock()
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=0,
                streamer=clock,
            )
            ttfts.append((clock.first or time.perf_counter()) - start)
            total_out += out.shape[1] - len(prompt)
    wall = time.perf_counter() - start
    model.to(torch.float32)
    return {"wall_s": wall, "output_tokens": total_out, "mean_ttft_s": statistics.mean(ttfts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--prompts-per-group", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--hf-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="transformers baseline dtype (float32: its default and its faster one on this CPU)",
    )
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()

    trace = generated_shared_prefix(
        args.groups,
        args.prompts_per_group,
        args.system_len,
        args.question_len,
        args.output_len,
        seed=0,
    )
    prompts = [r["input_ids"] for r in trace]
    warmup = [
        r["input_ids"]
        for r in generated_shared_prefix(
            args.groups,
            args.prompts_per_group,
            args.system_len,
            args.question_len,
            args.output_len,
            seed=1,
        )
    ]
    loaded = load_model("smollm2")
    print(
        f"workload: {len(prompts)} requests = {args.groups} groups x {args.prompts_per_group}, "
        f"system {args.system_len} + question {args.question_len} tokens, "
        f"{args.output_len} output tokens; radixkv {args.dtype}, transformers {args.hf_dtype}; "
        f"torch threads "
        f"{torch.get_num_threads()}"
    )
    knobs = dict(page_size=args.page_size, dtype=args.dtype, kv_cache_tokens=65536)
    rows = {
        "radixkv cache on": run_radixkv(loaded, prompts, warmup, args.output_len, **knobs),
        "radixkv cache off": run_radixkv(
            loaded, prompts, warmup, args.output_len, enable_prefix_cache=False, **knobs
        ),
    }
    on, off = rows["radixkv cache on"].pop("outputs"), rows["radixkv cache off"].pop("outputs")
    same = sum(a == b for a, b in zip(on, off))
    if not args.skip_transformers:
        rows["transformers (1 at a time)"] = run_transformers(
            loaded, prompts, args.output_len, getattr(torch, args.hf_dtype)
        )
    base_off = rows["radixkv cache off"]["wall_s"]
    base_hf = rows.get("transformers (1 at a time)", {}).get("wall_s")
    print(
        f"\n{'engine':28s} {'wall s':>8s} {'out tok/s':>10s} {'TTFT ms':>9s} {'hit rate':>9s} "
        f"{'vs off':>7s} {'vs HF':>7s}"
    )
    for name, r in rows.items():
        tput = r["output_tokens"] / r["wall_s"]
        vs_hf = f"{base_hf / r['wall_s']:.1f}x" if base_hf else "-"
        print(
            f"{name:28s} {r['wall_s']:8.2f} {tput:10.1f} {1000 * r['mean_ttft_s']:9.0f} "
            f"{r.get('hit_rate', 0.0):9.3f} {base_off / r['wall_s']:6.1f}x {vs_hf:>7s}"
        )
    print(
        f"\ngreedy outputs identical with and without the cache: {same}/{len(on)} requests "
        f"({args.dtype}; bf16 rounding depends on batch shapes, the fp32 tests check exactness)"
    )


if __name__ == "__main__":
    main()
