"""Online serving benchmark: replay a workload against any OpenAI-compatible server.

    python -m bench.serve --base-url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct \\
        --workload generated-shared-prefix --gsp-num-groups 4 --gsp-prompts-per-group 8 \\
        --gsp-system-prompt-len 512 --gsp-question-len 32 --gsp-output-len 16 \\
        --request-rate inf --output gsp.json --plot-dir plots/

Every request streams (SSE) with ``max_tokens = output_len``, ``temperature = 0`` and
``ignore_eos = true`` so output lengths are fixed, and ``stream_options.include_usage`` so the
final chunk carries ``usage`` (``prompt_tokens``, ``completion_tokens`` and
``prompt_tokens_details.cached_tokens``). Per request the client measures TTFT (first content
chunk), inter-token latencies (between content chunks) and end-to-end latency; the report uses the
field names of vLLM's / SGLang's serving benchmarks plus ``cache_hit_rate`` (sum of cached prompt
tokens / sum of prompt tokens, as the server reports them).

Workloads:

* ``generated-shared-prefix`` (``--gsp-*``), ``few-shot`` (``--fs-*``): built by
  :mod:`radixkv.sim.workloads`; token-id prompts on the completions endpoint, text on chat;
* ``multi-turn`` (``--mt-*``): ``--mt-clients`` conversations of ``--mt-rounds`` rounds; a
  client's next round is sent only once its previous answer arrived and contains that real answer
  (text prompts: history of user turns and answers joined by spaces, or chat messages);
* ``sharegpt`` (``--dataset-path`` ShareGPT JSON), ``trace`` (``--trace-path`` JSONL from
  ``python -m bench.workloads``).

Arrivals: ``--request-rate inf`` sends everything at once; otherwise a seeded Poisson process
(exponential gaps). For multi-turn the rate applies to the start of each conversation.

The pieces: :mod:`bench.serve_config` (:class:`BenchConfig`), :mod:`bench.serve_workloads`
(sessions and arrivals), :mod:`bench.serve_client` (the SSE client), :mod:`bench.serve_metrics`
(metrics, the text report, the sent trace), :mod:`bench.serve_plots`; this module runs them
(:func:`run_benchmark`) and holds the CLI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.serve_client import RequestResult, benchmark_async
from bench.serve_config import WORKLOADS, BenchConfig
from bench.serve_metrics import ARRAY_KEYS, METRIC_KEYS, compute_metrics, print_report, sent_trace
from bench.serve_plots import write_plots
from bench.serve_workloads import Session, build_sessions

__all__ = [
    "ARRAY_KEYS",
    "METRIC_KEYS",
    "WORKLOADS",
    "BenchConfig",
    "RequestResult",
    "Session",
    "build_sessions",
    "compute_metrics",
    "main",
    "print_report",
    "run_benchmark",
    "sent_trace",
    "write_plots",
]


def run_benchmark(
    config: BenchConfig | None = None,
    *,
    sessions: list[Session] | None = None,
    output: str | Path | None = None,
    plot_dir: str | Path | None = None,
    return_trace: bool = False,
    **overrides: Any,
) -> dict[str, Any]:
    """Run one benchmark and return the report dict (:data:`METRIC_KEYS`, :data:`ARRAY_KEYS`,
    ``config``, ``model``, ``base_url``; with ``return_trace`` also ``trace``: the requests as
    sent, see :func:`sent_trace`). ``overrides`` set :class:`BenchConfig` fields.
    Writes ``output`` (JSON) and PNG plots into ``plot_dir`` when given.
    """
    if config is None:
        cfg = BenchConfig(**overrides)
    else:
        cfg = config
        for k, v in overrides.items():
            setattr(cfg, k, v)
    cfg.validate()
    results, duration, model = asyncio.run(benchmark_async(cfg, sessions))
    report = compute_metrics(results, duration)
    report["model"] = model
    report["base_url"] = cfg.base_url
    report["config"] = cfg.to_json()
    if plot_dir is not None:
        report["plots"] = write_plots(report, plot_dir)
    if output is not None:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    if return_trace:
        report["trace"] = sent_trace(results)
    return report


def _rate(text: str) -> float:
    if text.lower() in ("inf", "infinity"):
        return math.inf
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"--request-rate must be > 0 or inf, got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m bench.serve`` argument parser."""
    d = BenchConfig()
    p = argparse.ArgumentParser(
        prog="python -m bench.serve",
        description="Replay a workload against an OpenAI-compatible server and report "
        "throughput, TTFT/TPOT/ITL/E2E latency and prefix-cache hit rate.",
    )
    a = p.add_argument
    a("--base-url", default=d.base_url, help="server root (default %(default)s)")
    a("--model", default=None, help="model name to send (default: first of /v1/models)")
    a("--endpoint", choices=["completions", "chat"], default=d.endpoint)
    a("--workload", choices=WORKLOADS, default=d.workload)
    a("--request-rate", type=_rate, default=d.request_rate, help="req/s (Poisson) or inf")
    a("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    a("--seed", type=int, default=d.seed)
    a(
        "--prompt-format",
        choices=["auto", "ids", "text"],
        default=d.prompt_format,
        help="auto: token ids on completions, text on chat (multi-turn is always text)",
    )
    a("--vocab-min", type=int, default=d.vocab_min, help="token id range of generated prompts")
    a("--vocab-max", type=int, default=d.vocab_max)
    g = p.add_argument_group("generated-shared-prefix")
    g.add_argument("--gsp-num-groups", type=int, default=d.gsp_num_groups)
    g.add_argument("--gsp-prompts-per-group", type=int, default=d.gsp_prompts_per_group)
    g.add_argument("--gsp-system-prompt-len", type=int, default=d.gsp_system_prompt_len)
    g.add_argument("--gsp-question-len", type=int, default=d.gsp_question_len)
    g.add_argument("--gsp-output-len", type=int, default=d.gsp_output_len)
    g = p.add_argument_group("multi-turn (lengths in words: prompts are text)")
    g.add_argument("--mt-clients", type=int, default=d.mt_clients)
    g.add_argument("--mt-rounds", type=int, default=d.mt_rounds)
    g.add_argument("--mt-turn-len", type=int, default=d.mt_turn_len)
    g.add_argument("--mt-output-len", type=int, default=d.mt_output_len)
    g.add_argument("--mt-system-prompt-len", type=int, default=d.mt_system_prompt_len)
    g = p.add_argument_group("few-shot")
    g.add_argument("--fs-shots", type=int, default=d.fs_shots)
    g.add_argument("--fs-requests", type=int, default=d.fs_requests)
    g.add_argument("--fs-example-len", type=int, default=d.fs_example_len)
    g.add_argument("--fs-question-len", type=int, default=d.fs_question_len)
    g.add_argument("--fs-output-len", type=int, default=d.fs_output_len)
    g = p.add_argument_group("sharegpt / trace")
    g.add_argument("--dataset-path", default=None, help="ShareGPT JSON file")
    g.add_argument("--num-prompts", type=int, default=d.num_prompts)
    g.add_argument("--sharegpt-output-len", type=int, default=None)
    g.add_argument("--trace-path", default=None, help="JSONL trace (python -m bench.workloads)")
    g.add_argument("--use-trace-arrivals", action="store_true", help="send at trace 'arrival'")
    g = p.add_argument_group("client")
    g.add_argument("--warmup-requests", type=int, default=d.warmup_requests)
    g.add_argument(
        "--no-flush-after-warmup",
        action="store_true",
        help="do not POST /flush_cache after the warm-up",
    )
    g.add_argument("--timeout", type=float, default=d.timeout_s, help="per request (s)")
    g.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    g.add_argument("--disable-tqdm", action="store_true")
    g.add_argument("--output", default=None, help="write the JSON report here")
    g.add_argument("--plot-dir", default=None, help="write PNG plots here")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Map parsed CLI arguments to a :class:`BenchConfig`."""
    names = {f for f in BenchConfig.__dataclass_fields__}
    kw = {k: v for k, v in vars(args).items() if k in names}
    kw["timeout_s"] = args.timeout
    kw["flush_cache_after_warmup"] = not args.no_flush_after_warmup
    kw["extra_body"] = json.loads(args.extra_body) if args.extra_body else {}
    return BenchConfig(**kw)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit code (1 when every request failed)."""
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        cfg.validate()
    except (ValueError, json.JSONDecodeError) as e:
        print(f"bench.serve: {e}", file=sys.stderr)
        return 2
    report = run_benchmark(cfg, output=args.output, plot_dir=args.plot_dir)
    print_report(report)
    if args.output:
        print(f"report written to {args.output}")
    for path in report.get("plots", []):
        print(f"plot written to {path}")
    return 0 if report["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
