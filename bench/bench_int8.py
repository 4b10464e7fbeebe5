"""``--quantization int8`` against the unquantized model: perplexity, decode step, load memory.

    .venv/bin/python -m bench.bench_int8 [--model smollm2] [--dtype float32] [--runs 5]

- **perplexity** of bench/data's two fixed texts (every token's prompt logprob, one prompt
  each), unquantized and int8, and the time of that prefill (one run each);
- **decode step at batch 1**: one request decoding ``--tokens`` tokens, the median step after
  the prefill, the two engines stepped alternately (one step of each in turn) so the host's
  drift lands on both; ``--runs`` rounds of fresh requests, each round's int8/unquantized ratio
  and the median of the ratios printed;
- **kernels**: the int8 product alone at 1-8 rows, per weight, on radixkv's native kernel, ATen's
  and by dequantizing, against ``F.linear`` on the float weight;
- **load memory**: in a fresh process each, the resident set the model's load added (above a
  process that imported the libraries) and the bytes of the decoder layers' tensors.

SmolLM2 is read from its GGUF (Q4_1, dequantized to ``--dtype``), so "unquantized" is that
dequantized model and int8 re-quantizes it; ``gguf`` serves the file's own Q4_1 blocks (the same
weights as "unquantized": its perplexity differs by the arithmetic only). ``--quantizations``
picks the ones compared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from bench.bench_kv_quant import TEXTS, text_perplexity
from radixkv import Engine, SamplingParams

#: the quantizations compared (``--quantizations``; None: unquantized)
QUANTS: tuple[str | None, ...] = (None, "int8", "gguf")

CHILD = r"""
import json, sys
import torch
from radixkv.model.loader import load_model
from radixkv.model.runner import ModelRunner

def rss_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])

name, dtype, quant = sys.argv[1], getattr(torch, sys.argv[2]), sys.argv[3] or None
base = rss_kib()
runner = ModelRunner(load_model(name, dtype=dtype, hf_model=False, quantization=quant),
                     num_pages=2, page_size=16, dtype=dtype, quantization=quant)
# parameters, buffers and the packed copies PackedLinear holds as plain attributes
tensors = {id(t): t for m in runner.model.layers.modules() for t in
           [*m.parameters(recurse=False), *m.buffers(recurse=False),
            *(v for v in vars(m).values() if isinstance(v, torch.Tensor))]}
layers = sum(t.numel() * t.element_size() for t in tensors.values() if not t.is_meta)
print(json.dumps({"added_kib": rss_kib() - base, "layer_bytes": layers}))
"""


def label(quant: str | None) -> str:
    return quant or "unquantized"


def perplexity(model: str, dtype: str, quants: tuple[str | None, ...] = QUANTS) -> None:
    for path in TEXTS:
        results, seconds = {}, {}
        for quant in quants:
            e = Engine(model, dtype=dtype, quantization=quant, kv_cache_tokens=16384)
            t0 = time.perf_counter()
            results[label(quant)], n = text_perplexity(e, path.read_text())
            seconds[label(quant)] = time.perf_counter() - t0
        base = results["unquantized"]
        print(f"perplexity of bench/data/{path.name} ({n} tokens, {dtype}):", flush=True)
        for name, ppl in results.items():
            print(
                f"  {name:12s} {ppl:.4f}  ({(ppl / base - 1) * 100:+.2f}%), the prefill with "
                f"every prompt logprob {seconds[name]:.1f} s",
                flush=True,
            )


def decode_steps(
    model: str, dtype: str, runs: int, tokens: int, quants: tuple[str | None, ...] = QUANTS
) -> None:
    engines = {q: Engine(model, dtype=dtype, quantization=q, kv_cache_tokens=4096) for q in quants}
    prompt = engines[None].tokenizer.encode("The history of the printing press began")
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    medians: dict[str | None, list[float]] = {q: [] for q in quants}
    for run in range(runs):
        steps: dict[str | None, list[float]] = {q: [] for q in quants}
        for e in engines.values():
            e.add_request(f"r{run}", prompt, params)
            e.step()  # the prefill
        while any(e.has_unfinished() for e in engines.values()):
            for q, e in engines.items():
                if e.has_unfinished():
                    t0 = time.perf_counter()
                    e.step()
                    steps[q].append((time.perf_counter() - t0) * 1e3)
        for q in quants:
            medians[q].append(statistics.median(steps[q][2:]))
        row = ", ".join(
            f"{label(q)} {medians[q][-1]:.2f} ms ({medians[q][-1] / medians[None][-1]:.3f}x)"
            for q in quants
        )
        print(f"  round {run}: {row}", flush=True)
    print(f"decode step at batch 1 ({dtype}, {tokens} tokens, {runs} rounds), medians:")
    for q in quants:
        ratios = [m / b for m, b in zip(medians[q], medians[None], strict=True)]
        print(
            f"  {label(q):12s} {statistics.median(medians[q]):.2f} ms, /unquantized "
            f"{statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})"
        )


def load_memory(model: str, dtype: str, quants: tuple[str | None, ...] = QUANTS) -> None:
    print(f"load ({dtype}), each in a fresh process:")
    for quant in quants:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, model, dtype, quant or ""],
            capture_output=True,
            text=True,
            check=True,
        )
        got: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"  {label(quant):12s} resident set added {got['added_kib'] / 1024:.1f} MiB, decoder "
            f"layers' tensors {got['layer_bytes'] / 2**20:.1f} MiB",
            flush=True,
        )


def kernels(weights: int = 30, rows_list: tuple[int, ...] = (1, 2, 4, 8)) -> None:
    """Per 1728x576 weight (``weights`` distinct ones, streamed from DRAM, min of 7): the int8
    product on radixkv's native kernel, on ATen's ``_weight_int8pack_mm``, by dequantizing and
    ``F.linear``, against ``F.linear`` on the float32 weight."""
    import torch
    import torch.nn.functional as F

    from radixkv.model import native
    from radixkv.model.int8_linear import dequantize, quantize_per_channel

    module = native.load()
    torch.manual_seed(0)
    ws = [torch.randn(1728, 576) for _ in range(weights)]
    qs = [quantize_per_channel(w) for w in ws]

    def best_ms(fn: Any, x: torch.Tensor) -> float:
        fn(x)
        best = float("inf")
        for _ in range(7):
            t0 = time.perf_counter()
            fn(x)
            best = min(best, time.perf_counter() - t0)
        return best / weights * 1e3

    candidates: dict[str, Any] = {}
    if module is not None and hasattr(module, "int8_linear_rows"):
        candidates["native"] = lambda x: [module.int8_linear_rows(x, *q) for q in qs]
    if hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        aten = torch.ops.aten._weight_int8pack_mm
        candidates["aten int8pack"] = lambda x: [aten(x, *q) for q in qs]
    candidates["dequantize+F.linear"] = lambda x: [
        F.linear(x, dequantize(*q, torch.float32)) for q in qs
    ]
    candidates["F.linear float32"] = lambda x: [F.linear(x, w) for w in ws]
    print(f"int8 kernels, ms per 1728x576 weight ({weights} streamed, min of 7, float32 x):")
    for rows in rows_list:
        x = torch.randn(rows, 576)
        cells = ", ".join(f"{name} {best_ms(fn, x):.3f}" for name, fn in candidates.items())
        print(f"  {rows} rows: {cells}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--only", choices=("perplexity", "step", "memory", "kernels"), default=None)
    ap.add_argument(
        "--quantizations",
        default="none,int8,gguf",
        help="compared: none (unquantized, always the baseline), int8, gguf (the GGUF's own blocks)",
    )
    args = ap.parse_args()
    quants = (None, *(q for q in args.quantizations.split(",") if q in QUANTS))
    if args.only in (None, "memory"):
        load_memory(args.model, args.dtype, quants)
    if args.only in (None, "perplexity"):
        perplexity(args.model, args.dtype, quants)
    if args.only in (None, "step"):
        decode_steps(args.model, args.dtype, args.runs, args.tokens, quants)
    if args.only in (None, "kernels"):
        kernels()


if __name__ == "__main__":
    main()
