"""bench/serve.py: the streaming benchmark client, against live servers on a loopback port.

* A small fake OpenAI-compatible app defined here (streaming completions + chat, a page-granular
  toy prefix cache reporting ``cached_tokens``) checks the report schema, multi-turn replay with
  real answers, concurrency limits and the CLI. It needs nothing but FastAPI.
* The real radixkv server (``radixkv.server.app.create_app`` around ``radixkv.Engine`` on a tiny
  random Llama) checks that hit rates measured over HTTP equal the server's ``/metrics`` counters
  and the simulator's figure for the same trace and capacity (within one page per request). An
  error building the engine fails that test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from bench.bench_vllm_serve import (
    multi_turn_dataset,
    phase_order,
    print_median_ratios,
    print_table,
)
from bench.serve import ARRAY_KEYS, METRIC_KEYS, BenchConfig, main, run_benchmark
from radixkv.server.ports import free_port
from radixkv.sim.simulator import hash_tokenize

PAGE = 4


# ----------------------------------------------------------------------------- helpers


class LiveServer:
    """Run an ASGI app with uvicorn on a background thread, on a free loopback port."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def make_fake_app(token_delay: float = 0.002) -> FastAPI:
    """An OpenAI-compatible streaming server with a toy page-granular prefix cache.

    Text prompts are tokenized with the simulator's ``hash_tokenize``; the answer to a prompt is
    ``max_tokens`` words ``w<k>`` (one chunk each). ``app.state.log`` records every request body;
    ``app.state.max_in_flight`` the largest number of concurrent requests seen.
    """
    app = FastAPI()
    cache: set[tuple[int, ...]] = set()
    app.state.log = []
    app.state.in_flight = 0
    app.state.max_in_flight = 0
    app.state.counter = 0

    def cached_prefix(ids: list[int]) -> int:
        n = 0
        for end in range(PAGE, len(ids) + 1, PAGE):
            if tuple(ids[:end]) not in cache:
                break
            n = end
        return n

    def insert(ids: list[int]) -> None:
        for end in range(PAGE, len(ids) + 1, PAGE):
            cache.add(tuple(ids[:end]))

    async def handle(request: Request, chat: bool) -> StreamingResponse:
        body = await request.json()
        app.state.log.append(body)
        if chat:
            ids = hash_tokenize(" ".join(m["content"] for m in body["messages"]))
        elif isinstance(body["prompt"], str):
            ids = hash_tokenize(body["prompt"])
        else:
            ids = [int(t) for t in body["prompt"]]
        cached = cached_prefix(ids)
        insert(ids)
        n_out = int(body["max_tokens"])
        app.state.counter += 1
        tag = app.state.counter

        def chunk(text: str | None, usage: dict[str, Any] | None = None) -> str:
            choices = []
            if text is not None:
                choices = [{"index": 0, "delta": {"content": text}} if chat else {"text": text}]
            obj: dict[str, Any] = {"id": f"x{tag}", "choices": choices}
            if usage:
                obj["usage"] = usage
            return f"data: {json.dumps(obj)}\n\n"

        async def events() -> Any:
            app.state.in_flight += 1
            app.state.max_in_flight = max(app.state.max_in_flight, app.state.in_flight)
            try:
                if chat:
                    yield f"data: {json.dumps({'choices': [{'delta': {'role': 'assistant'}}]})}\n\n"
                for k in range(n_out):
                    await asyncio.sleep(token_delay)
                    yield chunk(f" w{tag}x{k}")
                usage = {
                    "prompt_tokens": len(ids),
                    "completion_tokens": n_out,
                    "prompt_tokens_details": {"cached_tokens": cached},
                }
                if (body.get("stream_options") or {}).get("include_usage"):
                    yield chunk(None, usage)
                yield "data: [DONE]\n\n"
            finally:
                app.state.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> StreamingResponse:
        return await handle(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"data": [{"id": "fake-model"}]}

    @app.post("/flush_cache")
    async def flush() -> dict[str, bool]:
        cache.clear()
        return {"success": True}

    return app


@pytest.fixture
def fake_server() -> Iterator[tuple[LiveServer, FastAPI]]:
    app = make_fake_app()
    with LiveServer(app) as srv:
        yield srv, app


TINY_GSP = dict(
    workload="generated-shared-prefix",
    gsp_num_groups=2,
    gsp_prompts_per_group=3,
    gsp_system_prompt_len=32,
    gsp_question_len=8,
    gsp_output_len=4,
    disable_tqdm=True,
)


def assert_report_complete(report: dict[str, Any], n: int) -> None:
    missing = [k for k in (*METRIC_KEYS, *ARRAY_KEYS, "config") if k not in report]
    assert not missing, f"report lacks {missing}"
    assert report["completed"] == n and report["failed"] == 0, report["errors"]
    for key in ARRAY_KEYS:
        assert len(report[key]) == n, key
    for key in METRIC_KEYS:
        assert isinstance(report[key], int | float), key
    assert report["start_times"] == sorted(report["start_times"])


# ----------------------------------------------------------------------------- fake server
def test_report_has_every_field(fake_server: Any, tmp_path: Path) -> None:
    srv, app = fake_server
    out = tmp_path / "r.json"
    report = run_benchmark(base_url=srv.url, output=out, plot_dir=tmp_path / "plots", **TINY_GSP)
    assert_report_complete(report, 6)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["model"] == "fake-model"
    assert report["total_input_tokens"] == 6 * 40
    assert report["total_output_tokens"] == 6 * 4
    # the toy cache: after flush, per group the first request misses, the others hit 32 tokens
    assert report["total_cached_tokens"] == 2 * 2 * 32
    assert report["cache_hit_rate"] == pytest.approx(128 / 240)
    assert all(len(itl) == 3 for itl in report["itls"])
    assert 0 < report["mean_ttft_ms"] <= report["mean_e2e_latency_ms"]
    assert report["mean_tpot_ms"] > 0 and report["p99_itl_ms"] >= report["median_itl_ms"]
    assert report["config"]["request_rate"] == "inf"
    for name in ("latency_distributions.png", "hit_rate_ttft_over_time.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 1000
    bodies = app.state.log[1:]  # the first is the warm-up request
    assert len(bodies) == 6
    for b in bodies:  # token-id prompts, fixed output length, usage in the stream
        assert isinstance(b["prompt"], list) and all(isinstance(t, int) for t in b["prompt"])
        assert b["temperature"] == 0 and b["ignore_eos"] is True and b["stream"] is True
        assert b["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_multi_turn_sends_the_real_answers(fake_server: Any, endpoint: str) -> None:
    srv, app = fake_server
    report = run_benchmark(
        base_url=srv.url,
        endpoint=endpoint,
        workload="multi-turn",
        mt_clients=2,
        mt_rounds=3,
        mt_turn_len=6,
        mt_output_len=3,
        request_rate=100.0,
        warmup_requests=0,
        disable_tqdm=True,
        return_trace=True,
    )
    assert_report_complete(report, 6)
    bodies = app.state.log
    assert len(bodies) == 6
    # Every round after the first contains an earlier answer of the fake server verbatim.
    answers = re.compile(r"w(\d+)x0 w\1x1 w\1x2")
    later = 0
    for b in bodies:
        if endpoint == "chat":
            msgs = b["messages"]
            assistant = [m["content"] for m in msgs if m["role"] == "assistant"]
            assert len(msgs) == 2 * len(assistant) + 1
            assert all(answers.search(a) for a in assistant)
            later += bool(assistant)
        else:
            later += bool(answers.search(b["prompt"]))
    assert later == 4  # rounds 2 and 3 of both clients
    # The prompt grows round by round, so later rounds hit the cache.
    assert report["total_cached_tokens"] > 0
    assert len(report["trace"]) == 6 and all("output_text" in r for r in report["trace"])


def test_rate_and_max_concurrency(fake_server: Any) -> None:
    srv, app = fake_server
    report = run_benchmark(
        base_url=srv.url, request_rate=200.0, max_concurrency=1, seed=3, **TINY_GSP
    )
    assert_report_complete(report, 6)
    assert app.state.max_in_flight == 1
    with pytest.raises(ValueError, match="request_rate"):
        BenchConfig(request_rate=0).validate()


def test_cli_writes_json(fake_server: Any, tmp_path: Path, capsys: Any) -> None:
    srv, _ = fake_server
    out = tmp_path / "cli.json"
    code = main(
        [
            "--base-url",
            srv.url + "/v1",
            "--workload",
            "few-shot",
            "--fs-shots",
            "2",
            "--fs-requests",
            "4",
            "--fs-example-len",
            "8",
            "--fs-question-len",
            "8",
            "--fs-output-len",
            "2",
            "--request-rate",
            "inf",
            "--disable-tqdm",
            "--output",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert_report_complete(report, 4)
    assert report["cache_hit_rate"] > 0.5
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_failed_requests_are_counted(tmp_path: Path) -> None:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"data": [{"id": "m"}]}

    @app.post("/v1/completions")
    async def broken() -> None:
        raise RuntimeError("boom")

    with LiveServer(app) as srv:
        report = run_benchmark(base_url=srv.url, warmup_requests=0, **TINY_GSP)
    assert report["completed"] == 0 and report["failed"] == 6
    assert all(e.startswith("HTTP 500") for e in report["errors"])


def test_compare_and_report_on_an_extra_url(fake_server: Any, tmp_path: Path) -> None:
    """bench.compare with no managed server and one --extra-url; bench.report renders it."""
    from bench import compare, report

    srv, _ = fake_server
    out = tmp_path / "cmp.json"
    md = tmp_path / "bench.md"
    code = compare.main(
        [
            "--quick",
            "--configs",
            "",
            "--workloads",
            "few-shot,multi-turn",
            "--extra-url",
            f"fake={srv.url}",
            "--disable-tqdm",
            "--output",
            str(out),
            "--markdown",
            str(md),
        ]
    )
    assert code == 0
    results = json.loads(out.read_text())
    rows = results["rows"]
    assert [(r["server"], r["status"]) for r in rows] == [("fake", "ok"), ("fake", "ok")]
    for r in rows:
        assert 0 < r["cache_hit_rate"] <= r["sim_optimal_hit_rate"] + 1e-9
        assert r["sim_hit_rate_at_capacity"] is None  # unknown capacity of an external server
        assert_report_complete(r["report"], r["completed"])
    assert results["machine"]["cpu_count"] >= 1
    text = md.read_text()
    assert "| few-shot | fake |" in text and "| multi-turn | fake |" in text
    assert report.render(results) == text


# ----------------------------------------------------------------------------- real radixkv
class _ByteishTokenizer:
    """Token id ``t`` decodes to the word ``" t<t>"``: every token makes visible text."""

    eos_token_id = 2
    bos_token_id = 1
    pad_token_id = 0
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [3 + b for b in text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = True, **_: object) -> str:
        return "".join(f" t{i}" for i in ids if not (skip_special_tokens and i < 3))

    def __call__(self, text: str, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}


def _real_app(kv_cache_tokens: int, page_size: int) -> tuple[Any, Any]:
    """``create_app(Engine(tiny random Llama))`` after one warm-up request. Any error building
    the engine or generating is raised: an engine regression fails this test, never skips it."""
    from bench.tiny_model import tiny_loaded_model
    from radixkv.engine.engine import Engine
    from radixkv.engine.sampling import SamplingParams
    from radixkv.server.app import create_app

    model = tiny_loaded_model(
        max_position_embeddings=1024, tokenizer=_ByteishTokenizer(), vocab_size=512, name="tiny"
    )
    engine = Engine(
        model,
        page_size=page_size,
        kv_cache_tokens=kv_cache_tokens,
        attention_backend="torch",
        dtype="float32",
    )
    (warm,) = engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=2, temperature=0.0))
    assert len(warm.token_ids) == 2, warm
    engine.flush_cache()
    return create_app(engine, model_name="tiny"), engine


def _prom(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", text, re.MULTILINE)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_tokens", [4096, 160])
def test_real_server_hit_rate_matches_metrics_and_simulator(kv_cache_tokens: int) -> None:
    from radixkv.sim.simulator import simulate

    page = 4
    app, engine = _real_app(kv_cache_tokens, page)
    with LiveServer(app) as srv:
        before = httpx.get(f"{srv.url}/metrics").text
        stats_before = httpx.get(f"{srv.url}/cache/stats").json()
        report = run_benchmark(
            base_url=srv.url,
            model="tiny",
            vocab_min=3,
            vocab_max=500,
            max_concurrency=1,  # sequential: the simulator's replay order
            warmup_requests=0,
            return_trace=True,
            **{**TINY_GSP, "gsp_system_prompt_len": 40, "gsp_question_len": 10},
        )
        after = httpx.get(f"{srv.url}/metrics").text
        stats = httpx.get(f"{srv.url}/cache/stats").json()
    n = 6
    assert_report_complete(report, n)
    http_cached = report["total_cached_tokens"]
    http_prompt = report["total_input_tokens"]
    assert http_prompt == n * 50
    for name, value in (
        ("radixkv_cached_tokens_total", http_cached),
        ("radixkv_prompt_tokens_total", http_prompt),
    ):
        assert _prom(after, name) - _prom(before, name) == value, name
    assert stats["cached_tokens_total"] - stats_before["cached_tokens_total"] == http_cached
    sim = simulate(report["trace"], engine.kv_capacity_tokens, page, "lru")
    assert sim["prompt_tokens"] == http_prompt
    assert abs(sim["cached_tokens"] - http_cached) <= page * n, (sim, http_cached)
    assert report["cache_hit_rate"] == pytest.approx(http_cached / http_prompt)
    if kv_cache_tokens >= 4096:
        assert report["cache_hit_rate"] > 0.4


def test_vllm_serve_multi_turn_dataset_extends_turn_one(real_model, tmp_path: Path) -> None:
    """bench/bench_vllm_serve.py's multi-turn JSONL: every second turn starts with its
    conversation's first turn (so a server that cached turn 1 can reuse it), conversations share
    one of ``num_prefixes`` system prompts of about ``prefix_len`` tokens, and the table divides
    radixkv's figure by vLLM's."""

    tok = real_model.tokenizer
    args = argparse.Namespace(num_prefixes=2, prefix_len=100, suffix_len=20, output_len=8)
    one = multi_turn_dataset(tok, tmp_path / "t1.jsonl", 1, 6, args, seed=3)
    two = multi_turn_dataset(tok, tmp_path / "t2.jsonl", 2, 6, args, seed=3)
    t1 = [json.loads(line) for line in one.read_text().splitlines()]
    t2 = [json.loads(line) for line in two.read_text().splitlines()]
    assert len(t1) == len(t2) == 6
    for a, b in zip(t1, t2):
        assert b["prompt"].startswith(a["prompt"]) and len(b["prompt"]) > len(a["prompt"])
        assert a["output_tokens"] == 8
    systems = {r["prompt"].split("\nUser:")[0] for r in t1}
    assert len(systems) == 2
    n = len(tok.encode(next(iter(systems)), add_special_tokens=False))
    assert 80 <= n <= 160, n
    other = multi_turn_dataset(tok, tmp_path / "o.jsonl", 1, 2, args, seed=4).read_text()
    assert not any(s in other for s in systems), "another seed must not share system prompts"

    row = {"request_throughput": 3.0, "median_ttft_ms": 100.0, "p99_ttft_ms": 1.0}
    row |= {"median_tpot_ms": 10.0, "p99_tpot_ms": 1.0}
    vrow = dict(row, request_throughput=2.0, median_ttft_ms=200.0)
    runs = {"radixkv": {"w/cold": row}, "vllm": {"w/cold": vrow}}
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_table({"host": "isa=test", "runs": runs})
    text = buf.getvalue()
    assert "| w/cold | req/s | 3.00 | 2.00 | 1.50x |" in text
    assert "| w/cold | TTFT p50 ms | 100.00 | 200.00 | 0.50x |" in text
    # --repeats: each repeat's same-run ratio, then their median
    slower = {"radixkv": {"w/cold": dict(row, request_throughput=1.0)}, "vllm": {"w/cold": vrow}}
    faster = {"radixkv": {"w/cold": dict(row, request_throughput=5.0)}, "vllm": {"w/cold": vrow}}
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_median_ratios({"host": "isa=test", "repeats": [runs, slower, faster]})
    assert "| w/cold | req/s | 1.50x, 0.50x, 2.50x | 1.50x |" in buf.getvalue()


def test_vllm_serve_interleaves_who_goes_first() -> None:
    """Interleaved phases alternate the servers' order, so neither is always measured first
    (the host's drift within a phase pair then favours neither); one server: always itself."""
    names = ["radixkv", "vllm"]
    orders = [phase_order(names, i) for i in range(6)]
    assert orders[0::2] == [names] * 3 and orders[1::2] == [names[::-1]] * 3
    assert [o[0] for o in orders].count("radixkv") == 3
    assert phase_order(["radixkv"], 1) == ["radixkv"] and names == ["radixkv", "vllm"]


def test_the_avx2_proxy_holds_every_vllm_process_to_avx2(tmp_path, monkeypatch):
    """Under the AVX2 proxy (ATEN_CPU_CAPABILITY=avx2) vLLM's processes get a PYTHONPATH whose
    sitecustomize makes torch report no AVX-512, which is how vLLM picks its _C_AVX2 build; a
    fresh interpreter (as vLLM's spawned worker is) sees it. Without the proxy: no path."""
    import os
    import subprocess
    import sys

    from bench.bench_w1 import vllm_pythonpath

    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert vllm_pythonpath(tmp_path) == "" and not (tmp_path / "sitecustomize.py").exists()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    path = vllm_pythonpath(tmp_path)
    assert path == str(tmp_path)
    probe = (
        "import torch; "
        "print(torch.cpu._is_avx512_supported(), torch.cpu._is_avx512_bf16_supported())"
    )
    env = {**os.environ, "PYTHONPATH": path}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["False", "False"], out.stderr
