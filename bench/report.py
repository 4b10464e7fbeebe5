"""Turn ``python -m bench.compare`` results JSON into the README's benchmark section (markdown).

    python -m bench.report bench_results.json                     # print the section
    python -m bench.report bench_results.json --output docs/bench.md

The section says what was run (the command and workload sizes), on what machine (``lscpu`` model
name, cores, torch version) and gives one table row per server x workload: throughput, mean and
p99 TTFT, the measured prompt-cache hit rate, the simulator's optimal and at-capacity hit rates
on the same trace, and ratios against the no-cache radixkv row and the transformers row.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main", "render", "results_table"]

NOCACHE = "radixkv-nocache"
HF = "transformers"


def _f(value: Any, fmt: str = ".2f") -> str:
    if value is None:
        return "-"
    return format(value, fmt)


def _ratio(num: float | None, den: float | None) -> str:
    if not num or not den:
        return "-"
    return f"{num / den:.2f}x"


def results_table(results: dict[str, Any]) -> str:
    """The markdown table (also printed by ``bench.compare``)."""
    rows = results["rows"]
    by_key = {(r["server"], r["workload"]): r for r in rows if r.get("status") == "ok"}
    head = (
        "| workload | server | req/s | output tok/s | mean TTFT ms | p99 TTFT ms | hit rate "
        "| sim optimal | sim @ capacity | req/s vs no-cache | TTFT speedup vs no-cache "
        "| req/s vs transformers | TTFT speedup vs transformers |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        w = r["workload"]
        if r.get("status") != "ok":
            err = str(r.get("error", "")).splitlines()
            short = (err[0] if err else "")[:120].replace("|", "/")
            lines.append(f"| {w} | {r['server']} | {r.get('status')}: {short} |" + " |" * 10)
            continue
        nc = by_key.get((NOCACHE, w))
        hf = by_key.get((HF, w))
        lines.append(
            "| "
            + " | ".join(
                [
                    w,
                    r["server"],
                    _f(r["request_throughput"], ".3f"),
                    _f(r["output_throughput"], ".1f"),
                    _f(r["mean_ttft_ms"], ".0f"),
                    _f(r["p99_ttft_ms"], ".0f"),
                    _f(r["cache_hit_rate"], ".3f"),
                    _f(r.get("sim_optimal_hit_rate"), ".3f"),
                    _f(r.get("sim_hit_rate_at_capacity"), ".3f"),
                    _ratio(r["request_throughput"], nc and nc["request_throughput"]),
                    _ratio(nc and nc["mean_ttft_ms"], r["mean_ttft_ms"]),
                    _ratio(r["request_throughput"], hf and hf["request_throughput"]),
                    _ratio(hf and hf["mean_ttft_ms"], r["mean_ttft_ms"]),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def _workload_line(name: str, cfg: dict[str, Any]) -> str:
    g = cfg.get
    if name == "generated-shared-prefix":
        return (
            f"- generated-shared-prefix: {g('gsp_num_groups')} groups x "
            f"{g('gsp_prompts_per_group')} prompts, {g('gsp_system_prompt_len')}-token system "
            f"prompt + {g('gsp_question_len')}-token question, {g('gsp_output_len')} output tokens"
        )
    if name == "multi-turn":
        return (
            f"- multi-turn: {g('mt_clients')} clients x {g('mt_rounds')} rounds, "
            f"{g('mt_turn_len')}-word user turns, {g('mt_output_len')} output tokens; each round "
            "is sent after the previous answer arrived and contains it"
        )
    if name == "few-shot":
        return (
            f"- few-shot: {g('fs_shots')} shared example pairs ({g('fs_example_len')} + "
            f"{g('fs_example_len')} tokens each) + a {g('fs_question_len')}-token question, "
            f"{g('fs_requests')} requests, {g('fs_output_len')} output tokens"
        )
    return f"- {name}: {json.dumps(cfg)}"


def render(results: dict[str, Any]) -> str:
    """The full markdown section: commands, setup, machine, table, notes."""
    m = results.get("machine", {})
    quick = " --quick" if results.get("quick") else ""
    out = [
        "## Benchmarks",
        "",
        "Online serving benchmark: `bench/serve.py` replays a workload against any "
        "OpenAI-compatible server (streaming, `temperature 0`, `ignore_eos`, usage with "
        "`prompt_tokens_details.cached_tokens`) and reports vLLM/SGLang-style metrics "
        "(throughput, TTFT/TPOT/ITL/E2E percentiles) plus the prompt-cache hit rate. "
        "`bench/compare.py` runs the same workloads on several servers in one go.",
        "",
        "```bash",
        "# one server, one workload (the server must be running)",
        ".venv/bin/radixkv serve --port 8000 &",
        ".venv/bin/python -m bench.serve --base-url http://127.0.0.1:8000 \\",
        "    --workload generated-shared-prefix --gsp-num-groups 4 --gsp-prompts-per-group 8 \\",
        "    --gsp-system-prompt-len 512 --gsp-question-len 32 --gsp-output-len 16 \\",
        "    --request-rate inf --output gsp.json --plot-dir plots/",
        "# the comparison below (starts and stops every server itself)",
        f".venv/bin/python -m bench.compare{quick} --output bench_results.json",
        ".venv/bin/python -m bench.report bench_results.json --output docs/bench.md",
        "# add any other OpenAI-compatible server (e.g. vLLM on CPU, started by hand)",
        ".venv/bin/python -m bench.compare --extra-url vllm-cpu=http://127.0.0.1:8001",
        "```",
        "",
        "### Results",
        "",
        f"Command: `{results.get('command', 'python -m bench.compare')}`  ",
        f"Machine: {m.get('cpu_model', '?')}, {m.get('cpu_count', '?')} cores, "
        f"torch {m.get('torch', '?')}, Python {m.get('python', '?')}"
        + (f", commit {m['git_commit']}" if m.get("git_commit") else "")
        + "  ",
        f"Model: {results.get('model')}; page size {results.get('page_size')}; request rate "
        f"{results.get('request_rate')}; max concurrency {results.get('max_concurrency') or 'none'}"
        f"; total wall time {results.get('total_seconds', 0):.0f} s.",
        "",
        "Workloads:",
        "",
    ]
    for name, cfg in results.get("workloads", {}).items():
        out.append(_workload_line(name, cfg))
    out += ["", "Servers:", ""]
    for s in results.get("servers", []):
        cmd = " ".join(s["cmd"]) if s.get("cmd") else "(external)"
        cmd = cmd.replace(sys.executable, "python")
        out.append(f"- `{s['name']}`: {s.get('notes') or ''} (`{cmd}`)")
    out += [
        "",
        results_table(results),
        "",
        "*hit rate* = cached prompt tokens / prompt tokens as reported by the server "
        "(`usage.prompt_tokens_details.cached_tokens`). *sim optimal* = `radixkv.sim.simulator` on the "
        "trace that row sent, unbounded capacity; *sim @ capacity* = the simulator at the row's "
        "device KV capacity (a sequential replay: concurrent requests that arrive before their "
        "shared prefix is computed can miss on the server). Speedups are ratios of request "
        "throughput and of mean TTFT (higher is better).",
    ]
    tiers = [r for r in results["rows"] if r.get("sim_hit_rate_device_plus_host") is not None]
    for r in tiers:
        out.append(
            f"For `{r['server']}` / {r['workload']} the simulator at device + host capacity gives "
            f"{r['sim_hit_rate_device_plus_host']:.3f}."
        )
    if any(r.get("sim_tokenizer") == "hash-words" for r in results["rows"]):
        out.append(
            "Text workloads were simulated with word hashing (the model tokenizer was not found), "
            "so their simulator figures are approximate."
        )
    return "\n".join(out) + "\n"


README_START = "<!-- bench.report:start -->"
README_END = "<!-- bench.report:end -->"


def splice_into_readme(readme: Path, text: str) -> None:
    """Replace what stands between the README's two bench.report markers with ``text``."""
    body = readme.read_text(encoding="utf-8")
    start, end = body.find(README_START), body.find(README_END)
    if start < 0 or end < start:
        raise SystemExit(f"{readme} lacks the markers {README_START} ... {README_END}")
    head = body[: start + len(README_START)]
    lines = text.splitlines()
    if lines and lines[0].startswith("## "):  # the README supplies the section heading
        lines = lines[1:]
    nested = "\n".join("#" + ln if ln.startswith("### ") else ln for ln in lines)
    readme.write_text(head + "\n" + nested.strip("\n") + "\n" + body[end:], encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point."""
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n")[0])
    p.add_argument("results", help="JSON written by python -m bench.compare")
    p.add_argument("--output", default=None, help="write the markdown here (default: stdout)")
    p.add_argument(
        "--readme", default=None, help="also splice it into this README between its markers"
    )
    args = p.parse_args(argv)
    results = json.loads(Path(args.results).read_text(encoding="utf-8"))
    text = render(results)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"wrote {args.output}")
    elif not args.readme:
        print(text, end="")
    if args.readme:
        splice_into_readme(Path(args.readme), text)
        print(f"updated {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
