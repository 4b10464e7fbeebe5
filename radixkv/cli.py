"""``radixkv`` command line.

Each subcommand is one ``add_<name>_parser(subparsers)`` function that defines its arguments and
sets ``func`` (called with the parsed namespace, returns an exit code). To add a subcommand,
write such a function and append it to :data:`SUBCOMMANDS`. Import heavy modules (torch, the
engine, matplotlib) inside the ``func`` so that e.g. ``radixkv simulate`` never imports torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["SUBCOMMANDS", "add_info_parser", "add_simulate_parser", "build_parser", "main"]


# ---------------------------------------------------------------------------- simulate
def _parse_capacities(text: str) -> list[int]:
    try:
        caps = [int(float(x)) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--sweep expects comma-separated token counts like 50000,100000, got {text!r}"
        ) from None
    if not caps or any(c < 0 for c in caps):
        raise argparse.ArgumentTypeError(f"--sweep needs non-negative capacities, got {text!r}")
    return caps


def _parse_policies(text: str) -> list[str]:
    from radixkv.cache.radix_tree import EVICTION_POLICIES

    pols = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in pols if p not in EVICTION_POLICIES]
    if bad or not pols:
        raise argparse.ArgumentTypeError(
            f"unknown policy {bad or text!r}; choose from {','.join(EVICTION_POLICIES)}"
        )
    return pols


def _plot_sweep(rows: list[dict[str, Any]], optimal: float, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        pts = sorted(
            (r["capacity_tokens"], r["token_hit_rate"]) for r in rows if r["policy"] == policy
        )
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
    ax.axhline(optimal, color="gray", linestyle="--", label="unbounded")
    ax.set_xlabel("KV capacity (tokens)")
    ax.set_ylabel("token hit rate")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _run_simulate(args: argparse.Namespace) -> int:
    from radixkv.sim.simulator import RESULT_KEYS, prepare_trace, simulate
    from radixkv.sim.workloads import read_jsonl

    if args.page_size < 1:
        print("radixkv simulate: --page-size must be >= 1", file=sys.stderr)
        return 2
    if args.plot and args.sweep is None:
        print("radixkv simulate: --plot needs --sweep C1,C2,...", file=sys.stderr)
        return 2
    if args.html and args.sweep is not None:
        print("radixkv simulate: --html reports one capacity (not --sweep)", file=sys.stderr)
        return 2
    try:
        trace = prepare_trace(read_jsonl(args.trace))
    except (OSError, ValueError) as e:
        print(f"radixkv simulate: cannot read trace: {e}", file=sys.stderr)
        return 2
    if args.kv_memory_gb is not None:
        if args.capacity_tokens is not None or args.sweep is not None:
            print(
                "radixkv simulate: give --kv-memory-gb or --capacity-tokens/--sweep",
                file=sys.stderr,
            )
            return 2
        try:
            args.capacity_tokens = _tokens_for_memory(args)
        except ValueError as e:
            print(f"radixkv simulate: {e}", file=sys.stderr)
            return 2
        print(
            f"capacity: {args.capacity_tokens} tokens ({args.kv_memory_gb} GiB of "
            f"{args.kv_cache_dtype} KV, geometry {args.geometry})",
            file=sys.stderr,
        )
    if args.sweep is None:
        if args.capacity_tokens is not None and args.capacity_tokens < 0:
            print("radixkv simulate: --capacity-tokens must be >= 0", file=sys.stderr)
            return 2
        res = simulate(
            trace,
            args.capacity_tokens,
            args.page_size,
            args.policy,
            host_capacity_tokens=args.host_capacity_tokens,
            disk_capacity_tokens=args.disk_capacity_tokens,
            remote_capacity_tokens=args.remote_capacity_tokens,
        )
        keys = [k for k in (*RESULT_KEYS, "cached_tokens_by_tier") if k in res]
        if args.html:
            _write_html_report(args, trace, {k: res[k] for k in keys})
        if args.json:
            print(json.dumps({k: res[k] for k in keys}))
        else:
            width = max(len(k) for k in keys)
            for k in keys:
                v = res[k]
                print(f"{k:<{width}}  {v:.4f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
        return 0

    rows: list[dict[str, Any]] = []
    for policy in args.sweep_policies:
        for cap in args.sweep:
            res = simulate(trace, cap, args.page_size, policy)
            rows.append({"policy": policy, "capacity_tokens": cap, **res})
    optimal = rows[0]["optimal_hit_rate"] if rows else 0.0
    if args.plot:
        _plot_sweep(rows, optimal, args.plot, f"{args.trace} (page size {args.page_size})")
    if args.json:
        print(json.dumps({"optimal_hit_rate": optimal, "sweep": rows, "plot": args.plot}))
    else:
        print(f"{'policy':<6}  {'capacity':>10}  {'hit_rate':>8}  {'evictions':>10}")
        for r in rows:
            print(
                f"{r['policy']:<6}  {r['capacity_tokens']:>10}  {r['token_hit_rate']:>8.4f}  "
                f"{r['evictions']:>10}"
            )
        print(f"optimal (unbounded) hit rate: {optimal:.4f}")
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def _tokens_for_memory(args: argparse.Namespace) -> int:
    """``--kv-memory-gb`` as tokens (``ValueError`` naming a bad geometry or budget)."""
    from radixkv.sim.capacity import GEOMETRIES, tokens_for_memory

    geometry = GEOMETRIES.get(args.geometry)
    if geometry is None:
        parts = args.geometry.split(",")
        if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
            raise ValueError(
                f"--geometry {args.geometry!r}: a model ({', '.join(GEOMETRIES)}) or "
                "LAYERS,KV_HEADS,HEAD_DIM"
            )
        geometry = (int(parts[0]), int(parts[1]), int(parts[2]))
    if not args.kv_memory_gb > 0:
        raise ValueError("--kv-memory-gb must be > 0")
    return tokens_for_memory(args.kv_memory_gb, geometry, args.kv_cache_dtype)


def _write_html_report(args: argparse.Namespace, trace: list[Any], summary: dict[str, Any]) -> None:
    """``--html``: the dashboard page with the replay's hit rate over time and final tree."""
    from radixkv.server.dashboard import render_page
    from radixkv.sim.report import hash_vocabulary, simulation_report, vocabulary_decoder
    from radixkv.sim.simulator import unbounded_capacity
    from radixkv.sim.workloads import read_jsonl

    cap = args.capacity_tokens
    if cap is None:
        cap = unbounded_capacity(trace, args.page_size)
    doc = simulation_report(
        trace,
        cap,
        page_size=args.page_size,
        policy=args.policy,
        host_capacity_tokens=args.host_capacity_tokens,
        disk_capacity_tokens=args.disk_capacity_tokens,
        remote_capacity_tokens=args.remote_capacity_tokens,
        max_nodes=args.html_max_nodes,
        decode=vocabulary_decoder(hash_vocabulary(read_jsonl(args.trace))),
        title=f"simulate {args.trace} ({cap} tokens, {args.policy}, page {args.page_size})",
        summary=summary,
    )
    with open(args.html, "w", encoding="utf-8") as f:
        f.write(render_page(doc))
    if not args.json:
        print(f"report written to {args.html}")


def add_simulate_parser(sub: argparse._SubParsersAction) -> None:
    """``radixkv simulate``: replay a JSONL trace through the prefix cache (no model, no torch)."""
    from radixkv.sim.capacity import ELEMENT_BYTES  # torch-free

    p = sub.add_parser(
        "simulate",
        help="replay a JSONL request trace through the prefix cache and report hit rates",
        description="Replay a JSONL trace (see bench/workloads.py) through the real RadixTree "
        "and BlockAllocator and report token hit rate, optimal (unbounded) hit rate, "
        "evictions and replay speed.",
    )
    p.add_argument("--trace", required=True, help="JSONL file, one request per line")
    p.add_argument(
        "--capacity-tokens",
        type=int,
        default=None,
        help="device KV capacity in tokens (default: unbounded, nothing is ever evicted)",
    )
    p.add_argument(
        "--kv-memory-gb",
        type=float,
        default=None,
        help="device KV capacity as memory (GiB) instead of tokens: converted to tokens for "
        "--kv-cache-dtype and --geometry",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=list(ELEMENT_BYTES),
        default="bfloat16",
        help="with --kv-memory-gb: the KV dtype that sizes a token (int8/fp8 count their "
        "scales; default bfloat16)",
    )
    p.add_argument(
        "--geometry",
        default="smollm2",
        help="with --kv-memory-gb: a model name (smollm2, llama3-8b) or LAYERS,KV_HEADS,HEAD_DIM",
    )
    p.add_argument("--page-size", type=int, default=1, help="tokens per KV page (default 1)")
    p.add_argument("--policy", choices=["lru", "lfu", "fifo"], default="lru")
    p.add_argument(
        "--host-capacity-tokens", type=int, default=0, help="host tier capacity (0 = none)"
    )
    p.add_argument(
        "--disk-capacity-tokens", type=int, default=0, help="disk tier capacity (0 = none)"
    )
    p.add_argument(
        "--remote-capacity-tokens",
        type=int,
        default=0,
        help="remote (Redis) tier capacity (0 = none)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--sweep",
        type=_parse_capacities,
        default=None,
        metavar="C1,C2,...",
        help="replay at each capacity (tokens) for every policy in --sweep-policies",
    )
    p.add_argument(
        "--sweep-policies",
        type=_parse_policies,
        default=["lru", "lfu", "fifo"],
        metavar="P1,P2",
        help="policies for --sweep (default lru,lfu,fifo)",
    )
    p.add_argument("--plot", default=None, help="with --sweep: write hit rate vs capacity PNG")
    p.add_argument(
        "--html",
        default=None,
        metavar="REPORT.html",
        help="write a self-contained page: hit rate over the replay and the final radix tree",
    )
    p.add_argument(
        "--html-max-nodes", type=int, default=300, help="tree nodes in the --html report"
    )
    p.set_defaults(func=_run_simulate)


# ---------------------------------------------------------------------------- serve
def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    from radixkv.server.cli import add_serve_parser as add

    add(sub)


# ---------------------------------------------------------------------------- prepare-model
def _run_prepare_model(args: argparse.Namespace) -> int:
    from radixkv.model.loader import ModelNotFoundError, load_model

    try:
        loaded = load_model(args.model)
    except ModelNotFoundError as exc:
        print(f"radixkv prepare-model: {exc}", file=sys.stderr)
        return 2
    print(f"{loaded.name}: ready")
    from radixkv.model import native

    if native.load() is None:  # the engine falls back to pure-torch attention
        print(f"native CPU kernels: unavailable ({native.build_error()})", file=sys.stderr)
    else:
        print("native CPU kernels: built")
    return 0


def add_prepare_model_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare-model",
        help="load a model once so its dequantised weights (and the native CPU kernels) are cached",
    )
    p.add_argument("--model", default="smollm2", help="model name or path (default smollm2)")
    p.set_defaults(func=_run_prepare_model)


# ---------------------------------------------------------------------------- info
def _run_info(args: argparse.Namespace) -> int:
    import torch

    from radixkv.model.platform_info import platform_info

    dtype = getattr(torch, args.dtype) if args.dtype else None
    head_dim = args.head_dim
    model: dict[str, object] = {}
    if args.model:
        from radixkv.model.arch import UnsupportedModelError
        from radixkv.model.loader import ModelNotFoundError
        from radixkv.model.model_info import describe

        try:
            model = describe(args.model)
        except (UnsupportedModelError, ModelNotFoundError) as exc:
            print(f"radixkv info: {exc}", file=sys.stderr)
            return 2
        head_dim = int(model["head dim"])  # type: ignore[call-overload]
    info = model | platform_info(dtype=dtype, head_dim=head_dim, device=args.device)
    if args.json:
        print(json.dumps(info))
        return 0
    width = max(len(k) for k in info)
    for key, value in info.items():
        if isinstance(value, list):
            value = " ".join(str(v) for v in value) or "-"
        print(f"{key:<{width}}  {value}")
    return 0


def add_info_parser(sub: argparse._SubParsersAction) -> None:
    """``radixkv info``: host CPU, ISA, torch, dtype, attention backend and native kernel path."""
    p = sub.add_parser(
        "info",
        help="print the host CPU/ISA, torch threads, default dtype and the kernels radixkv picks",
        description="Print the host CPU model and ISA flags, torch version and threads, the "
        "default dtype on this host, and the attention backend and native kernel path an engine "
        "would use (building the native kernels if they are not built yet). With MODEL, first "
        "what radixkv reads of it (architecture, head dim, windows, features), or why it "
        "refuses it.",
    )
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a model as `serve --model` takes it: describe it and report for its head dim",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="report the backend for this dtype (default: the host's default dtype)",
    )
    p.add_argument("--head-dim", type=int, default=64, help="attention head dim (default 64)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run_info)


# ---------------------------------------------------------------------------- router, cluster
def add_router_parser(sub: argparse._SubParsersAction) -> None:
    from radixkv.server.router_cli import add_router_parser as add

    add(sub)


def add_cluster_parser(sub: argparse._SubParsersAction) -> None:
    from radixkv.server.cluster import add_cluster_parser as add

    add(sub)


#: One function per subcommand; each adds its parser and sets ``func``.
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_simulate_parser,
    add_serve_parser,
    add_prepare_model_parser,
    add_router_parser,
    add_cluster_parser,
    add_info_parser,
]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="radixkv", description="Prefix-caching KV store and LLM serving engine."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (``radixkv`` console script). Returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
