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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

__all__ = [
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

WORKLOADS = ("generated-shared-prefix", "multi-turn", "few-shot", "sharegpt", "trace")

#: Every summary field of the JSON report (vLLM / SGLang names + cache fields).
METRIC_KEYS = (
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "input_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p90_ttft_ms",
    "p99_ttft_ms",
    "std_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p90_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p90_itl_ms",
    "p99_itl_ms",
    "mean_e2e_latency_ms",
    "median_e2e_latency_ms",
    "p99_e2e_latency_ms",
    "cache_hit_rate",
    "total_cached_tokens",
)

#: Per-request arrays of the JSON report (index i = i-th request in send order).
ARRAY_KEYS = (
    "ttfts",
    "itls",
    "e2e_latencies",
    "start_times",
    "prompt_tokens",
    "cached_tokens",
    "output_lens",
    "errors",
)


# ----------------------------------------------------------------------------- config
@dataclass
class BenchConfig:
    """Everything one benchmark run depends on (stored in the report as ``config``)."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    endpoint: str = "completions"
    workload: str = "generated-shared-prefix"
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    prompt_format: str = "auto"
    vocab_min: int = 1000
    vocab_max: int = 40000
    # generated-shared-prefix (SGLang's flag names)
    gsp_num_groups: int = 4
    gsp_prompts_per_group: int = 8
    gsp_system_prompt_len: int = 512
    gsp_question_len: int = 32
    gsp_output_len: int = 16
    # multi-turn
    mt_clients: int = 4
    mt_rounds: int = 4
    mt_turn_len: int = 64
    mt_output_len: int = 16
    mt_system_prompt_len: int = 0
    # few-shot
    fs_shots: int = 5
    fs_requests: int = 16
    fs_example_len: int = 32
    fs_question_len: int = 32
    fs_output_len: int = 16
    # sharegpt / trace
    dataset_path: str | None = None
    trace_path: str | None = None
    num_prompts: int = 100
    sharegpt_output_len: int | None = None
    sharegpt_max_output_len: int = 256
    use_trace_arrivals: bool = False
    # client
    warmup_requests: int = 1
    flush_cache_after_warmup: bool = True
    timeout_s: float = 600.0
    disable_tqdm: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload={self.workload!r}: choose one of {', '.join(WORKLOADS)}")
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint={self.endpoint!r}: choose completions or chat")
        if self.prompt_format not in ("auto", "ids", "text"):
            raise ValueError(f"prompt_format={self.prompt_format!r}: choose auto, ids or text")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate={self.request_rate}: must be > 0 (or inf)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency={self.max_concurrency}: must be >= 1")
        if self.workload == "sharegpt" and not self.dataset_path:
            raise ValueError("workload sharegpt needs dataset_path (--dataset-path FILE.json)")
        if self.workload == "trace" and not self.trace_path:
            raise ValueError("workload trace needs trace_path (--trace-path FILE.jsonl)")
        if self.endpoint == "chat" and self.prompt_format == "ids":
            raise ValueError("the chat endpoint takes text: use prompt_format auto or text")

    @property
    def text_prompts(self) -> bool:
        """Whether generated workloads use text prompts (chat always does)."""
        if self.prompt_format == "auto":
            return self.endpoint == "chat"
        return self.prompt_format == "text"

    def to_json(self) -> dict[str, Any]:
        """The config as JSON-safe values (``inf`` becomes the string ``"inf"``)."""
        d = asdict(self)
        if math.isinf(self.request_rate):
            d["request_rate"] = "inf"
        return d


# ----------------------------------------------------------------------------- workloads
@dataclass
class Turn:
    """One request of a session: a full prompt, or (multi-turn) the new user turn only."""

    prompt: str | list[int]
    output_len: int
    salt: str | None = None


@dataclass
class Session:
    """Requests sent one after another; ``multi_turn`` sessions carry their history along."""

    turns: list[Turn]
    start: float = 0.0
    multi_turn: bool = False
    system: str = ""


def _vocab(cfg: BenchConfig) -> tuple[int, int]:
    return (cfg.vocab_min, cfg.vocab_max)


def _arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Seeded Poisson arrival offsets (seconds); all 0 for ``rate = inf``."""
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed + 7919)
    gaps = rng.exponential(1.0 / rate, size=n)
    return np.cumsum(gaps).tolist()


def _from_request_dicts(reqs: list[dict[str, Any]]) -> list[Session]:
    sessions = []
    for r in reqs:
        prompt: str | list[int]
        if "input_ids" in r:
            prompt = [int(t) for t in r["input_ids"]]
        elif "text" in r:
            prompt = str(r["text"])
        else:
            raise ValueError(f"request {r.get('id')!r} has neither 'input_ids' nor 'text'")
        turn = Turn(prompt, int(r.get("output_len", 16)), r.get("salt"))
        sessions.append(Session([turn], start=float(r.get("arrival", 0.0) or 0.0)))
    return sessions


def _multi_turn_sessions(cfg: BenchConfig) -> list[Session]:
    from radixkv.sim.workloads import WORDS

    rng = np.random.default_rng(cfg.seed)

    def words(n: int) -> str:
        return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=n).tolist())

    system = words(cfg.mt_system_prompt_len) if cfg.mt_system_prompt_len else ""
    return [
        Session(
            [Turn(words(cfg.mt_turn_len), cfg.mt_output_len) for _ in range(cfg.mt_rounds)],
            multi_turn=True,
            system=system,
        )
        for _ in range(cfg.mt_clients)
    ]


def _sharegpt_sessions(cfg: BenchConfig) -> list[Session]:
    assert cfg.dataset_path is not None
    data = json.loads(Path(cfg.dataset_path).read_text(encoding="utf-8"))
    pairs: list[tuple[str, int]] = []
    for entry in data:
        conv = entry.get("conversations") or entry.get("conversation") or []
        if len(conv) < 2:
            continue
        human, gpt = conv[0], conv[1]
        if human.get("from") != "human" or not human.get("value"):
            continue
        if cfg.sharegpt_output_len is not None:
            out = cfg.sharegpt_output_len
        else:  # no tokenizer here: about 1.3 tokens per English word
            out = max(1, round(len(str(gpt.get("value", "")).split()) * 1.3))
            out = min(out, cfg.sharegpt_max_output_len)
        pairs.append((str(human["value"]), out))
    if not pairs:
        raise ValueError(f"{cfg.dataset_path}: no usable human/gpt conversation pairs")
    rng = np.random.default_rng(cfg.seed)
    idx = rng.permutation(len(pairs))[: cfg.num_prompts].tolist()
    return [Session([Turn(pairs[i][0], pairs[i][1])]) for i in idx]


def build_sessions(cfg: BenchConfig) -> list[Session]:
    """Turn the config's workload into sessions with start offsets (seconds)."""
    from radixkv.sim import workloads as wl

    cfg.validate()
    common: dict[str, Any] = dict(seed=cfg.seed, text=cfg.text_prompts, vocab_range=_vocab(cfg))
    if cfg.workload == "generated-shared-prefix":
        sessions = _from_request_dicts(
            wl.generated_shared_prefix(
                cfg.gsp_num_groups,
                cfg.gsp_prompts_per_group,
                cfg.gsp_system_prompt_len,
                cfg.gsp_question_len,
                cfg.gsp_output_len,
                **common,
            )
        )
    elif cfg.workload == "few-shot":
        sessions = _from_request_dicts(
            wl.few_shot(
                cfg.fs_requests,
                cfg.fs_shots,
                cfg.fs_example_len,
                cfg.fs_question_len,
                cfg.fs_output_len,
                **common,
            )
        )
    elif cfg.workload == "multi-turn":
        sessions = _multi_turn_sessions(cfg)
    elif cfg.workload == "sharegpt":
        sessions = _sharegpt_sessions(cfg)
    else:
        assert cfg.trace_path is not None
        sessions = _from_request_dicts(wl.read_jsonl(cfg.trace_path))
        if cfg.endpoint == "chat" and any(isinstance(s.turns[0].prompt, list) for s in sessions):
            raise ValueError("this trace has token-id prompts: use --endpoint completions")
    if not (cfg.workload == "trace" and cfg.use_trace_arrivals):
        for s, t in zip(sessions, _arrivals(len(sessions), cfg.request_rate, cfg.seed)):
            s.start = t
    return sessions


# ----------------------------------------------------------------------------- client
@dataclass
class RequestResult:
    """What one streamed request measured (times in seconds)."""

    success: bool = False
    error: str = ""
    start_time: float = 0.0
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    latency: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    generated_text: str = ""
    prompt: Any = None
    output_len: int = 0
    salt: str | None = None


def _api_root(base_url: str) -> str:
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _payload(
    cfg: BenchConfig, model: str, prompt: Any, output_len: int, salt: str | None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.endpoint == "chat":
        body["messages"] = prompt
    else:
        body["prompt"] = prompt
    if salt is not None:
        body["cache_salt"] = salt
    body.update(cfg.extra_body)
    return body


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    chat: bool,
    t0: float,
) -> RequestResult:
    """POST one streaming request and time its content chunks."""
    res = RequestResult()
    start = time.perf_counter()
    res.start_time = start - t0
    last = start
    chunks = 0
    text_parts: list[str] = []
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                res.error = f"HTTP {resp.status_code}: {body[:500]}"
                return res
            async for raw in resp.aiter_lines():
                line = raw.strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    res.error = f"stream error: {json.dumps(obj['error'])[:500]}"
                    return res
                usage = obj.get("usage")
                if usage:
                    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    res.output_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = int(details.get("cached_tokens") or 0)
                for choice in obj.get("choices") or []:
                    if chat:
                        text = (choice.get("delta") or {}).get("content")
                    else:
                        text = choice.get("text")
                    if not text:
                        continue
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itls.append(now - last)
                    last = now
                    chunks += 1
                    text_parts.append(text)
        res.latency = time.perf_counter() - start
        res.generated_text = "".join(text_parts)
        if not res.output_tokens:
            res.output_tokens = chunks
        if chunks == 0 and res.output_tokens > 0:
            res.ttft = res.latency  # all tokens came as empty-text chunks: first byte = end
        res.success = True
    except Exception as e:  # network errors, bad JSON: the request counts as failed
        res.error = f"{type(e).__name__}: {e}"
    return res


def _render_prompt(
    cfg: BenchConfig, session: Session, history: list[tuple[str, str]], turn: Turn
) -> Any:
    """The prompt for ``turn`` (multi-turn: system + every earlier turn and real answer)."""
    if not session.multi_turn:
        if cfg.endpoint == "chat":
            return [{"role": "user", "content": turn.prompt}]
        return turn.prompt
    if cfg.endpoint == "chat":
        msgs: list[dict[str, str]] = []
        if session.system:
            msgs.append({"role": "system", "content": session.system})
        for user, answer in history:
            msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        msgs.append({"role": "user", "content": str(turn.prompt)})
        return msgs
    parts = [session.system] if session.system else []
    for user, answer in history:
        parts += [user, answer.strip()]
    parts.append(str(turn.prompt))
    return " ".join(p for p in parts if p)


async def _warmup(client: httpx.AsyncClient, cfg: BenchConfig, model: str, url: str) -> None:
    root = _api_root(cfg.base_url)
    for i in range(cfg.warmup_requests):
        if cfg.endpoint == "chat":
            prompt: Any = [{"role": "user", "content": f"warm up number {i}"}]
        elif cfg.text_prompts:
            prompt = f"warm up number {i}"
        else:
            prompt = [cfg.vocab_min + (7 * i + j) % 97 for j in range(8)]
        res = await send_request(
            client, url, _payload(cfg, model, prompt, 4, None), cfg.endpoint == "chat", 0.0
        )
        if not res.success:
            raise RuntimeError(f"warm-up request to {url} failed: {res.error}")
    if cfg.warmup_requests and cfg.flush_cache_after_warmup:
        # best effort: radixkv / SGLang name; other servers simply do not have it
        with contextlib.suppress(httpx.HTTPError):
            await client.post(f"{root}/flush_cache", timeout=30)


async def _resolve_model(client: httpx.AsyncClient, cfg: BenchConfig) -> str:
    if cfg.model:
        return cfg.model
    resp = await client.get(f"{_api_root(cfg.base_url)}/v1/models", timeout=30)
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


async def benchmark_async(
    cfg: BenchConfig, sessions: list[Session] | None = None
) -> tuple[list[RequestResult], float, str]:
    """Run the benchmark; returns (results in send order, duration seconds, model name)."""
    sessions = build_sessions(cfg) if sessions is None else sessions
    chat = cfg.endpoint == "chat"
    url = _api_root(cfg.base_url) + ("/v1/chat/completions" if chat else "/v1/completions")
    total = sum(len(s.turns) for s in sessions)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)
    results: list[RequestResult] = []
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        model = await _resolve_model(client, cfg)
        await _warmup(client, cfg, model, url)
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        pbar = None
        if not cfg.disable_tqdm:
            from tqdm.auto import tqdm

            pbar = tqdm(total=total, desc=f"{cfg.workload}", unit="req")
        t0 = time.perf_counter()

        async def one(prompt: Any, turn: Turn) -> RequestResult:
            payload = _payload(cfg, model, prompt, turn.output_len, turn.salt)
            if sem is None:
                res = await send_request(client, url, payload, chat, t0)
            else:
                async with sem:
                    res = await send_request(client, url, payload, chat, t0)
            res.prompt, res.output_len, res.salt = prompt, turn.output_len, turn.salt
            results.append(res)
            if pbar is not None:
                pbar.update(1)
            return res

        async def run_session(session: Session) -> None:
            delay = session.start - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            history: list[tuple[str, str]] = []
            for k, turn in enumerate(session.turns):
                prompt = _render_prompt(cfg, session, history, turn)
                res = await one(prompt, turn)
                if not res.success:
                    for rest in session.turns[k + 1 :]:  # later rounds cannot be built
                        skipped = RequestResult(error="an earlier round of this session failed")
                        skipped.start_time = time.perf_counter() - t0
                        skipped.output_len = rest.output_len
                        results.append(skipped)
                        if pbar is not None:
                            pbar.update(1)
                    return
                history.append((str(turn.prompt), res.generated_text))

        await asyncio.gather(*(run_session(s) for s in sessions))
        duration = time.perf_counter() - t0
        if pbar is not None:
            pbar.close()
    results.sort(key=lambda r: r.start_time)
    return results, duration, model


# ----------------------------------------------------------------------------- metrics
def _stats(values: Sequence[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0, "std": 0.0}
    a = np.asarray(values, dtype=np.float64) * scale
    return {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "std": float(a.std()),
    }


def compute_metrics(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """Summary metrics (:data:`METRIC_KEYS`) and per-request arrays (:data:`ARRAY_KEYS`)."""
    ok = [r for r in results if r.success]
    tin = sum(r.prompt_tokens for r in ok)
    tout = sum(r.output_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ttft = _stats([r.ttft for r in ok])
    tpot = _stats([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1])
    itl = _stats([x for r in ok for x in r.itls])
    e2e = _stats([r.latency for r in ok])
    d = duration if duration > 0 else float("nan")
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": tin,
        "total_output_tokens": tout,
        "request_throughput": len(ok) / d,
        "input_throughput": tin / d,
        "output_throughput": tout / d,
        "total_token_throughput": (tin + tout) / d,
    }
    for name, s in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        for k in ("mean", "median", "p90", "p99"):
            out[f"{k}_{name}_ms"] = s[k]
    out["std_ttft_ms"] = ttft["std"]
    out["mean_e2e_latency_ms"] = e2e["mean"]
    out["median_e2e_latency_ms"] = e2e["median"]
    out["p90_e2e_latency_ms"] = e2e["p90"]
    out["p99_e2e_latency_ms"] = e2e["p99"]
    out["cache_hit_rate"] = cached / tin if tin else 0.0
    out["total_cached_tokens"] = cached
    out["ttfts"] = [r.ttft for r in results]
    out["itls"] = [r.itls for r in results]
    out["e2e_latencies"] = [r.latency for r in results]
    out["start_times"] = [r.start_time for r in results]
    out["prompt_tokens"] = [r.prompt_tokens for r in results]
    out["cached_tokens"] = [r.cached_tokens for r in results]
    out["output_lens"] = [r.output_tokens for r in results]
    out["errors"] = [r.error for r in results]
    return out


def sent_trace(results: list[RequestResult]) -> list[dict[str, Any]]:
    """The requests as actually sent, in send order, as a :mod:`radixkv.sim.workloads` trace.

    Chat prompts become their message contents joined by spaces (approximate: the server's chat
    template is not known here). ``output_text`` is the real answer for multi-turn replays.
    """
    trace: list[dict[str, Any]] = []
    for i, r in enumerate(results):
        p = r.prompt
        if p is None:
            continue
        req: dict[str, Any] = {"id": i, "output_len": r.output_len}
        if isinstance(p, list) and p and isinstance(p[0], dict):
            req["text"] = " ".join(str(m.get("content", "")) for m in p)
        elif isinstance(p, list):
            req["input_ids"] = p
        else:
            req["text"] = p
        if r.generated_text:
            req["output_text"] = r.generated_text
        if r.salt is not None:
            req["salt"] = r.salt
        trace.append(req)
    return trace


def print_report(report: dict[str, Any], file: Any = None) -> None:
    """Print the summary table (vLLM's layout)."""
    out = file or sys.stdout
    cfg = report.get("config", {})
    w = 50

    def line(label: str, value: Any) -> None:
        if isinstance(value, float):
            print(f"{label:<40}{value:>10.2f}", file=out)
        else:
            print(f"{label:<40}{value!s:>10}", file=out)

    print(" Serving Benchmark Result ".center(w, "="), file=out)
    line("Workload:", cfg.get("workload", "?"))
    line("Successful requests:", report["completed"])
    line("Failed requests:", report["failed"])
    line("Benchmark duration (s):", report["duration"])
    line("Total input tokens:", report["total_input_tokens"])
    line("Total cached tokens:", report["total_cached_tokens"])
    line("Cache hit rate (%):", 100.0 * report["cache_hit_rate"])
    line("Total generated tokens:", report["total_output_tokens"])
    line("Request throughput (req/s):", report["request_throughput"])
    line("Input token throughput (tok/s):", report["input_throughput"])
    line("Output token throughput (tok/s):", report["output_throughput"])
    line("Total token throughput (tok/s):", report["total_token_throughput"])
    for title, key in (
        ("Time to First Token", "ttft"),
        ("Time per Output Token (excl. 1st token)", "tpot"),
        ("Inter-token Latency", "itl"),
    ):
        print(f" {title} ".center(w, "-"), file=out)
        for stat in ("mean", "median", "p90", "p99"):
            line(f"{stat.capitalize()} {key.upper()} (ms):", report[f"{stat}_{key}_ms"])
    print(" End-to-end Latency ".center(w, "-"), file=out)
    for stat in ("mean", "median", "p99"):
        line(f"{stat.capitalize()} E2E Latency (ms):", report[f"{stat}_e2e_latency_ms"])
    print("=" * w, file=out)
    errors = [e for e in report.get("errors", []) if e]
    if errors:
        print(f"first error: {errors[0]}", file=out)


# ----------------------------------------------------------------------------- plots
def write_plots(report: dict[str, Any], plot_dir: str | Path) -> list[str]:
    """Write ``latency_distributions.png`` and ``hit_rate_ttft_over_time.png``; returns paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = Path(plot_dir)
    d.mkdir(parents=True, exist_ok=True)
    ok = [i for i, e in enumerate(report["errors"]) if not e]
    ttft = [report["ttfts"][i] * 1000 for i in ok]
    itl = [x * 1000 for i in ok for x in report["itls"][i]]
    tpot = []
    for i in ok:
        n = report["output_lens"][i]
        if n > 1:
            tpot.append((report["e2e_latencies"][i] - report["ttfts"][i]) / (n - 1) * 1000)
    name = report.get("config", {}).get("workload", "")
    paths = []

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, vals, title in zip(axes, (ttft, tpot, itl), ("TTFT", "TPOT", "ITL")):
        if vals:
            ax.hist(vals, bins=min(40, max(5, len(vals) // 2)), color="tab:blue", alpha=0.8)
            ax.axvline(float(np.median(vals)), color="k", linestyle="--", label="median")
            ax.legend()
        ax.set_title(f"{title} ({len(vals)} samples)")
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
        ax.grid(alpha=0.3)
    fig.suptitle(f"latency distributions: {name}")
    fig.tight_layout()
    p = d / "latency_distributions.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(str(p))

    starts = [report["start_times"][i] for i in ok]
    prompt = [report["prompt_tokens"][i] for i in ok]
    cached = [report["cached_tokens"][i] for i in ok]
    per_req = [c / p if p else 0.0 for c, p in zip(cached, prompt)]
    cum = np.cumsum(cached) / np.maximum(np.cumsum(prompt), 1) if ok else np.array([])
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    ax1.scatter(starts, per_req, s=12, label="per request")
    ax1.plot(starts, cum, color="tab:orange", label="cumulative")
    ax1.set_ylabel("prompt cache hit rate")
    ax1.set_ylim(-0.02, 1.02)
    ax1.grid(alpha=0.3)
    ax1.legend()
    ax2.scatter(starts, ttft, s=12, color="tab:red")
    ax2.set_ylabel("TTFT (ms)")
    ax2.set_xlabel("request start (s since benchmark start)")
    ax2.grid(alpha=0.3)
    fig.suptitle(f"hit rate and TTFT over time: {name}")
    fig.tight_layout()
    p = d / "hit_rate_ttft_over_time.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(str(p))
    return paths


# ----------------------------------------------------------------------------- entry points
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
