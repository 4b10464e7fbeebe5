"""The model's linears vs a plain matmul of the same shape, measured side by side in one run.

    .venv/bin/python -m bench.bench_linears                 # SmolLM2-135M shapes, M = 1, 64, 1024
    .venv/bin/python -m bench.bench_linears --all           # + every candidate CPU path
    .venv/bin/python -m bench.bench_linears --dtype bfloat16 --rows 64

For each of the decoder's matmuls (fused QKV, o_proj, fused gate/up, down_proj, and lm_head,
which only runs on the last rows, so at M <= 64) and each row count M (1 = batch-1 decode,
64 = batch-64 decode, 1024 = a prefill chunk), it times

* ``radixkv``: the model's own module (``layer.qkv_proj(x)`` ...) from a real ``ModelRunner``
  (whatever path :mod:`radixkv.model.linear` picked for this host and dtype);
* ``matmul``: ``torch.matmul(x, w_t)`` with ``w_t = W.T`` contiguous, the plain reference;

and prints GFLOP/s and the fraction radixkv/matmul, plus the FLOP-weighted total per M. Then,
per M, one pass over every linear of the model with each layer's own weights (streamed from
memory, as in a forward; the per-shape rows reuse one cache-resident matrix): radixkv's modules
vs ``F.linear`` (MKL) on the plain weights. With
``--all`` it also times the candidates radixkv chooses from (``F.linear``, oneDNN with the
weight prepacked by ``torch.ops.mkldnn._reorder_linear_weight``, MKL packed sgemm via
``torch.ops.mkl._mkl_linear``, and radixkv's own GEMM, ``radixkv_gemm``, where its build has
one for the dtype). Timings interleave the paths and keep each one's best of
``--rounds`` rounds (the host is shared; the best round is the least disturbed one).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

# this bench compares radixkv's packed linears with F.linear on the same layers' plain weights,
# which the model otherwise drops where the native GEMM reads only the packed copy
os.environ.setdefault("RADIXKV_KEEP_PLAIN_WEIGHTS", "1")

from radixkv.model.linear import native_gemm_module
from radixkv.model.loader import load_model
from radixkv.model.platform_info import format_platform_info, platform_info
from radixkv.model.runner import ModelRunner, default_dtype


def best_time(fns: dict[str, Callable[[], object]], flop: float, rounds: int) -> dict[str, float]:
    """Best seconds per call of each function, timed in interleaved rounds of ~20 ms each."""
    for fn in fns.values():  # warm: oneDNN builds its kernels on first use per shape
        fn()
        fn()
    t = time.perf_counter()
    next(iter(fns.values()))()
    one = max(time.perf_counter() - t, 1e-6)
    reps = max(2, min(500, int(0.02 / one)))
    best = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t) / reps)
    return best


def candidates(w: torch.Tensor, m: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The CPU linear paths radixkv can choose from, for weight ``w [N, K]``."""
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"F.linear": lambda x: F.linear(x, w)}
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        out["onednn_packed"] = lambda x: torch.ops.mkldnn._linear_pointwise(
            x, packed, None, "none", [], ""
        )
    except (RuntimeError, AttributeError):
        pass
    native = native_gemm_module(w)
    if native is not None:
        bf16 = w.dtype == torch.bfloat16
        native_w = (native.pack_bf16_weight if bf16 else native.pack_f32_weight)(w)
        gemm = native.bf16_gemm if bf16 else native.f32_gemm
        out["radixkv_gemm"] = lambda x: gemm(x, native_w)
    if w.dtype == torch.float32:
        try:
            mkl_w = torch.ops.mkl._mkl_reorder_linear_weight(w, m)
            out["mkl_packed"] = lambda x: torch.ops.mkl._mkl_linear(x, mkl_w, w, None, m)
        except (RuntimeError, AttributeError):
            pass
    return out


def streamed(model: torch.nn.Module, m: int, dtype: torch.dtype, rounds: int) -> None:
    """One pass over every linear of the model, each layer's own weights in order, as a forward
    streams them from memory (a single cache-resident matrix flatters small-M GEMMs): radixkv's
    modules vs ``F.linear`` on the plain weights (MKL), best of ``rounds`` passes."""
    mods = [
        mod for mod in model.modules() if hasattr(mod, "weight") and hasattr(mod, "out_features")
    ]
    g = torch.Generator().manual_seed(1)
    xs = {k: torch.randn(m, k, generator=g).to(dtype) for k in {mod.in_features for mod in mods}}
    flop = sum(2.0 * m * mod.in_features * mod.out_features for mod in mods)
    byts = sum(mod.weight.numel() * mod.weight.element_size() for mod in mods)
    passes = {
        "radixkv": lambda: [mod(xs[mod.in_features]) for mod in mods],
        "F.linear": lambda: [F.linear(xs[mod.in_features], mod.weight) for mod in mods],
    }
    best = {k: float("inf") for k in passes}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, fn in passes.items():
                t = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t)
    cells = "  ".join(
        f"{k} {v * 1e3:7.1f} ms {flop / v / 1e9:6.1f} GFLOP/s {byts / v / 1e9:5.1f} GB/s"
        for k, v in best.items()
    )
    print(f"streamed M={m:<5d} {cells}  F.linear/radixkv {best['F.linear'] / best['radixkv']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,64,1024", help="comma-separated row counts M")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--all", action="store_true", help="also time every candidate path")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype) if args.dtype else default_dtype("cpu")
    rows = [int(r) for r in args.rows.split(",")]

    print("host:", format_platform_info(platform_info(dtype)))
    runner = ModelRunner(load_model("smollm2"), num_pages=1, page_size=16, dtype=dtype)
    model = runner.model
    layer = model.layers[0]
    mods = {
        "qkv": layer.qkv_proj,
        "o_proj": layer.o_proj,
        "gate_up": layer.gate_up_proj,
        "down": layer.down_proj,
        "lm_head": model.lm_head,
    }
    per_layer = {"qkv", "o_proj", "gate_up", "down"}
    n_layers = len(model.layers)
    g = torch.Generator().manual_seed(0)
    print(f"dtype {str(dtype).removeprefix('torch.')}, torch threads {torch.get_num_threads()}")
    header = (
        f"{'matmul':8s} {'M':>5s} {'N':>6s} {'K':>5s} {'radixkv':>8s} {'matmul':>8s} {'frac':>5s}"
    )
    for m in rows:
        print(f"\n{header}  (GFLOP/s)" + ("  candidates" if args.all else ""))
        tot_ours = tot_ref = tot_flop = 0.0
        for name, mod in mods.items():
            if name == "lm_head" and m > 64:
                continue  # lm_head runs on each request's last row only
            w = mod.weight.detach()
            n, k = w.shape
            x = torch.randn(m, k, generator=g).to(dtype)
            w_t = w.t().contiguous()
            flop = 2.0 * m * n * k
            fns: dict[str, Callable[[], object]] = {
                "radixkv": lambda mod=mod, x=x: mod(x),
                "matmul": lambda x=x, w_t=w_t: torch.matmul(x, w_t),
            }
            if args.all:
                for cname, fn in candidates(w, m).items():
                    fns[cname] = lambda fn=fn, x=x: fn(x)
            with torch.inference_mode():
                best = best_time(fns, flop, args.rounds)
            gf = {kk: flop / v / 1e9 for kk, v in best.items()}
            extra = (
                "  "
                + " ".join(
                    f"{kk} {v:.1f}"
                    for kk, v in gf.items()
                    if kk not in fns or kk not in ("radixkv", "matmul")
                )
                if args.all
                else ""
            )
            print(
                f"{name:8s} {m:5d} {n:6d} {k:5d} {gf['radixkv']:8.1f} {gf['matmul']:8.1f} "
                f"{gf['radixkv'] / gf['matmul']:5.2f}{extra}"
            )
            times = n_layers if name in per_layer else 1
            tot_ours += best["radixkv"] * times
            tot_ref += best["matmul"] * times
            tot_flop += flop * times
        print(
            f"{'forward':8s} {m:5d} {'':6s} {'':5s} {tot_flop / tot_ours / 1e9:8.1f} "
            f"{tot_flop / tot_ref / 1e9:8.1f} {tot_ref / tot_ours:5.2f}  (all {n_layers} layers "
            f"+ lm_head, FLOP-weighted)"
        )
    print(
        f"\nevery linear of the model once, weights streamed from memory ({len(model.layers)} layers)"
    )
    for m in rows:
        streamed(model, m, dtype, max(3, args.rounds // 2))


if __name__ == "__main__":
    main()
