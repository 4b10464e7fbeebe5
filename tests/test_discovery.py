"""What vLLM and SGLang clients ask a server about itself: ``/version``, ``/ping``,
``/tokenize``, ``/detokenize``, SGLang's ``/server_info`` and ``/model_info`` (and their
``/get_*`` names), vLLM's ``/reset_prefix_cache``. The real tokenizer's answers are checked
against the engine's own tokenization in ``tests/test_server_real_model.py``."""

from __future__ import annotations

import httpx
import pytest
from fake_engine import FakeEngine, ServerThread

from radixkv import __version__
from radixkv.server.app import create_app

MODEL = "fake-served"
KEY, ADMIN = "tenant-key", "admin-key"


@pytest.fixture(scope="module")
def srv():
    app = create_app(FakeEngine(), api_key=KEY, admin_key=ADMIN, model_name=MODEL)
    with ServerThread(app) as s:
        yield s


def post(srv: ServerThread, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(srv.base_url + path, json=body, headers=headers, timeout=30)


def test_version_and_ping_are_open(srv: ServerThread) -> None:
    r = httpx.get(srv.base_url + "/version")
    assert r.status_code == 200 and r.json() == {"version": __version__}
    assert httpx.get(srv.base_url + "/ping").status_code == 200
    assert httpx.post(srv.base_url + "/ping").status_code == 200


def test_tokenize_and_detokenize_round_trip(srv: ServerThread) -> None:
    text = "héllo, world"
    want = FakeEngine().tokenizer.encode(text)
    r = post(srv, "/tokenize", {"prompt": text})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": len(want), "max_model_len": 512, "tokens": want}
    assert post(srv, "/tokenize", {"model": MODEL, "prompt": text}).json()["tokens"] == want
    chat = post(srv, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == FakeEngine().tokenizer.encode("<|user|>hi\n<|assistant|>")
    back = post(srv, "/detokenize", {"tokens": want})
    assert back.status_code == 200 and back.json() == {"prompt": text}


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, None),
        ("/tokenize", {}, 400, None),
        ("/tokenize", {"prompt": "x", "truncate": 3}, 400, "truncate"),
        ("/tokenize", {"prompt": "w" * (512 * 33)}, 400, "prompt"),
        ("/detokenize", {"tokens": [5, -1]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)
def test_bad_tokenizer_requests_are_4xx_naming_the_field(
    srv: ServerThread, path: str, body: dict, status: int, param: str | None
) -> None:
    r = post(srv, path, body)
    assert r.status_code == status, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param, r.text


def test_tokenizer_routes_need_a_key(srv: ServerThread) -> None:
    assert post(srv, "/tokenize", {"prompt": "x"}, key=None).status_code == 401
    assert post(srv, "/detokenize", {"tokens": [5]}, key="wrong").status_code == 401


def test_sglang_discovery(srv: ServerThread) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(srv.base_url + path, headers=auth).json()
        assert info["served_model_name"] == MODEL and info["model_path"] == "fake-model"
        assert info["context_length"] == 512 and info["page_size"] == 4
        assert info["max_total_num_tokens"] == 2048 * 4 and info["version"] == __version__
    for path in ("/model_info", "/get_model_info"):
        info = httpx.get(srv.base_url + path, headers=auth).json()
        assert info["is_generation"] is True and info["tokenizer_path"] == "fake-model"
    assert httpx.get(srv.base_url + "/server_info").status_code == 401


def test_reset_prefix_cache_is_the_admins_flush(srv: ServerThread) -> None:
    assert post(srv, "/reset_prefix_cache", {}, key=KEY).status_code == 403
    r = post(srv, "/reset_prefix_cache", {}, key=ADMIN)
    assert r.status_code == 200 and r.json()["success"] is True


def test_vllm_and_sglang_metric_names(srv: ServerThread) -> None:
    """A vLLM or SGLang dashboard finds its series: parsed with Prometheus' own text parser,
    each peer name carries model_name and equals radixkv's series it renames."""
    from prometheus_client.parser import text_string_to_metric_families

    for _ in range(2):  # the second hits the cache
        r = post(
            srv, "/v1/completions", {"prompt": "a shared prompt, long enough", "max_tokens": 3}
        )
        assert r.status_code == 200, r.text
    text = httpx.get(srv.base_url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}

    def value(name: str, **labels: str) -> float:
        samples = [
            s
            for s in fams[name].samples
            if all(s.labels.get(k) == v for k, v in labels.items())
            and not s.name.endswith(("_created", "_bucket"))
        ]
        assert samples, (name, labels)
        return sum(s.value for s in samples if not s.name.endswith("_sum"))

    pairs = {
        "vllm:prompt_tokens": "radixkv_prompt_tokens",
        "sglang:prompt_tokens": "radixkv_prompt_tokens",
        "vllm:prefix_cache_queries": "radixkv_prompt_tokens",
        "vllm:prefix_cache_hits": "radixkv_cached_tokens",
        "sglang:cached_tokens": "radixkv_cached_tokens",
        "vllm:generation_tokens": "radixkv_generation_tokens",
        "vllm:num_requests_running": "radixkv_num_requests_running",
        "sglang:num_queue_reqs": "radixkv_num_requests_waiting",
        "sglang:cache_hit_rate": "radixkv_cache_hit_rate",
        "vllm:time_to_first_token_seconds": "radixkv_time_to_first_token_seconds",
        "sglang:e2e_request_latency_seconds": "radixkv_e2e_request_latency_seconds",
    }
    for peer, ours in pairs.items():
        assert value(peer, model_name=MODEL) == value(ours), peer
    assert value("vllm:prefix_cache_hits", model_name=MODEL) > 0
    assert value("vllm:request_success", finished_reason="length", model_name=MODEL) >= 2
    held = value("radixkv_kv_pages_used") - value("radixkv_kv_pages_evictable")
    used = held / value("radixkv_kv_pages_total")
    assert value("vllm:kv_cache_usage_perc", model_name=MODEL) == pytest.approx(used)
    assert value("sglang:token_usage", model_name=MODEL) == pytest.approx(used)
    assert fams["vllm:time_to_first_token_seconds"].type == "histogram"


def test_x_request_id_is_honoured_and_returned(srv: ServerThread) -> None:
    r = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert len(r.headers["x-request-id"]) == 32  # none sent: a fresh one
    headers = {"Authorization": f"Bearer {KEY}", "X-Request-Id": "trace-42.a:b"}
    body = {"prompt": "hi", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42.a:b"
    refused = httpx.post(
        srv.base_url + "/v1/completions", json=body, headers={"X-Request-Id": "x y"}
    )
    assert refused.status_code == 401 and refused.headers["x-request-id"] != "x y"


def test_the_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from radixkv.server.key_flags import API_KEY_ENV, add_key_flags, keys_from_args

    p = argparse.ArgumentParser()
    add_key_flags(p)
    monkeypatch.setenv(API_KEY_ENV, "env-key")
    assert keys_from_args(p.parse_args([])).api_keys == ["env-key"]
    assert keys_from_args(p.parse_args(["--api-key", "flag-key"])).api_keys == ["flag-key"]
    monkeypatch.delenv(API_KEY_ENV)
    assert keys_from_args(p.parse_args([])).api_keys == []


def test_start_up_warnings_about_keys() -> None:
    from radixkv.server.key_flags import KeyArgs, key_warnings

    assert key_warnings(KeyArgs([], None, False), "127.0.0.1") == []
    assert "without --api-key" in key_warnings(KeyArgs([], None, False), "0.0.0.0")[0]
    assert key_warnings(KeyArgs(["k"], None, False), "0.0.0.0") == []
    closed = key_warnings(KeyArgs(["k1", "k2"], None, True), "0.0.0.0")
    assert len(closed) == 1 and "no --admin-key" in closed[0]
    assert key_warnings(KeyArgs(["k1", "k2"], "adm", True), "0.0.0.0") == []
    # several keys in one cache namespace: each can hit (and time) the others' prompts
    (shared,) = key_warnings(KeyArgs(["k1", "k2"], "adm", False), "127.0.0.1")
    assert "2 API keys share one prefix-cache namespace" in shared
    assert "--salt-from-api-key" in shared


def test_kv_usage_counts_idle_cached_pages_as_free_as_vllm_does(tiny_model) -> None:
    """An idle server whose pool holds finished, cached prompts reads (near) 0 on
    vllm:kv_cache_usage_perc (it read 0.98 before: autoscalers keyed on it scaled up forever),
    while radixkv_kv_pages_cached shows what the cache holds; preemptions are counted under
    vLLM's name; parsed with Prometheus' own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    from radixkv import Engine
    from radixkv.server.app import create_app

    engine = Engine(model=tiny_model, dtype="float32", page_size=16, kv_cache_tokens=4096)
    with ServerThread(create_app(engine)) as server:
        for i in range(40):  # distinct prompts of ~100 tokens: most of the pool ends up cached
            body = {"prompt": f"{i:03d} " + "lorem ipsum dolor " * 5, "max_tokens": 2}
            assert httpx.post(server.base_url + "/v1/completions", json=body).status_code == 200
        text = httpx.get(server.base_url + "/metrics").text
        stats = server.app.state.engine_loop.call_sync(lambda e: e.stats())
    fams = {f.name: f for f in text_string_to_metric_families(text)}

    def value(name: str) -> float:
        return next(s.value for s in fams[name].samples if not s.name.endswith("_created"))

    assert stats["running"] == 0 and stats["pages_cached"] > 0.5 * stats["pages_total"], stats
    assert value("radixkv_kv_pages_cached") == stats["pages_cached"]
    assert value("vllm:kv_cache_usage_perc") == pytest.approx(
        (stats["pages_used"] - stats["pages_evictable"]) / stats["pages_total"]
    )
    assert value("vllm:kv_cache_usage_perc") < 0.05
    assert value("vllm:num_preemptions") == stats["preemptions_total"]


def test_request_phase_histograms_with_vllms_names_and_buckets(tiny_model) -> None:
    """vLLM's queue / prefill / decode / inference split of a request, from the scheduler's
    first admission: with one running request at a time, B (one token) sent while A (300 tokens)
    decodes waits in the queue for A's decode; the phases add up (inference = prefill + decode,
    per request), the lengths and parameters are counted, the buckets are vLLM's, and the
    cache hits (B shares A's prompt), TTFTs and preemptions are what the script made."""
    import threading

    from prometheus_client.parser import text_string_to_metric_families

    from radixkv import Engine
    from radixkv.server.app import create_app
    from radixkv.server.metrics import REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS

    engine = Engine(
        model=tiny_model, dtype="float32", page_size=16, kv_cache_tokens=1024,
        max_running_requests=1,
    )  # fmt: skip
    prompt = "a prompt both requests share, forty-odd bytes"
    a = {"prompt": prompt, "max_tokens": 300, "ignore_eos": True, "stream": True}
    b = {"prompt": prompt, "max_tokens": 1, "ignore_eos": True}
    with ServerThread(create_app(engine)) as server:
        first_token = threading.Event()

        def run_a() -> None:
            with httpx.stream("POST", server.base_url + "/v1/completions", json=a) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        first_token.set()

        thread = threading.Thread(target=run_a)
        thread.start()
        assert first_token.wait(30)
        assert httpx.post(server.base_url + "/v1/completions", json=b).status_code == 200
        thread.join(30)
        text = httpx.get(server.base_url + "/metrics").text
        length = len(
            httpx.post(server.base_url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
        )
    fams = {f.name: f for f in text_string_to_metric_families(text)}

    def hist(name: str) -> tuple[float, float, list[float]]:
        samples = fams[name].samples
        count = next(s.value for s in samples if s.name.endswith("_count"))
        total = next(s.value for s in samples if s.name.endswith("_sum"))
        bounds = [float(s.labels["le"]) for s in samples if s.name.endswith("_bucket")]
        return count, total, bounds

    for phase in ("queue", "prefill", "decode", "inference"):
        count, _, bounds = hist(f"vllm:request_{phase}_time_seconds")
        assert count == 2, phase
        assert bounds[:-1] == list(REQUEST_LATENCY_BUCKETS), phase
    assert hist("vllm:time_to_first_token_seconds")[2][:-1] == list(TTFT_BUCKETS)
    queue, prefill = (
        hist("vllm:request_queue_time_seconds")[1],
        hist("vllm:request_prefill_time_seconds")[1],
    )
    decode, inference = (
        hist("vllm:request_decode_time_seconds")[1],
        hist("vllm:request_inference_time_seconds")[1],
    )
    assert inference == pytest.approx(prefill + decode)
    assert decode > 0  # A's 299 tokens after its first; B's one token has no decode
    assert queue >= 0.5 * decode, (queue, decode)  # B waited through (most of) A's decode
    e2e = hist("vllm:e2e_request_latency_seconds")[1]
    assert queue + inference <= e2e + 1e-6  # the engine's span sits inside the server's
    assert hist("vllm:request_generation_tokens")[:2] == (2, 301)
    assert hist("vllm:request_params_max_tokens")[:2] == (2, 301)
    assert hist("vllm:request_params_n")[:2] == (2, 2)
    count, tpot, _ = hist("vllm:request_time_per_output_token_seconds")
    assert count == 1 and tpot == pytest.approx(decode / 299)
    assert hist("vllm:request_prompt_tokens")[:2] == (2, 2 * length)
    # TTFT: both requests; B's includes its time in the queue
    ttft_count, ttft, _ = hist("vllm:time_to_first_token_seconds")
    assert ttft_count == 2 and ttft >= queue
    # B read A's prompt from the cache but its last token (always computed; a partial page is
    # shared too); nothing was preempted
    counter = {s.name: s.value for f in fams.values() for s in f.samples}
    assert counter["vllm:prefix_cache_queries_total"] == 2 * length
    assert counter["vllm:prefix_cache_hits_total"] == length - 1
    assert counter["vllm:num_preemptions_total"] == 0
