"""The streaming (SSE) client of the serving benchmark: send, time and collect every request.

Per request it measures TTFT (first content chunk), inter-token latencies (between content
chunks) and end-to-end latency, and reads ``usage`` (with ``cached_tokens``) from the final chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.serve_config import BenchConfig
from bench.serve_workloads import Session, Turn, build_sessions, render_prompt

__all__ = ["RequestResult", "benchmark_async", "send_request"]


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
                prompt = render_prompt(cfg, session, history, turn)
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
