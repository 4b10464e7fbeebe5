"""The cache-aware router in front of real replicas (in-process uvicorn, the real engine on the
tiny random Llama): shared prefixes stick to one replica, a dead replica's traffic moves, a
stream through the router is the same text as direct, the OpenAI client works unchanged.

The router keeps prompts (its prefix trees): the attack tests at the end play a keyless
guesser and a second tenant against keyed replicas (the real server app on the fake engine,
which checks keys as ``radixkv serve`` does)."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from fake_engine import FakeEngine, ServerThread

from bench.tiny_model import tiny_loaded_model
from radixkv.server.router_policy import (
    CacheAwarePolicy,
    ReplicaPrefixIndex,
    ReplicaState,
    RoundRobinPolicy,
    route_key,
)
from radixkv.server.tenancy import tenant_salt

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


# ---------------------------------------------------------------------------- the attacks
TENANT_A, TENANT_B, ADMIN = "key-tenant-a", "key-tenant-b", "key-router-admin"
SECRET = "System: you are tenant A's assistant. Project X launches on 2031-04-17; never say so.\n"
FAKE = "fake-model"


def auth(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def ask(base: str, key: str | None, prompt: str, path: str = "/v1/completions", **extra):
    if path == "/generate":
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 2}}
    elif path == "/v1/chat/completions":
        body = {"model": FAKE, "messages": [{"role": "system", "content": prompt}]}
    else:
        body = {"model": FAKE, "prompt": prompt, "max_tokens": 2}
    body.update(extra)
    return httpx.post(base + path, json=body, headers=auth(key), timeout=30)


@pytest.fixture(scope="module")
def keyed():
    """Two replicas taking tenant A's and B's keys, one tenant each, and the router's admin key
    as their own admin key, so a flush the router forwards with it is accepted."""
    from radixkv.server.app import create_app

    servers = [
        ServerThread(
            create_app(
                FakeEngine(max_model_len=2048),
                api_key=[TENANT_A, TENANT_B],
                admin_key=ADMIN,
                salt_from_api_key=True,
            )
        ).start()
        for _ in range(2)
    ]
    yield [(s.base_url, s.app.state.engine) for s in servers]
    for s in servers:
        s.stop()


def keyed_router(urls: list[str], **kw) -> ServerThread:
    kw.setdefault("api_keys", [TENANT_A, TENANT_B])
    kw.setdefault("admin_key", ADMIN)
    kw.setdefault("salt_from_api_key", True)
    return router(urls, health_interval=3600, **kw)


def trees(rt: ServerThread) -> list[int]:
    return [st.index.size for st in rt.app.state.replicas]


def admin_stats(rt: ServerThread) -> dict:
    r = httpx.get(rt.base_url + "/router/stats", headers=auth(ADMIN))
    assert r.status_code == 200, r.text
    return r.json()


def test_an_oversized_body_is_refused_at_the_router_unread(keyed) -> None:
    rt = keyed_router([u for u, _ in keyed])
    try:
        big = b'{"prompt": "' + b"x" * (9 << 20) + b'"}'
        r = httpx.post(
            rt.base_url + "/v1/completions",
            content=big,
            headers={"Content-Type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        assert all(size == 0 for size in trees(rt))
        assert ask(rt.base_url, TENANT_A, SECRET + "Q").status_code == 200
    finally:
        rt.stop()


def test_keyless_guesser_gets_401s_and_learns_nothing(keyed) -> None:
    rt = keyed_router([u for u, _ in keyed])
    try:
        for q in ("Q1", "Q2"):  # tenant A's system prompt is in the router's tree
            assert ask(rt.base_url, TENANT_A, SECRET + q).status_code == 200
        before, sizes = admin_stats(rt), trees(rt)
        assert max(sizes) >= len(SECRET)
        wrong = [
            None,
            "Bearer wrong",
            f"Bearer {TENANT_A[:-1]}",
            f"Bearer {TENANT_A}x",
            f"Basic {TENANT_A}",
            "Bearer",
            f"Bearer {TENANT_A} {TENANT_B}",
        ]
        for k, bad in enumerate(wrong):
            guess = SECRET[: 10 + 7 * k]  # a guess further each time
            headers = {} if bad is None else {"Authorization": bad}
            for path in ("/v1/completions", "/generate", "/v1/chat/completions"):
                for stream in (False, True):
                    body = {"model": FAKE, "prompt": guess, "text": guess, "stream": stream}
                    body["messages"] = [{"role": "system", "content": guess}]
                    r = httpx.post(rt.base_url + path, json=body, headers=headers, timeout=30)
                    assert r.status_code == 401, (path, r.text)
                    assert r.json()["error"]["code"] == "invalid_api_key"
                    assert "x-radixkv-replica" not in r.headers
                    assert TENANT_A not in r.text
            for path in ("/router/stats", "/metrics", "/v1/models"):
                r = httpx.get(rt.base_url + path, headers=headers)
                assert r.status_code == 401, path
                assert "prefix_match" not in r.text
            r = httpx.post(rt.base_url + "/flush_cache", headers=headers)
            assert r.status_code == 401
        health = httpx.get(rt.base_url + "/health")
        assert health.status_code == 200  # open, but it tells nothing of the prompts
        assert all(
            set(x) == {"url", "healthy", "in_flight", "errors"} for x in health.json()["replicas"]
        )
        # nothing reached the tree, the counters or a replica
        assert trees(rt) == sizes
        assert admin_stats(rt) == before
    finally:
        rt.stop()


def test_a_tenant_never_matches_another_tenants_prefix(keyed) -> None:
    urls = [u for u, _ in keyed]
    rt = keyed_router(urls)
    try:
        first = ask(rt.base_url, TENANT_A, SECRET + "Q1", cache_salt="team")
        home = first.headers["x-radixkv-replica"]
        again = ask(rt.base_url, TENANT_A, SECRET + "Q2", cache_salt="team")
        assert again.headers["x-radixkv-replica"] == home  # A's own prefix is followed
        matched = sum(r["prefix_match_units"] for r in admin_stats(rt)["replicas"])
        assert matched >= len(SECRET)
        # B guesses A's prompt, with A's client salt and without: no replica's tree matches in
        # B's namespace, so B is routed as for a new prefix (the empty replica), matching 0
        states = rt.app.state.replicas
        for salt in ("team", None):
            body = {"prompt": SECRET + "Q1", **({"cache_salt": salt} if salt else {})}
            key_b = route_key("/v1/completions", body, tenant=tenant_salt(TENANT_B))
            key_a = route_key("/v1/completions", body, tenant=tenant_salt(TENANT_A))
            assert all(st.index.match(key_b) == 0 for st in states)
            assert salt is None or max(st.index.match(key_a) for st in states) >= len(SECRET)
        extra = {"cache_salt": "team"}
        guess = ask(rt.base_url, TENANT_B, SECRET + "Q1", **extra)
        assert guess.status_code == 200
        assert guess.headers["x-radixkv-replica"] != home
        assert sum(r["prefix_match_units"] for r in admin_stats(rt)["replicas"]) == matched
        # a tenant's key does not open the admin routes
        for path in ("/router/stats", "/metrics"):
            r = httpx.get(rt.base_url + path, headers=auth(TENANT_B))
            assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
        assert httpx.post(rt.base_url + "/flush_cache", headers=auth(TENANT_A)).status_code == 403
        assert httpx.get(rt.base_url + "/v1/models", headers=auth(TENANT_B)).status_code == 200
    finally:
        rt.stop()
    # without --salt-from-api-key the keys are one trust domain: B's request follows A's prefix
    one = keyed_router(urls, salt_from_api_key=False)
    try:
        home = ask(one.base_url, TENANT_A, SECRET + "Q1").headers["x-radixkv-replica"]
        assert ask(one.base_url, TENANT_B, SECRET + "Q2").headers["x-radixkv-replica"] == home
    finally:
        one.stop()


def test_only_a_2xx_answer_fills_the_tree(keyed) -> None:
    urls = [u for u, _ in keyed]
    rt = keyed_router(urls)
    try:
        refused = [
            ask(rt.base_url, TENANT_A, SECRET, max_tokens=-1),  # 400
            ask(rt.base_url, TENANT_A, SECRET, model="no-such-model"),  # 404
            ask(rt.base_url, TENANT_A, SECRET, stream=True, temperature=-1.0),  # 400, streamed
            ask(rt.base_url, TENANT_A, SECRET, "/generate", sampling_params={"top_p": 7}),
        ]
        for _, engine in keyed:
            engine.fail_steps = 1  # the next step raises: a 500
        try:
            refused.append(ask(rt.base_url, TENANT_A, SECRET + "boom"))
        finally:
            for _, engine in keyed:
                engine.fail_steps = 0
        codes = [r.status_code for r in refused]
        assert codes == [400, 404, 400, 400, 500], [r.text for r in refused]
        assert all("x-radixkv-replica" not in r.headers for r in refused)
        assert trees(rt) == [0, 0]
        stats = admin_stats(rt)["replicas"]
        assert all(r["prefix_match_units"] == 0 and r["key_units"] == 0 for r in stats)
        ok = ask(rt.base_url, TENANT_A, SECRET + "Q", stream=True)
        assert ok.status_code == 200 and "[DONE]" in ok.text
        assert sum(trees(rt)) == len(SECRET + "Q")  # a 2xx stream is remembered
    finally:
        rt.stop()
    # a router given no keys is open, but the replicas' 401 still leaves the tree empty and
    # does not say where the guess would have gone
    bare = router(urls, health_interval=3600)
    try:
        r = ask(bare.base_url, None, SECRET)
        assert r.status_code == 401 and "x-radixkv-replica" not in r.headers
        assert trees(bare) == [0, 0]
    finally:
        bare.stop()


def test_authorized_traffic_routes_cache_aware_and_the_admin_reads_stats(keyed) -> None:
    urls = [u for u, _ in keyed]
    rt = keyed_router(urls, public_metrics=True)
    try:
        where = {}
        for q in range(2):
            for g, key in enumerate((TENANT_A, TENANT_B)):
                r = ask(rt.base_url, key, f"Tenant {g} system prompt, long enough.\n Q{q}")
                assert r.status_code == 200, r.text
                where.setdefault(g, set()).add(r.headers["x-radixkv-replica"])
        assert all(len(v) == 1 for v in where.values()), where  # the repeat followed its prefix
        stats = admin_stats(rt)
        assert sum(r["requests"] for r in stats["replicas"]) == 4
        assert sum(r["prefix_match_units"] for r in stats["replicas"]) >= 2 * 30
        admin = httpx.get(rt.base_url + "/metrics", headers=auth(ADMIN)).text
        assert "radixkv_router_prefix_match_chars_total" in admin
        public = httpx.get(rt.base_url + "/metrics")  # --public-metrics: load and health only
        assert public.status_code == 200
        assert "radixkv_router_requests_total" in public.text
        assert "prefix_match" not in public.text and "request_chars" not in public.text
        assert httpx.get(rt.base_url + "/router/stats").status_code == 401  # still the admin's
        flushed = httpx.post(rt.base_url + "/flush_cache", headers=auth(ADMIN))
        assert flushed.status_code == 200, flushed.text
        assert trees(rt) == [0, 0]
    finally:
        rt.stop()


def test_router_cli_takes_the_keys(monkeypatch, tmp_path) -> None:
    import uvicorn

    from radixkv.cli import build_parser

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.setdefault("app", app))
    monkeypatch.delenv("RADIXKV_ADMIN_KEY", raising=False)
    keys = tmp_path / "keys"
    keys.write_text(f"# tenants\n{TENANT_B}\n")
    argv = ["router", "--replica", "127.0.0.1:1", "--api-key", TENANT_A, "--api-key-file"]
    argv += [str(keys), "--salt-from-api-key", "--admin-key", ADMIN, "--public-metrics"]
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    ring = seen["app"].state.keys
    assert ring.tenants and ring.api_keys == [TENANT_A, TENANT_B] and ring.admin_key == ADMIN
    assert ring.identify(f"Bearer {TENANT_B}").salt == tenant_salt(TENANT_B)
    bad = build_parser().parse_args(["router", "--replica", "x:1", "--salt-from-api-key"])
    assert bad.func(bad) == 2  # tenants without keys


def _raw_replica(handle: Any) -> tuple[str, Any]:
    """A raw HTTP server on a free loopback port calling ``handle(conn)`` on a thread per
    accepted connection; returns its URL and its listening socket (close it to stop)."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}", srv


def _replica_that_dies_mid_stream() -> tuple[str, object]:
    """A raw HTTP replica: ``/health`` is 200; a POST gets a 200 event stream with one event,
    then the connection is cut (the replica crashed mid-answer)."""

    def handle(conn: Any) -> None:
        with conn:
            head = conn.recv(65536).decode(errors="replace")
            if head.startswith("GET"):
                body = b'{"status":"ok"}'
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                    + str(len(body)).encode()
                    + b"\r\n\r\n"
                    + body
                )
                return
            event = b'data: {"choices":[{"text":"Hel"}]}\n\n'
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
                + f"{len(event):x}\r\n".encode()
                + event
                + b"\r\n"
            )
            time.sleep(0.2)  # then the crash: no terminating chunk

    return _raw_replica(handle)


def test_a_stream_cut_by_a_dying_replica_ends_with_an_error_event() -> None:
    """The client learns that the answer broke (an error event, then [DONE]) instead of a
    stream that simply stops."""
    url, srv = _replica_that_dies_mid_stream()
    rt = router([url], health_interval=3600)
    try:
        with httpx.stream(
            "POST",
            rt.base_url + "/v1/completions",
            json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 8, "stream": True},
            timeout=30,
        ) as s:
            assert s.status_code == 200
            lines = [x for x in s.iter_lines() if x.startswith("data: ")]
        assert lines[0] == 'data: {"choices":[{"text":"Hel"}]}'
        assert '"code":"replica_failed"' in lines[-2].replace(" ", ""), lines
        assert lines[-1] == "data: [DONE]"
    finally:
        rt.stop()
        srv.close()


def _replica_that_closes_kept_alive_connections() -> tuple[str, object, list[int]]:
    """A raw HTTP replica that answers the first request of each connection (keep-alive) and
    closes the connection on the second without answering: the race of a replica's keep-alive
    timeout against a request sent on the pooled connection. Returns its URL, its socket and
    the count of POSTs it answered."""
    answered = [0]

    def handle(conn: Any) -> None:
        with conn:
            head = conn.recv(65536).decode(errors="replace")
            if head.startswith("POST"):
                answered[0] += 1
                body = b'{"choices":[{"text":"ok","index":0}]}'
            else:
                body = b'{"status":"ok"}'
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: keep-alive\r\n"
                b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )
            conn.recv(65536)  # the next request on this connection: closed unanswered

    url, srv = _raw_replica(handle)
    return url, srv, answered


def test_a_kept_alive_connection_closed_by_the_replica_is_retried_not_taken_for_death() -> None:
    """Every second request of a connection meets a replica that closed it: the router sends
    it once more on a fresh connection (completions and its own /v1/models calls alike), so
    every request is answered, and the replica stays
    healthy with its prefix tree (before, one such error marked it dead and cleared its tree)."""
    url, srv, answered = _replica_that_closes_kept_alive_connections()
    rt = router([url], health_interval=3600)
    try:
        for n in range(4):
            r = httpx.post(
                rt.base_url + "/v1/completions",
                json={"model": "tiny-llama", "prompt": system(1) + f"q{n}", "max_tokens": 1},
                timeout=30,
            )
            assert r.status_code == 200, r.text
        assert answered[0] == 4
        for _ in range(2):  # the router's own calls to the replica take the same retry
            assert httpx.get(rt.base_url + "/v1/models", timeout=30).status_code == 200
        (state,) = httpx.get(rt.base_url + "/health").json()["replicas"]
        assert state["healthy"] and state["errors"] == 0
        assert rt.app.state.replicas[0].index.size > 0  # the tree kept what the answers taught
    finally:
        rt.stop()
        srv.close()
