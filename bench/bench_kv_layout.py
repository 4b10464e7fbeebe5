"""kv_layout="paged" vs "virtual" (contiguous per-request K/V mapped over a memfd), side by side.

    flock /tmp/radixkv-bench.lock .venv/bin/python -m bench.bench_kv_layout [--scale 1.0]

Each layout runs in a child process of its own (so peak RSS is its own) on SmolLM2 in float32,
page_size 16, and measures:

* ``prefill``: 2 requests of ``512 * scale`` random tokens, prefix cache off, prefilled in chunks
  of 128 (every chunk after the first attends to a cached prefix: paged gathers it, virtual reads
  its range in place); tokens/s.
* ``decode64``: 64 requests of 32 tokens, ``16`` tokens out; decode tokens/s over the steps where
  every request decodes.
* ``w1``: ``round(32 * scale)`` requests sharing a ``512 * scale``-token prefix plus 32 own tokens,
  16 out (a scaled W1: one system prompt, many users); wall seconds.
* peak RSS of the child (``ru_maxrss``), and for virtual the mmap/munmap seconds per step, the
  mmap calls per step and the peak mappings.

Prints one table and the virtual/paged ratios. Time it under the shared lock; keep it < 3 min.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from radixkv import Engine, SamplingParams


def _prompts(n: int, length: int, seed: int, shared: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(100, 20000, (shared,), generator=g).tolist()
    return [prefix + torch.randint(100, 20000, (length,), generator=g).tolist() for _ in range(n)]


def _run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """Step to completion; wall seconds, decode tokens/s, steps, peak mappings."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}-{time.monotonic_ns()}", p, params)
    t0 = time.perf_counter()
    steps = 0
    dec_time = dec_tokens = 0.0
    peak_maps = 0
    virtual = engine.runner.virtual
    while engine.has_unfinished():
        s0 = time.perf_counter()
        decoding = bool(engine.scheduler.running) and not engine.scheduler.waiting
        decoding = decoding and all(
            s.num_computed >= len(s.prompt_ids) for s in engine.scheduler.running
        )
        outs = engine.step()
        dt = time.perf_counter() - s0
        steps += 1
        if decoding:
            dec_time += dt
            dec_tokens += sum(len(o.new_token_ids) for o in outs)
        if virtual is not None:
            peak_maps = max(peak_maps, virtual.mappings)
    wall = time.perf_counter() - t0
    engine.check_integrity()
    return {
        "wall_s": wall,
        "steps": steps,
        "decode_tok_s": dec_tokens / dec_time if dec_time else 0.0,
        "peak_mappings": peak_maps,
    }


def one_layout(
    layout: str, scale: float, kv_tokens: int, out: int = 16, batch: int = 64, w1: int = 32
) -> dict[str, float]:
    """All three workloads on one layout (in this process)."""
    from radixkv.model.loader import load_model

    torch.set_num_threads(2)
    model = load_model("smollm2", dtype=torch.float32)
    plen = max(64, int(512 * scale))
    res: dict[str, float] = {}

    def engine(**knobs):
        return Engine(
            model,
            dtype="float32",
            page_size=16,
            kv_cache_tokens=kv_tokens,
            kv_layout=layout,
            **knobs,
        )

    e = engine(enable_prefix_cache=False, chunked_prefill_tokens=128)
    r = _run(e, _prompts(2, plen, seed=1), 1)
    res["prefill_tok_s"] = 2 * plen / r["wall_s"]
    e = engine(enable_prefix_cache=False, chunked_prefill_tokens=4096)
    r = _run(e, _prompts(batch, 32, seed=2), out)
    res["decode64_tok_s"] = r["decode_tok_s"]
    e = engine(enable_prefix_cache=True, chunked_prefill_tokens=2048)
    v0 = e.runner.virtual.stats() if e.runner.virtual is not None else None
    r = _run(e, _prompts(w1, 32, seed=3, shared=plen), out)
    res["w1_wall_s"] = r["wall_s"]
    res["w1_decode_tok_s"] = r["decode_tok_s"]
    if v0 is not None:
        st = e.runner.virtual.stats()
        res["map_ms_per_step"] = 1e3 * (st["map_seconds"] - v0["map_seconds"]) / r["steps"]
        res["map_calls_per_step"] = (st["map_calls"] - v0["map_calls"]) / r["steps"]
        res["peak_mappings"] = r["peak_mappings"]
    res["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0, help="prompt lengths x scale")
    ap.add_argument("--kv-cache-tokens", type=int, default=24576)
    ap.add_argument("--out", type=int, default=16, help="tokens generated per request")
    ap.add_argument("--decode-batch", type=int, default=64)
    ap.add_argument("--w1-requests", type=int, default=32)
    ap.add_argument("--one", choices=["paged", "virtual"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        res = one_layout(
            args.one,
            args.scale,
            args.kv_cache_tokens,
            args.out,
            args.decode_batch,
            args.w1_requests,
        )
        print(json.dumps(res))
        return
    results = {}
    for layout in ("paged", "virtual"):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.bench_kv_layout",
                "--one",
                layout,
                "--scale",
                str(args.scale),
                "--kv-cache-tokens",
                str(args.kv_cache_tokens),
                "--out",
                str(args.out),
                "--decode-batch",
                str(args.decode_batch),
                "--w1-requests",
                str(args.w1_requests),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        results[layout] = json.loads(out.stdout.strip().splitlines()[-1])
    keys = ["prefill_tok_s", "decode64_tok_s", "w1_wall_s", "w1_decode_tok_s", "peak_rss_mib"]
    print(
        f"SmolLM2 fp32, page 16, KV pool {args.kv_cache_tokens} tokens, scale {args.scale}, "
        f"{args.out} out, decode batch {args.decode_batch}, w1 {args.w1_requests} requests, "
        f"torch threads 2"
    )
    print(f"{'metric':<20}{'paged':>12}{'virtual':>12}{'virtual/paged':>15}")
    for k in keys:
        p, v = results["paged"][k], results["virtual"][k]
        print(f"{k:<20}{p:>12.2f}{v:>12.2f}{v / p if p else float('nan'):>15.3f}")
    for k in ("map_ms_per_step", "map_calls_per_step", "peak_mappings"):
        print(f"{k:<20}{'-':>12}{results['virtual'][k]:>12.2f}")


if __name__ == "__main__":
    main()
