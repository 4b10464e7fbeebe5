"""Quantized KV pages (``--kv-cache-dtype int8 / fp8_e4m3``) against unquantized ones, side by side
in one run on SmolLM2-135M-Instruct: accuracy, capacity and the decode step.

* **Capacity**: tokens one GiB of pool holds per KV dtype (the engine's own sizing rule), and
  the ratios to bfloat16 and float32.
* **Multi-turn hit rate**: the engine on 16 conversations x 4 rounds (``radixkv.sim.workloads``)
  at a ``--memory-gb`` pool (0.25 GiB: bfloat16 evicts there), per KV dtype.
* **Greedy agreement**: ``--prompts`` (200) chat prompts x ``--tokens`` (64) greedy tokens,
  generated together; per quantized dtype the share of continuations identical to the
  unquantized engine's (same model dtype, same batch) and the mean number of tokens before the
  first divergence (a full continuation counts ``--tokens``).
* **Logprob error against the float64 oracle**: for the first ``--oracle-prompts`` (8), each
  generated token's top-5 logprobs from the engine against transformers' float64 forward of the
  same prompt + continuation; the unquantized engine's own error is the baseline.
* **Perplexity** of two fixed English texts (``bench/data/ppl_text.txt``, 783 tokens, and
  ``bench/data/ppl_gpl3.txt``, the GNU GPL v3, 7,658 tokens), each prefilled in chunks of
  32 tokens so that nearly every query attends over cached (quantized) keys; the change against
  the unquantized pool (target within 1%).
* **Decode step**: the batch-64 step on 4 x 768 shared + 64 own tokens, greedy, while all 64
  rows decode; the unquantized and quantized engines stepped in lockstep (one step of each in
  turn, ``--runs`` bursts of ``--step-tokens``), each quantized step over the unquantized
  one of the same round, the median ratio with a 95% bootstrap interval.

Run from the repository root: ``python -m bench.bench_kv_quant`` (``--dtype`` float32 or
bfloat16, default the host's; ``--skip-speed``, ``--skip-accuracy``; ``--rotation-ablation``:
the accuracy measurements only, with int8 also measured without the Hadamard rotation and fp8
with it; ``--scale-ablation --dtype float32``: the accuracy measurements only, int8 and fp8
simulated with one scale per token and head and per page and head,
``bench/kv_scale_ablation.py``). Prints the host's ISA.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch

from radixkv import Engine, SamplingParams
from radixkv.model import native
from radixkv.model.kv_pool import KVPool
from radixkv.model.kv_quant import is_rotated, kv_storage_dtype

QUANT = ("int8", "fp8_e4m3")
# fixed English texts: a short one (783 tokens), and the GNU GPL v3 (7,658 tokens, copied
# verbatim from Debian's /usr/share/common-licenses/GPL-3), long enough that the perplexity
# moves by less than a rounding change's noise
TEXTS = [Path(__file__).parent / "data" / name for name in ("ppl_text.txt", "ppl_gpl3.txt")]
TOPICS = [
    "volcanoes", "the moon", "bread", "bees", "rivers", "chess", "glass", "tea", "whales",
    "maps", "bridges", "rain", "copper", "owls", "deserts", "paper", "trains", "salt",
    "music", "gardens", "clocks", "ice", "ants", "castles", "wind", "coffee", "sharks",
    "snow", "bicycles", "forests", "stars", "cheese", "kites", "lightning", "wolves",
    "islands", "honey", "ships", "mountains", "cotton",
]  # fmt: skip
ASKS = [
    "Tell me three facts about {}.",
    "Write a short poem about {}.",
    "Explain {} to a child.",
    "What is the history of {}?",
    "Give me a fun question about {}.",
]


# (kv_cache_dtype, rotated, simulated scale granularity: None for the engine's own quantized
# pool, "token" or "page" for bench.kv_scale_ablation's float32 simulation)
Case = tuple[str, bool, str | None]


def engine_rotates(kv: str) -> bool:
    """Whether the engine stores ``kv``'s pages rotated (``kv_quant.is_rotated``)."""
    return is_rotated(kv_storage_dtype(kv, torch.float32))


def cases_for(rotation_ablation: bool) -> list[Case]:
    """Unquantized, then each quantized dtype as the engine runs it; with the ablation also
    each quantized dtype the other way."""
    out: list[Case] = [(kv, engine_rotates(kv), None) for kv in ("auto", *QUANT)]
    return out + [(kv, not engine_rotates(kv), None) for kv in QUANT] if rotation_ablation else out


def scale_cases() -> list[Case]:
    """Unquantized, int8 as the engine runs it, then each quantized dtype simulated with one
    scale per (token, head) row and one per (page, head) (``bench.kv_scale_ablation``)."""
    sims = [(kv, engine_rotates(kv), g) for kv in QUANT for g in ("token", "page")]
    return [("auto", False, None), ("int8", True, None), *sims]


def label_of(case: Case) -> str:
    kv, rotated, sim = case
    if kv == "auto":
        return "unquantized"
    if sim is not None:
        return f"{kv}, per-{sim} (sim)"
    if rotated == engine_rotates(kv):
        return kv
    return kv + (", rotated" if rotated else ", no rotation")


def make_engine(model: Any, dtype: str, case: Case, **knobs: Any) -> Engine:
    """An engine over ``case``'s pages, its backend wrapped in the rotation or unwrapped as
    ``case`` says whatever the engine's default for the dtype (``kv_quant.is_rotated``)."""
    from radixkv.model.attention.rotated_kv import RotatedKVBackend

    if case[2] is not None:  # simulated over a float32 pool
        from bench.kv_scale_ablation import install

        e = Engine(model, dtype=dtype, kv_cache_dtype="auto", **knobs)
        install(e, kv_storage_dtype(case[0], torch.float32), case[2] == "page", case[1])
        return e
    e = Engine(model, dtype=dtype, kv_cache_dtype=case[0], **knobs)
    backend = e.runner.backend
    if case[0] != "auto" and case[1] != isinstance(backend, RotatedKVBackend):
        e.runner.backend = (
            RotatedKVBackend(backend, e.runner.pool.head_dim) if case[1] else backend.inner
        )
    return e


def chat_prompts(engine: Engine, n: int) -> list[list[int]]:
    texts = [ask.format(topic) for ask in ASKS for topic in TOPICS][:n]
    return [engine.apply_chat_template([{"role": "user", "content": t}]) for t in texts]


def capacity(model: Any, dtype: torch.dtype) -> None:
    cfg = model.config
    geometry = (
        cfg.num_hidden_layers,
        1,
        cfg.num_key_value_heads,
        cfg.hidden_size // cfg.num_attention_heads,
    )
    per = {
        name: KVPool.bytes_per_page_for(*geometry, d)
        for name, d in (("float32", torch.float32), ("bfloat16", torch.bfloat16))
    }
    for kv in QUANT:
        per[kv] = KVPool.bytes_per_page_for(*geometry, kv_storage_dtype(kv, dtype))
    print("capacity per GiB of KV pool (tokens; bytes per token incl. scales):")
    for name, b in per.items():
        print(
            f"  {name:9s} {2**30 // b:9d} tokens  {b:5d} B/token  "
            f"{per['bfloat16'] / b:.2f}x bf16  {per['float32'] / b:.2f}x fp32"
        )


def agreement(model: Any, dtype: str, n: int, tokens: int, cases: list[Case]) -> list[list[int]]:
    """Greedy continuations per case against the unquantized engine's; returns the prompts."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    outs: dict[str, list[list[int]]] = {}
    prompts: list[list[int]] = []
    for case in cases:
        e = make_engine(model, dtype, case, max_running_requests=n, kv_cache_tokens=65536)
        prompts = prompts or chat_prompts(e, n)
        outs[label_of(case)] = [o.token_ids for o in e.generate(prompts, params)]
    base = outs.pop("unquantized")
    print(f"greedy agreement with unquantized KV ({n} prompts x {tokens} tokens, {dtype}):")
    for label, got in outs.items():
        same = sum(a == b for a, b in zip(base, got))
        first = [
            next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), tokens)
            for a, b in zip(base, got)
        ]
        print(
            f"  {label:22s} identical {same}/{n} ({same / n:.1%}), mean tokens before the first "
            f"divergence {statistics.mean(first):.1f} of {tokens}"
        )
    return prompts


def oracle_error(
    model: Any, dtype: str, prompts: list[list[int]], tokens: int, cases: list[Case]
) -> None:
    from radixkv.model.loader import load_model

    oracle = load_model("smollm2", dtype=torch.float32).hf_model.to(torch.float64).eval()
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    print(
        f"logprob error against transformers' float64 forward ({len(prompts)} prompts x {tokens} "
        f"tokens, top-5 per token, {dtype}): max / mean |engine - oracle|"
    )
    for case in cases:
        e = make_engine(model, dtype, case, kv_cache_tokens=16384)
        errs: list[float] = []
        for out in e.generate(prompts, params):
            ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
            with torch.no_grad():
                logits = oracle(torch.tensor([ids])).logits[0].double()
            ref = torch.log_softmax(logits, -1)
            start = len(out.prompt_token_ids) - 1
            for i, step in enumerate(out.outputs[0].logprobs):
                for tok, lp in step.items():
                    errs.append(abs(lp.logprob - float(ref[start + i, tok])))
        print(f"  {label_of(case):22s} {max(errs):.4f} / {statistics.mean(errs):.5f}")


def text_perplexity(engine: Engine, text: str) -> tuple[float, int]:
    """``engine``'s perplexity of ``text`` (one prompt, every token's prompt logprob) and its
    length in tokens."""
    ids = engine.tokenizer.encode(text)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    (out,) = engine.generate([ids], params)
    nll = [-next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
    return float(torch.tensor(nll, dtype=torch.float64).mean().exp()), len(ids)


def perplexity(model: Any, dtype: str, cases: list[Case]) -> None:
    """Perplexity of each fixed text per case (KV dtype, with or without the rotation)."""
    for path in TEXTS:
        results = {}
        for case in cases:
            e = make_engine(model, dtype, case, chunked_prefill_tokens=32, kv_cache_tokens=16384)
            results[label_of(case)], n = text_perplexity(e, path.read_text())
        base = results["unquantized"]
        print(f"perplexity of bench/data/{path.name} ({n} tokens, chunks of 32, {dtype}):")
        for label, ppl in results.items():
            print(f"  {label:22s} {ppl:.4f}  ({(ppl / base - 1) * 100:+.2f}%)")


def multi_turn_hit_rate(model: Any, dtype: str, memory_gb: float) -> None:
    """The engine (prefill only: one output token) on 16 conversations x 4 rounds, requests one
    at a time, at ``--kv-cache-memory-gb`` ``memory_gb`` for every KV dtype."""
    from radixkv.sim.workloads import multi_turn

    reqs = multi_turn(num_clients=16, num_rounds=4, seed=0)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    print(
        f"multi-turn hit rate (16 conversations x 4 rounds, {sum(len(r['input_ids']) for r in reqs)} "
        f"prompt tokens) at --kv-cache-memory-gb {memory_gb} ({dtype} model):"
    )
    for kv in ("auto", *QUANT):
        e = Engine(model, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory_gb=memory_gb)
        for r in reqs:
            e.generate([r["input_ids"]], params)
        st = e.stats()
        label = "unquantized" if kv == "auto" else kv
        print(f"  {label:11s} pool {e.kv_capacity_tokens:6d} tokens  hit rate {st['hit_rate']:.4f}")


def decode_step(model: Any, dtype: str, runs: int, tokens: int, touched_pool: bool) -> None:
    """The batch-64 step per KV dtype, the engines stepped in lockstep (one step of each in
    turn, ``bench_step.lockstep_full_batch_steps``), ``runs`` bursts of fresh engines: each
    quantized dtype's step over the unquantized one's as the median of the per-round ratios,
    with its 95% bootstrap interval and the rounds where it was the faster. ``touched_pool``:
    each engine first runs the same burst untimed and drops its cache, so the measured burst
    writes pool pages already faulted in (a serving engine's steady state) rather than fresh
    ones (a quantized pool faults in half as many)."""
    from bench.bench_step import (
        full_batch_step_ms,
        lockstep_full_batch_steps,
        paired_ratio,
        shared_prefix_prompts,
    )

    prompts = shared_prefix_prompts()
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    steps: dict[str, list[float]] = {kv: [] for kv in ("auto", *QUANT)}
    per_burst: dict[str, list[float]] = {kv: [] for kv in QUANT}
    backends: dict[str, str] = {}
    for run in range(runs):
        engines = {}
        for kv in steps:
            e = Engine(
                model, dtype=dtype, kv_cache_dtype=kv, max_running_requests=64,
                kv_cache_tokens=16384,
            )  # fmt: skip
            inner = getattr(e.runner.backend, "inner", e.runner.backend)
            backends[kv] = type(inner).__name__
            if touched_pool:
                full_batch_step_ms(e, prompts, params)
                assert e.flush_cache()
            engines[kv] = e
        burst = lockstep_full_batch_steps(engines, prompts, params, rotation=run)
        for kv, ms in burst.items():
            steps[kv].extend(ms)
            if kv != "auto":
                per_burst[kv].append(paired_ratio(burst["auto"], ms)[0])
        del engines
    base = steps["auto"]
    print(
        f"batch-64 decode step (4 x 768 shared + 64 own tokens, {dtype}; {runs} bursts of "
        f"{tokens} tokens, engines stepped in lockstep, {len(base)} paired rounds, "
        f"{'pool pages touched before' if touched_pool else 'fresh pools'}):"
    )
    for kv, ms in steps.items():
        label = "unquantized" if kv == "auto" else kv
        line = f"  {label:11s} median step {statistics.median(ms):7.1f} ms  ({backends[kv]})"
        if kv != "auto":
            ratio, low, high = paired_ratio(base, ms)
            faster = sum(o < b for b, o in zip(base, ms, strict=True))
            line += (
                f"  step ratio {ratio:.3f}x [95% CI {low:.3f}-{high:.3f}], faster in "
                f"{faster}/{len(ms)} rounds; per burst "
                f"{', '.join(f'{r:.3f}' for r in per_burst[kv])}"
            )
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--oracle-prompts", type=int, default=8)
    parser.add_argument("--runs", type=int, default=2, help="decode-step bursts")
    parser.add_argument(
        "--step-tokens", type=int, default=64, help="tokens per request in a decode-step burst"
    )
    parser.add_argument(
        "--memory-gb", type=float, default=0.25, help="KV pool of the multi-turn hit-rate run"
    )
    parser.add_argument(
        "--touched-pool",
        action="store_true",
        help="decode step: each engine runs the burst once untimed first (pool pages faulted in)",
    )
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument(
        "--rotation-ablation",
        action="store_true",
        help="the accuracy measurements only, each quantized dtype also with the rotation flipped",
    )
    parser.add_argument(
        "--scale-ablation",
        action="store_true",
        help="the accuracy measurements only (--dtype float32): int8 and fp8 simulated with one "
        "scale per (token, head) and per (page, head) (bench/kv_scale_ablation.py)",
    )
    parser.add_argument(
        "--perplexity-only",
        action="store_true",
        help="capacity and the fixed texts' perplexity only (with the cases the other flags pick)",
    )
    args = parser.parse_args()
    from radixkv.model.loader import load_model
    from radixkv.model.runner import default_dtype

    dtype = getattr(torch, args.dtype) if args.dtype else default_dtype("cpu")
    name = str(dtype).removeprefix("torch.")
    print(f"host ISA: {native.host_isa()}, dtype: {name}, torch threads: {torch.get_num_threads()}")
    model = load_model("smollm2", dtype=dtype)
    capacity(model, dtype)
    if args.scale_ablation and dtype != torch.float32:
        parser.error("--scale-ablation simulates over a float32 pool: add --dtype float32")
    cases = scale_cases() if args.scale_ablation else cases_for(args.rotation_ablation)
    args.rotation_ablation = args.rotation_ablation or args.scale_ablation
    if not (args.rotation_ablation or args.perplexity_only):
        multi_turn_hit_rate(model, name, args.memory_gb)
    if args.perplexity_only:
        perplexity(model, name, cases)
        return
    if not args.skip_accuracy:
        prompts = agreement(model, name, args.prompts, args.tokens, cases)
        oracle_error(model, name, prompts[: args.oracle_prompts], args.tokens, cases)
        perplexity(model, name, cases)
    if args.rotation_ablation:
        return
    if not args.skip_speed:
        decode_step(model, name, args.runs, args.step_tokens, args.touched_pool)


if __name__ == "__main__":
    main()
