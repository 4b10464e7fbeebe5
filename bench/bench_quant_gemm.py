"""radixkv's GEMM over GGUF block-quantized weights vs its float32 GEMM and F.linear, on SmolLM2-135M's
linear shapes, weights streamed from memory.

    flock /tmp/bench.lock .venv/bin/python -m bench.bench_quant_gemm            # M = 1, 4, 8, 64
    flock /tmp/bench.lock .venv/bin/python -m bench.bench_quant_gemm --rows 1 --rounds 9

For each shape (N x K: qkv 960 x 576, o_proj 576 x 576, gate_up 3072 x 576, down 576 x 1536,
lm_head 49152 x 576) and row count M it times

* ``q4_1``, ``q8_0``: ``quant_gemm_into`` over the raw GGML rows (``gguf.quants.quantize`` of a
  random matrix), into a preallocated float32 output: float activations;
* ``q4_1_q8``, ``q8_0_q8`` (the q8dot columns, M <= 8 only): ``quant_gemm_q8_into`` over the same
  rows, x quantized to int8 per block and integer dot products (llama.cpp's way);
* ``f32_gemm``: radixkv's float32 GEMM over ``pack_f32_weight``'s layout;
* ``F.linear``: torch's float32 linear (MKL) on the plain weight;

each over enough distinct copies of its weight (at least 160 MB in all) cycled call after call
that every call reads its weight from DRAM, as a forward does (a decode step streams each
layer's weights once). It prints milliseconds per call and the weight bytes read per second, and
per M a ``model`` line: 30 layers of qkv + o_proj + gate_up + down plus one lm_head, the time a
forward's linears take at these speeds (``q4_1`` with the Q8_0 head of SmolLM2's Q4_1 file, and
``q4_1_q8`` with ``q8_0_q8``'s).
Each call is timed alone and the paths interleave; a path's figure is the median over ``--rounds``
rounds of calls (the host is shared: see :func:`median_time`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from radixkv.model import native
from radixkv.model.platform_info import format_platform_info, platform_info

SHAPES = {  # name: (N, K, times per forward)
    "qkv": (960, 576, 30),
    "o_proj": (576, 576, 30),
    "gate_up": (3072, 576, 30),
    "down": (576, 1536, 30),
    "lm_head": (49152, 576, 1),
}
STREAM_BYTES = 160 << 20


def copies_of(t: torch.Tensor) -> list[torch.Tensor]:
    """Distinct copies of ``t`` totalling at least STREAM_BYTES (at least 2)."""
    count = max(2, -(-STREAM_BYTES // (t.numel() * t.element_size())))
    return [t.clone() for _ in range(count)]


def median_time(fns: dict[str, Callable[[int], object]], rounds: int) -> dict[str, float]:
    """Median seconds per call of each ``fn(i)`` (i: the call's index), each call timed alone,
    over ``rounds`` interleaved rounds of ~30 ms per path: on a shared host a call whose worker
    thread lost its core to another process takes a scheduler quantum (milliseconds) longer, and
    the median leaves those calls out where a mean or a round's total would not."""
    for fn in fns.values():
        fn(0)
        fn(1)
    calls: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            spent, i = 0.0, 0
            while spent < 0.03 or i < 3:
                t = time.perf_counter()
                fn(i)
                dt = time.perf_counter() - t
                calls[name].append(dt)
                spent += dt
                i += 1
    return {k: statistics.median(v) for k, v in calls.items()}


def paths(n: int, k: int, m: int, mod: object) -> tuple[dict[str, Callable[[int], object]], dict]:
    """The timed calls of one shape and their weight bytes per call."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g)
    out = torch.empty(m, n)
    fns: dict[str, Callable[[int], object]] = {}
    nbytes: dict[str, int] = {}
    for name, qtype in (("q4_1", GGMLQuantizationType.Q4_1), ("q8_0", GGMLQuantizationType.Q8_0)):
        qs = copies_of(torch.from_numpy(quants.quantize(w.numpy(), qtype)))
        fns[name] = lambda i, qs=qs, t=int(qtype): mod.quant_gemm_into(x, qs[i % len(qs)], t, out)
        nbytes[name] = qs[0].numel()
        if m <= mod.quant_dot_max_rows():
            fns[name + "_q8"] = lambda i, qs=qs, t=int(qtype): mod.quant_gemm_q8_into(
                x, qs[i % len(qs)], t, out
            )
            nbytes[name + "_q8"] = nbytes[name]
    packed = copies_of(mod.pack_f32_weight(w))
    fns["f32_gemm"] = lambda i: mod.f32_gemm(x, packed[i % len(packed)])
    plain = copies_of(w)
    fns["F.linear"] = lambda i: F.linear(x, plain[i % len(plain)])
    nbytes["f32_gemm"] = nbytes["F.linear"] = w.numel() * 4
    return fns, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,8,64", help="comma-separated row counts M")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    mod = native.load()
    assert mod is not None, native.build_error()
    print("host:", format_platform_info(platform_info(torch.float32)))
    print(f"kernels: {native.kernel_isa()}, torch threads {torch.get_num_threads()}")
    for m in (int(r) for r in args.rows.split(",")):
        names: tuple[str, ...] = ("q4_1", "q8_0", "f32_gemm", "F.linear")
        if m <= mod.quant_dot_max_rows():
            names = ("q4_1_q8", "q8_0_q8", *names)
        print(f"\nM={m}  " + "  ".join(f"{p:>20s}" for p in names) + "   (ms, weight GB/s)")
        model = dict.fromkeys(names, 0.0)
        for shape, (n, k, times) in SHAPES.items():
            fns, nbytes = paths(n, k, m, mod)
            with torch.inference_mode():
                best = median_time(fns, args.rounds)
            cells = "  ".join(
                f"{best[p] * 1e3:8.3f} {nbytes[p] / best[p] / 1e9:6.1f} GB/s" for p in names
            )
            print(f"{shape:8s} {n:5d}x{k:<4d} {cells}")
            for p in names:
                # SmolLM2's Q4_1 file stores lm_head (token_embd) as Q8_0
                src = p.replace("q4_1", "q8_0") if shape == "lm_head" else p
                model[p] += best[src] * times
            del fns
        print(
            f"{'model':14s} "
            + "  ".join(f"{model[p] * 1e3:8.3f} {'':11s}" for p in names)
            + "  (30 layers + lm_head; q4_1 with a Q8_0 head)"
        )
        if "q4_1_q8" in model:
            print(
                f"  q8dot / float activations (q4_1 model): {model['q4_1_q8'] / model['q4_1']:.2f}x"
            )


if __name__ == "__main__":
    main()
