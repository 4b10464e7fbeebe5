"""Compare serving configurations on the same workloads, in one command.

    python -m bench.compare --output bench_results.json          # ~10 min on 2 CPU cores
    python -m bench.compare --quick --output bench_quick.json    # ~1-2 min
    python -m bench.compare --extra-url vllm-cpu=http://127.0.0.1:8001   # add any server

For each server configuration (started as a subprocess on a free loopback port, waited on via
``/health``, stopped afterwards):

* ``radixkv``          : ``radixkv serve`` with the prefix cache;
* ``radixkv-nocache``  : ``--disable-prefix-cache``;
* ``radixkv-tiers``    : a small device pool (``--kv-cache-tokens``) plus ``--host-cache-tokens``
  and ``--disk-cache-dir`` (if the server refuses those flags, the row says so);
* ``transformers``     : :mod:`bench.hf_server`, plain ``generate`` one request at a time;
* every ``--extra-url NAME=URL`` (already running, not started or stopped here),

each workload (generated-shared-prefix, multi-turn, few-shot) is replayed by
:func:`bench.serve.run_benchmark` (cache flushed before each workload where the server supports
``/flush_cache``). Next to each row: the simulator's optimal hit rate (unbounded capacity) and its
hit rate at the row's device capacity, on the token trace that row actually sent. The table and
the JSON feed :mod:`bench.report`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.serve import BenchConfig, run_benchmark
from radixkv.server.ports import free_port

__all__ = ["ServerSpec", "main", "machine_info", "run_compare", "workload_configs"]

ROOT = Path(__file__).resolve().parent.parent
SUMMARY_KEYS = (
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "mean_itl_ms",
    "mean_e2e_latency_ms",
    "cache_hit_rate",
    "total_input_tokens",
    "total_cached_tokens",
    "total_output_tokens",
)


def workload_configs(quick: bool) -> dict[str, dict[str, Any]]:
    """BenchConfig overrides per workload (full: ~10 min for all servers; quick: ~1-2 min)."""
    if quick:
        return {
            "generated-shared-prefix": dict(
                gsp_num_groups=2,
                gsp_prompts_per_group=4,
                gsp_system_prompt_len=256,
                gsp_question_len=16,
                gsp_output_len=8,
            ),
            "multi-turn": dict(mt_clients=2, mt_rounds=3, mt_turn_len=32, mt_output_len=8),
            "few-shot": dict(
                fs_shots=3, fs_requests=6, fs_example_len=16, fs_question_len=16, fs_output_len=8
            ),
        }
    return {
        "generated-shared-prefix": dict(
            gsp_num_groups=4,
            gsp_prompts_per_group=8,
            gsp_system_prompt_len=512,
            gsp_question_len=32,
            gsp_output_len=16,
        ),
        "multi-turn": dict(mt_clients=4, mt_rounds=4, mt_turn_len=64, mt_output_len=16),
        "few-shot": dict(
            fs_shots=5, fs_requests=16, fs_example_len=32, fs_question_len=32, fs_output_len=16
        ),
    }


# ----------------------------------------------------------------------------- servers
@dataclass
class ServerSpec:
    """One row group: a server to start (``cmd``) or an existing one (``url``)."""

    name: str
    cmd: list[str] | None = None
    url: str | None = None
    capacity_tokens: int | None = None  # device KV capacity (simulator column), None = no cache
    host_tokens: int = 0
    notes: str = ""
    env: dict[str, str] = field(default_factory=dict)


def _tail(path: Path, n: int = 15) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    lines = [ln for ln in lines if "Loading weights" not in ln]
    return "\n".join(lines[-n:])


class ManagedServer:
    """Start ``cmd`` on a port, wait for ``/health``, stop it on exit."""

    def __init__(self, spec: ServerSpec, log_dir: Path, startup_timeout: float) -> None:
        self.spec = spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"{spec.name}.log"
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start and wait until healthy; raises ``RuntimeError`` with the log tail otherwise."""
        assert self.spec.cmd is not None
        cmd = [*self.spec.cmd, "--host", "127.0.0.1", "--port", str(self.port)]
        env = {**os.environ, **self.spec.env}
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                tail = _tail(self.log)
                last = tail.splitlines()[-1] if tail else ""
                raise RuntimeError(
                    f"server exited with code {code} before /health answered: {last}\n"
                    f"command: {' '.join(cmd)}\nlog ({self.log}):\n{tail}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2, trust_env=False).status_code == 200:
                    return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(
            f"server not healthy after {self.startup_timeout:.0f}s: {' '.join(cmd)}\n"
            f"{_tail(self.log)}"
        )

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 20 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def _server_specs(args: argparse.Namespace, disk_dir: str) -> list[ServerSpec]:
    base = [*args.radixkv_cmd.split(), "--model", args.model, "--page-size", str(args.page_size)]
    kv, tier_kv = args.kv_cache_tokens, args.tier_kv_cache_tokens
    specs = {
        "radixkv": ServerSpec(
            "radixkv",
            [*base, "--kv-cache-tokens", str(kv)],
            capacity_tokens=kv,
            notes=f"prefix cache on, {kv}-token device pool",
        ),
        "radixkv-nocache": ServerSpec(
            "radixkv-nocache",
            [*base, "--kv-cache-tokens", str(kv), "--disable-prefix-cache"],
            notes="--disable-prefix-cache",
        ),
        "radixkv-small": ServerSpec(
            "radixkv-small",
            [*base, "--kv-cache-tokens", str(tier_kv)],
            capacity_tokens=tier_kv,
            notes="device pool only, same size as the tiers row",
        ),
        "radixkv-tiers": ServerSpec(
            "radixkv-tiers",
            [
                *base,
                "--kv-cache-tokens",
                str(tier_kv),
                "--host-cache-tokens",
                str(args.host_cache_tokens),
                "--disk-cache-dir",
                disk_dir,
            ],
            capacity_tokens=tier_kv,
            host_tokens=args.host_cache_tokens,
            notes=f"device {tier_kv} + host {args.host_cache_tokens} tokens + disk",
        ),
        "transformers": ServerSpec(
            "transformers",
            [sys.executable, "-m", "bench.hf_server", "--model", args.model]
            + ["--dtype", args.hf_dtype],
            notes=f"transformers generate, {args.hf_dtype}, one request at a time",
        ),
    }
    out = []
    for name in args.configs.split(","):
        name = name.strip()
        if not name:
            continue
        if name not in specs:
            raise SystemExit(f"bench.compare: unknown config {name!r}; choose from {list(specs)}")
        out.append(specs[name])
    for item in args.extra_url:
        name, sep, url = item.partition("=")
        if not sep or not url.startswith("http"):
            raise SystemExit(f"bench.compare: --extra-url wants NAME=URL, got {item!r}")
        out.append(ServerSpec(name, url=url, notes=f"external server at {url}"))
    return out


# ----------------------------------------------------------------------------- simulator
def _load_tokenizer(model: str) -> Any:
    """The model's HF tokenizer for exact simulator traces of text workloads, else ``None``."""
    try:
        from transformers import AutoTokenizer

        path = Path(model).expanduser()
        if path.is_dir():
            return AutoTokenizer.from_pretrained(path)
        from radixkv.model.loader import cache_dir

        for d in sorted(cache_dir().glob("SmolLM2-135M-Instruct*")):
            if model.lower().startswith("smollm2") and (d / "tokenizer_config.json").exists():
                return AutoTokenizer.from_pretrained(d)
    except Exception:
        return None
    return None


def _token_trace(trace: list[dict[str, Any]], tokenizer: Any) -> list[dict[str, Any]]:
    """Text requests tokenized with ``tokenizer`` (the simulator hashes words otherwise)."""
    if tokenizer is None:
        return trace
    out = []
    for r in trace:
        r = dict(r)
        if "text" in r:
            r["input_ids"] = tokenizer.encode(r.pop("text"), add_special_tokens=False)
        if "output_text" in r:
            r["output_ids"] = tokenizer.encode(r.pop("output_text"), add_special_tokens=False)
        out.append(r)
    return out


def _simulate(
    trace: list[dict[str, Any]], spec: ServerSpec, page_size: int, tokenizer: Any
) -> dict[str, Any]:
    from radixkv.sim.simulator import simulate

    if not trace:
        return {}
    toks = _token_trace(trace, tokenizer)
    res: dict[str, Any] = {
        "sim_tokenizer": "model" if tokenizer is not None else "hash-words",
        "sim_optimal_hit_rate": simulate(toks, None, page_size)["optimal_hit_rate"],
        "sim_hit_rate_at_capacity": None,
    }
    if spec.capacity_tokens is not None:
        res["capacity_tokens"] = spec.capacity_tokens
        res["sim_hit_rate_at_capacity"] = simulate(toks, spec.capacity_tokens, page_size)[
            "token_hit_rate"
        ]
        if spec.host_tokens:
            cap = spec.capacity_tokens + spec.host_tokens
            res["sim_hit_rate_device_plus_host"] = simulate(toks, cap, page_size)["token_hit_rate"]
    return res


# ----------------------------------------------------------------------------- run
def machine_info() -> dict[str, Any]:
    """CPU model, core count, torch / python versions, git commit."""
    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    with contextlib.suppress(Exception):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                info["cpu_model"] = value.strip()
    info["cpu_count"] = os.cpu_count()
    with contextlib.suppress(Exception):
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.is_available()
    with contextlib.suppress(Exception):
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=10,
        ).stdout.strip()
    return info


def _bench_one(
    url: str, workload: str, overrides: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    cfg = BenchConfig(
        base_url=url,
        workload=workload,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        disable_tqdm=args.disable_tqdm,
        **overrides,
    )
    return run_benchmark(cfg, return_trace=True)


def _server_stats(url: str) -> dict[str, Any] | None:
    with contextlib.suppress(Exception):
        r = httpx.get(f"{url}/cache/stats", timeout=10, trust_env=False)
        if r.status_code == 200:
            return dict(r.json())
    return None


def run_compare(args: argparse.Namespace) -> dict[str, Any]:
    """Run every server x workload; returns the results dict (see :mod:`bench.report`)."""
    workloads = workload_configs(args.quick)
    if args.workloads:
        names = [w.strip() for w in args.workloads.split(",")]
        workloads = {w: workloads[w] for w in names}
    tokenizer = _load_tokenizer(args.model)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="radixkv-compare-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    disk_dir = tempfile.mkdtemp(prefix="radixkv-disk-")
    results: dict[str, Any] = {
        "command": " ".join(["python -m bench.compare", *args.argv]),
        "machine": machine_info(),
        "model": args.model,
        "page_size": args.page_size,
        "quick": args.quick,
        "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
        "max_concurrency": args.max_concurrency,
        "workloads": workloads,
        "servers": [],
        "rows": [],
    }
    t_all = time.perf_counter()
    try:
        for spec in _server_specs(args, disk_dir):
            server = None
            results["servers"].append({"name": spec.name, "cmd": spec.cmd, "notes": spec.notes})
            error = None
            url = spec.url
            if spec.cmd is not None:
                server = ManagedServer(spec, log_dir, args.startup_timeout)
                print(f"[compare] starting {spec.name}: {' '.join(spec.cmd)}", flush=True)
                t0 = time.perf_counter()
                try:
                    server.start()
                    url = server.url
                    print(f"[compare] {spec.name} healthy after {time.perf_counter() - t0:.1f}s")
                except RuntimeError as e:
                    error = str(e)
                    print(f"[compare] {spec.name} unavailable: {error}", flush=True)
            try:
                for workload, overrides in workloads.items():
                    row: dict[str, Any] = {
                        "server": spec.name,
                        "workload": workload,
                        "notes": spec.notes,
                    }
                    if error is not None:
                        row.update(status="unavailable", error=error)
                        results["rows"].append(row)
                        continue
                    assert url is not None
                    print(f"[compare] {spec.name} / {workload}", flush=True)
                    try:
                        report = _bench_one(url, workload, overrides, args)
                    except Exception as e:  # one broken server must not end the comparison
                        row.update(status="failed", error=f"{type(e).__name__}: {e}")
                        results["rows"].append(row)
                        print(f"[compare] {spec.name} / {workload} failed: {e}", flush=True)
                        continue
                    trace = report.pop("trace")
                    row["status"] = "ok" if report["completed"] else "failed"
                    if not report["completed"]:
                        row["error"] = next((e for e in report["errors"] if e), "")
                    row.update({k: report[k] for k in SUMMARY_KEYS})
                    row.update(_simulate(trace, spec, args.page_size, tokenizer))
                    row["server_stats"] = _server_stats(url)
                    row["report"] = report
                    results["rows"].append(row)
                    print(
                        f"[compare]   {report['request_throughput']:.3f} req/s, "
                        f"TTFT {report['mean_ttft_ms']:.0f} ms, "
                        f"hit rate {report['cache_hit_rate']:.3f}",
                        flush=True,
                    )
            finally:
                if server is not None:
                    server.stop()
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
    results["total_seconds"] = time.perf_counter() - t_all
    results["log_dir"] = str(log_dir)
    return results


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m bench.compare`` argument parser."""
    from bench.serve import _rate

    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--quick", action="store_true", help="small workloads (~1-2 minutes)")
    a("--model", default="smollm2")
    a("--output", default="bench_results.json", help="results JSON (input of bench.report)")
    a("--markdown", default=None, help="also write the bench.report markdown here")
    a(
        "--configs",
        default="radixkv,radixkv-nocache,radixkv-tiers,transformers",
        help="comma list of radixkv, radixkv-nocache, radixkv-small, radixkv-tiers, transformers",
    )
    a("--workloads", default=None, help="comma list (default: all three)")
    a("--extra-url", action="append", default=[], metavar="NAME=URL", help="repeatable")
    a("--page-size", type=int, default=16)
    a("--kv-cache-tokens", type=int, default=16384, help="device pool of the radixkv rows")
    a("--tier-kv-cache-tokens", type=int, default=1024, help="device pool of the tiers row")
    a("--host-cache-tokens", type=int, default=16384)
    a("--hf-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    a("--radixkv-cmd", default=f"{sys.executable} -m radixkv.cli serve")
    a("--request-rate", type=_rate, default=float("inf"))
    a("--max-concurrency", type=int, default=None)
    a("--seed", type=int, default=0)
    a("--startup-timeout", type=float, default=300.0)
    a("--log-dir", default=None, help="server logs (default: a temp dir)")
    a("--disable-tqdm", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point."""
    from bench import report as report_mod

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    results = run_compare(args)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    import json

    out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print()
    print(report_mod.results_table(results))
    print(f"\nresults written to {out} ({results['total_seconds']:.0f}s in all)")
    if args.markdown:
        Path(args.markdown).write_text(report_mod.render(results), encoding="utf-8")
        print(f"markdown written to {args.markdown}")
    return 0 if any(r.get("status") == "ok" for r in results["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
