"""Forward-pass throughput: radixkv's paged model vs transformers on the same weights.

Measures, in one process:

* prefill tokens/s on a 1,024-token prompt (one request);
* decode tokens/s at batch 1, 16 and 64 with a context of ``--ctx`` tokens per sequence.

For transformers the prefill is ``model(ids, logits_to_keep=1)`` (what ``generate`` does) and a
decode step is ``model(next_ids, past_key_values=cache)`` on a ``DynamicCache`` pre-filled with
random K/V of the same context length (the values do not change the cost). For radixkv the KV
pool is filled the same way and each step is one ``ModelRunner.forward`` over a batch of decodes
with shuffled page ids (the batch is rebuilt from lists every step, as the engine does).

The machine this was written on is shared, so every measurement is *interleaved*: each
repetition runs every system once, and the table reports medians.

Usage (from the repo root)::

    .venv/bin/python bench/bench_model.py            # SmolLM2-135M, full table
    .venv/bin/python bench/bench_model.py --quick    # fewer repetitions
"""

from __future__ import annotations

import argparse
import copy
import inspect
import time
from collections.abc import Callable

import torch

from radixkv.model.loader import load_model
from radixkv.model.runner import ModelRunner, RequestSlice

# metric name -> (tokens per call, callable)
Cases = dict[str, tuple[int, Callable[[], object]]]


def cases_ours(
    loaded: object, dtype: torch.dtype, prompt_len: int, ctx: int, batches: list[int], steps: int
) -> Cases:
    """Our ModelRunner: prefill and decode callables."""
    page = 16
    pages_per_seq = -(-(ctx + 1) // page)
    need = max(max(batches) * pages_per_seq, -(-prompt_len // page)) + 1
    runner = ModelRunner(loaded, num_pages=need, page_size=page, dtype=dtype)
    for k, v in zip(runner.pool.k, runner.pool.v):
        k.normal_()
        v.normal_()
    g = torch.Generator().manual_seed(0)
    vocab = runner.vocab_size
    prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
    pages = torch.randperm(need, generator=g)[: -(-prompt_len // page)].tolist()
    prefill = runner.build_batch([RequestSlice(prompt, 0, pages)])
    cases: Cases = {"prefill": (prompt_len, lambda: runner.forward(prefill))}
    for b in batches:
        perm = torch.randperm(need, generator=g).tolist()
        tables = [perm[i * pages_per_seq : (i + 1) * pages_per_seq] for i in range(b)]

        def step(b: int = b, tables: list[list[int]] = tables) -> None:
            toks = torch.randint(0, vocab, (b,), generator=g).tolist()
            for s in range(steps):
                # the context stays ~ctx: each call rewrites the same last slots
                reqs = [RequestSlice([toks[i]], ctx - steps + s, tables[i]) for i in range(b)]
                toks = runner.forward(runner.build_batch(reqs)).argmax(-1).tolist()

        cases[f"decode{b}"] = (b * steps, step)
    return cases


def cases_hf(
    hf_model: torch.nn.Module, prompt_len: int, ctx: int, batches: list[int], steps: int
) -> Cases:
    """transformers' own forward with a DynamicCache: prefill and decode callables."""
    from transformers import DynamicCache

    cfg = hf_model.config
    dtype = next(hf_model.parameters()).dtype
    hkv = cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, prompt_len), generator=g)

    @torch.inference_mode()
    def prefill() -> None:
        hf_model(ids, logits_to_keep=1)

    cases: Cases = {"prefill": (prompt_len, prefill)}
    for b in batches:
        base = DynamicCache(config=cfg)
        for layer in range(cfg.num_hidden_layers):
            k = torch.randn(b, hkv, ctx - steps, d, dtype=dtype)
            base.update(k, torch.randn_like(k), layer)

        @torch.inference_mode()
        def step(b: int = b, base: DynamicCache = base) -> None:
            # crop back to ctx - steps so every call sees the same context (cheap: a view)
            extra = base.get_seq_length() - (ctx - steps)
            if extra > 0:
                base.crop(-extra)
            nxt = torch.randint(0, cfg.vocab_size, (b, 1), generator=g)
            # transformers 5.25 renamed the forward's past_key_values to cache
            params = inspect.signature(hf_model.forward).parameters
            cache_kw = "cache" if "cache" in params else "past_key_values"
            for _ in range(steps):
                out = hf_model(nxt, use_cache=True, **{cache_kw: base})
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)

        cases[f"decode{b}"] = (b * steps, step)
    return cases


def main() -> None:
    """Run the benchmark and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--ctx", type=int, default=384, help="decode context per sequence")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="reps=1, decode-steps=4")
    ap.add_argument("--skip-hf", action="store_true", help="only our forward pass")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.decode_steps = 1, 4
    batches = [int(x) for x in args.batches.split(",")]
    torch.manual_seed(0)
    loaded = load_model(args.model)
    print(f"model {loaded.name}; torch {torch.__version__}; threads {torch.get_num_threads()}")
    common = (args.prompt_len, args.ctx, batches, args.decode_steps)
    systems: dict[str, Cases] = {
        "radixkv bf16": cases_ours(loaded, torch.bfloat16, *common),
        "radixkv fp32": cases_ours(loaded, torch.float32, *common),
    }
    if not args.skip_hf:
        systems["transformers fp32"] = cases_hf(loaded.hf_model.float(), *common)
        hf_bf16 = copy.deepcopy(loaded.hf_model).to(torch.bfloat16)
        systems["transformers bf16"] = cases_hf(hf_bf16, *common)
    metrics = ["prefill"] + [f"decode{b}" for b in batches]
    rows: dict[str, dict[str, float]] = {name: {} for name in systems}
    for metric in metrics:
        times: dict[str, list[float]] = {name: [] for name in systems}
        for cases in systems.values():  # warm-up
            cases[metric][1]()
        for _ in range(args.reps):
            for name, cases in systems.items():
                t0 = time.perf_counter()
                cases[metric][1]()
                times[name].append(time.perf_counter() - t0)
        for name, cases in systems.items():
            ts = sorted(times[name])
            rows[name][metric] = cases[metric][0] / ts[len(ts) // 2]
        print(metric, {n: round(r[metric], 1) for n, r in rows.items()}, flush=True)
    head = ["tokens/s", f"prefill {args.prompt_len}"] + [
        f"decode b={b} ctx={args.ctx}" for b in batches
    ]
    print()
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(f"{r[c]:.0f}" for c in metrics) + " |")
    if "transformers fp32" in rows:
        for ours in ("radixkv bf16", "radixkv fp32"):
            for base in ("transformers fp32", "transformers bf16"):
                ratio = " | ".join(f"{rows[ours][c] / rows[base][c]:.1f}x" for c in metrics)
                print(f"| {ours} / {base} | {ratio} |")


if __name__ == "__main__":
    main()
