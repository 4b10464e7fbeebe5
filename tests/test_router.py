"""The cache-aware router in front of real replicas (in-process uvicorn, the real engine on the
tiny random Llama): shared prefixes stick to one replica, a dead replica's traffic moves, a
stream through the router is the same text as direct, the OpenAI client works unchanged."""

from __future__ import annotations

import time

import httpx
import pytest
from fake_engine import ServerThread

from bench.tiny_model import tiny_loaded_model
from radixkv.server.router_policy import (
    CacheAwarePolicy,
    ReplicaPrefixIndex,
    ReplicaState,
    RoundRobinPolicy,
    route_key,
)

KEY = "router-key"


def replica(api_key: str | None = None) -> ServerThread:
    from radixkv import Engine
    from radixkv.server.app import create_app

    engine = Engine(tiny_loaded_model(), page_size=8, dtype="float32", kv_cache_tokens=8192)
    return ServerThread(create_app(engine, api_key=api_key)).start()


def router(
    urls: list[str], policy: str = "cache_aware", health_interval: float = 0.3, **knobs
) -> ServerThread:
    from radixkv.server.router import create_router_app

    app = create_router_app(urls, policy, health_interval=health_interval, **knobs)
    return ServerThread(app).start()


def system(i: int) -> str:
    return f"System prompt {i}: " + " ".join(f"rule{i}-{j}" for j in range(40)) + "\n\n"


def complete(base: str, prompt: str, **extra) -> httpx.Response:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
    body.update(extra)
    r = httpx.post(
        base + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r


@pytest.fixture(scope="module")
def replicas():
    servers = [replica(KEY), replica(KEY)]
    yield servers
    for s in servers:
        s.stop()


# ---------------------------------------------------------------------------- policy alone
def test_policy_follows_prefix_until_imbalanced() -> None:
    reps = [ReplicaState("a", ReplicaPrefixIndex(10_000)), ReplicaState("b")]
    pol = CacheAwarePolicy(balance_abs_threshold=4, balance_rel_threshold=1.5)
    k1 = route_key("/generate", {"text": system(1) + "q1"})
    i, m = pol.select(reps, k1)
    assert m == 0
    reps[i].index.insert(k1)
    k2 = route_key("/generate", {"text": system(1) + "q2"})
    j, m2 = pol.select(reps, k2)
    assert j == i and m2 >= len(system(1))
    other = route_key("/generate", {"text": system(2) + "q1"})
    assert pol.select(reps, other)[0] == 1 - i  # a new prefix goes to the emptier tree
    reps[i].in_flight = 10  # overloaded: the least loaded replica gets it despite the match
    assert pol.select(reps, k2)[0] == 1 - i
    reps[i].in_flight = 0
    reps[i].healthy = False
    assert pol.select(reps, k2)[0] == 1 - i
    assert pol.select(reps, k2, exclude=[1 - i])[0] is None
    rr = RoundRobinPolicy()
    reps[i].healthy = True
    assert [rr.select(reps, k2)[0] for _ in range(4)] == [0, 1, 0, 1]
    # salts and kinds never share a prefix
    salted = route_key("/v1/completions", {"prompt": system(1) + "q2", "cache_salt": "t"})
    assert reps[i].index.match(salted) == 0
    ids = route_key("/generate", {"input_ids": [ord(c) for c in system(1)]})
    assert reps[i].index.match(ids) == 0
    chat = route_key("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    longer = route_key(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]},
    )
    assert longer.units[: len(chat)] == chat.units
    for r in reps:
        r.index.check_integrity()


# ---------------------------------------------------------------------------- over HTTP
def test_shared_prefixes_stick_to_one_replica(replicas) -> None:
    urls = [s.base_url for s in replicas]
    rt = router(urls)
    try:
        where: dict[int, set[str]] = {}
        cached: list[int] = []
        for q in range(3):
            for g in range(4):
                r = complete(rt.base_url, system(g) + f"Question {q}?", cache_salt="stick")
                where.setdefault(g, set()).add(r.headers["x-radixkv-replica"])
                if q:
                    cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert all(len(v) == 1 for v in where.values()), where
        assert {next(iter(v)) for v in where.values()} == set(urls)  # groups spread out
        assert min(cached) >= len(system(0)) - 16  # every repeat hit its replica's cache
        stats = httpx.get(rt.base_url + "/router/stats").json()
        assert sum(r["requests"] for r in stats["replicas"]) == 12
        assert all(r["errors"] == 0 for r in stats["replicas"])
        metrics = httpx.get(rt.base_url + "/metrics").text
        assert "radixkv_router_prefix_match_chars_total" in metrics
    finally:
        rt.stop()
    rr = router(urls, "round_robin")
    try:
        seen = {
            complete(rr.base_url, system(7) + f"Q{q}").headers["x-radixkv-replica"]
            for q in range(2)
        }
        assert seen == set(urls)  # round robin scatters a prefix group
    finally:
        rr.stop()


def test_stream_through_router_is_the_same_text_and_openai_client_works(replicas) -> None:
    from openai import OpenAI

    rt = router([s.base_url for s in replicas])
    try:
        prompt = system(3) + "Stream please."
        direct = complete(replicas[0].base_url, prompt, max_tokens=12).json()
        client = OpenAI(base_url=rt.base_url + "/v1", api_key=KEY, max_retries=0)
        chunks = list(
            client.completions.create(
                model="tiny-llama", prompt=prompt, max_tokens=12, temperature=0.0, stream=True
            )
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert len(chunks) >= 3  # relayed chunk by chunk, not one buffered blob
        assert text == direct["choices"][0]["text"]
        # unbuffered: the first event arrives long before the last one
        body = {"model": "tiny-llama", "prompt": "Count:", "max_tokens": 200, "stream": True}
        body.update(temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        with httpx.stream(
            "POST",
            rt.base_url + "/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=120,
        ) as s:
            assert s.status_code == 200
            times = [
                time.perf_counter() - t0 for line in s.iter_lines() if line.startswith("data:")
            ]
        assert len(times) >= 100
        assert times[0] < 0.5 * times[-1], (times[0], times[-1])
        models = client.models.list()
        assert [m.id for m in models.data] == ["tiny-llama"]
        messages = [{"role": "user", "content": "hello"}]
        chat = client.chat.completions.create(
            model="tiny-llama", messages=messages, max_tokens=4, temperature=0.0
        )
        direct_chat = httpx.post(
            replicas[1].base_url + "/v1/chat/completions",
            json={"model": "tiny-llama", "messages": messages, "max_tokens": 4, "temperature": 0},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=60,
        )
        assert direct_chat.status_code == 200, direct_chat.text
        assert chat.usage is not None and chat.usage.completion_tokens == 4
        # the same greedy answer as a replica gives directly (both replicas hold one model)
        assert (
            chat.choices[0].message.content
            == direct_chat.json()["choices"][0]["message"]["content"]
        )
        # the key is passed through: the replicas refuse a wrong one
        bad = httpx.post(
            rt.base_url + "/v1/completions",
            json={"model": "tiny-llama", "prompt": "x", "max_tokens": 1},
            headers={"Authorization": "Bearer wrong"},
        )
        assert bad.status_code == 401
        native = httpx.post(
            rt.base_url + "/generate",
            json={"text": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0}},
            headers={"Authorization": f"Bearer {KEY}"},
        )
        assert native.status_code == 200, native.text
        assert native.json()["text"] == direct["choices"][0]["text"]
    finally:
        rt.stop()


def test_dead_replica_traffic_moves() -> None:
    a, b = replica(KEY), replica(KEY)
    # health checks only at startup: the request path itself must find the dead replica
    rt = router([a.base_url, b.base_url], health_interval=3600)
    try:
        prompt = system(5) + "Who serves me?"
        first = complete(rt.base_url, prompt).headers["x-radixkv-replica"]
        victim, survivor = (a, b) if first == a.base_url else (b, a)
        assert complete(rt.base_url, prompt).headers["x-radixkv-replica"] == first
        victim.stop()
        # the next request meets a refused connection and is retried on the survivor
        for _ in range(3):
            r = complete(rt.base_url, prompt)
            assert r.headers["x-radixkv-replica"] == survivor.base_url
        health = httpx.get(rt.base_url + "/health").json()
        state = {x["url"]: x for x in health["replicas"]}
        assert not state[victim.base_url]["healthy"] and state[survivor.base_url]["healthy"]
        assert state[victim.base_url]["errors"] == 1  # found once, then skipped
        assert "radixkv_router_retries_total 1.0" in httpx.get(rt.base_url + "/metrics").text
        # streaming requests move too
        with httpx.stream(
            "POST",
            rt.base_url + "/v1/completions",
            json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 4, "stream": True},
            headers={"Authorization": f"Bearer {KEY}"},
        ) as s:
            assert s.status_code == 200
            assert s.headers["x-radixkv-replica"] == survivor.base_url
            assert "[DONE]" in "".join(s.iter_text())
        survivor.stop()
        dead = httpx.post(
            rt.base_url + "/v1/completions",
            json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 1},
            headers={"Authorization": f"Bearer {KEY}"},
        )
        assert dead.status_code == 503
        assert httpx.get(rt.base_url + "/health").status_code == 503
    finally:
        rt.stop()
        a.stop()
        b.stop()


def test_health_checks_keep_traffic_off_a_dead_replica(replicas) -> None:
    from redis_fixture import free_port

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    rt = router([dead, replicas[0].base_url])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            state = {x["url"]: x for x in httpx.get(rt.base_url + "/health").json()["replicas"]}
            if not state[dead]["healthy"]:
                break
            time.sleep(0.1)
        assert not state[dead]["healthy"]
        for g in range(4):  # new prefixes would go to the empty tree: never to a dead replica
            r = complete(rt.base_url, system(g) + "Q")
            assert r.headers["x-radixkv-replica"] == replicas[0].base_url
        stats = {x["url"]: x for x in httpx.get(rt.base_url + "/router/stats").json()["replicas"]}
        assert stats[dead]["requests"] == 0 and stats[dead]["errors"] == 0
        assert (
            'radixkv_router_replica_healthy{replica="' + dead + '"} 0.0'
            in httpx.get(rt.base_url + "/metrics").text
        )
    finally:
        rt.stop()
