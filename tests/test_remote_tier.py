"""The remote KV tier on a real ``redis-server`` (no mocks): two engines share prefixes through it,
bad values are detected and recomputed, salts never meet, and a Redis that goes away turns the
tier off (requests keep working) until it comes back."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import redis_fixture
import torch
from redis_fixture import RedisServer
from test_tiers import _tiny, greedy

from radixkv.cache.disk_store import HEADER, chain_hashes
from radixkv.cache.remote_store import RemoteStore

P = 16
redis_server = redis_fixture.redis_server  # a real redis-server per module


@pytest.fixture(scope="module")
def tiny():
    return _tiny(1234, "tiny-remote")


def make_engine(model, url: str | None, **knobs):
    from radixkv import Engine

    knobs.setdefault("page_size", P)
    knobs.setdefault("dtype", "float32")
    knobs.setdefault("kv_cache_tokens", 4096)
    return Engine(model, remote_cache_url=url, **knobs)


def prompt(seed: int, n: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (n,), generator=g).tolist()


def run(engine, ids: list[int], salt: str | None = None):
    (out,) = engine.generate([ids], greedy(6), salt=salt)
    engine.check_integrity()
    return out


def flushdb(server: RedisServer) -> None:
    server.client().flushdb()


@pytest.fixture(scope="module")
def golden(tiny):
    """Greedy outputs of an engine without any tier."""
    from radixkv import Engine

    eng = Engine(tiny, page_size=P, dtype="float32", kv_cache_tokens=4096)
    return {s: run(eng, prompt(s)).outputs[0].token_ids for s in (1, 2, 3, 4, 5)}


def test_replica_b_serves_a_prompt_replica_a_computed(tiny, golden, redis_server) -> None:
    flushdb(redis_server)
    a = make_engine(tiny, redis_server.url, host_write_policy="write_through")
    b = make_engine(tiny, redis_server.url)
    ids = prompt(1)
    out_a = run(a, ids)
    assert out_a.cached_tokens_by_tier.get("remote", 0) == 0
    a.tiers.sync()
    assert redis_server.client().dbsize() >= len(ids) // P - 1
    out_b = run(b, ids)
    assert out_b.cached_tokens_by_tier["remote"] >= len(ids) - 2 * P
    assert out_b.outputs[0].token_ids == out_a.outputs[0].token_ids == golden[1]
    rs = b.stats()["tiers"]["remote"]
    assert rs["hits"] >= len(ids) // P - 2 and rs["corrupt_values"] == 0
    assert b.stats()["cached_tokens_by_tier"]["remote"] == out_b.cached_tokens_by_tier["remote"]
    from radixkv.server.metrics import ServerMetrics

    metrics = ServerMetrics()
    metrics.record_prompt(len(ids), out_b.cached_tokens, out_b.cached_tokens_by_tier)
    metrics.update_from_stats(b.stats())
    text = metrics.render().decode()
    remote_hits = out_b.cached_tokens_by_tier["remote"]
    assert f'radixkv_cached_tokens_by_source_total{{source="remote"}} {remote_hits:.1f}' in text
    assert "radixkv_remote_cache_up 1.0" in text
    # the pages loaded from Redis now sit on B's device: the next request hits there
    again = run(b, ids)
    assert again.cached_tokens_by_tier["device"] >= len(ids) - P
    assert again.outputs[0].token_ids == golden[1]
    a.tiers.close()
    b.tiers.close()


def test_defaults_share_a_prompt_from_the_first_request(tiny, golden, redis_server) -> None:
    """Issue 26: two replicas with nothing but ``remote_cache_url`` (remote write-through, the
    default): B finds every whole page of the 196-token prompt A has just computed."""
    flushdb(redis_server)
    a = make_engine(tiny, redis_server.url)
    b = make_engine(tiny, redis_server.url)
    assert a.tiers.remote_write_policy == "write_through"
    ids = prompt(1, 196)
    out_a = run(a, ids)
    a.tiers.sync()  # the writer thread has sent what the step queued
    whole = len(ids) // P * P  # 192: the last, partial page is always recomputed
    assert redis_server.client().dbsize() >= whole // P
    out_b = run(b, ids)
    assert out_b.cached_tokens >= whole
    assert out_b.cached_tokens_by_tier["remote"] >= whole
    assert out_b.outputs[0].token_ids == out_a.outputs[0].token_ids
    b.tiers.sync()
    assert b.stats()["tiers"]["remote"]["writes"] == 0  # what B read is not sent back
    a.check_integrity()
    b.check_integrity()
    a.tiers.close()
    b.tiers.close()


def test_write_through_never_sends_a_page_again_on_eviction(tiny, golden, redis_server) -> None:
    """A page written through when cached is not written back when it leaves the device (even
    once the store's memory of recent writes has expired: the policy, not the TTL, skips it)."""
    flushdb(redis_server)
    a = make_engine(tiny, redis_server.url, kv_cache_tokens=17 * P)  # room for one prompt
    remote = a.tiers.remote
    remote.recent_ttl = 0.0
    run(a, prompt(2))
    a.tiers.sync()
    first = remote.stats()["writes"]
    assert first >= len(prompt(2)) // P - 1
    run(a, prompt(3))  # evicts every page of prompt 2 (and writes prompt 3's through)
    a.tiers.sync()
    assert remote.stats()["writes"] - first <= len(prompt(3)) // P
    assert redis_server.client().dbsize() == remote.stats()["writes"]
    b = make_engine(tiny, redis_server.url)  # the evicted pages are in Redis all the same
    out = run(b, prompt(2))
    assert out.cached_tokens_by_tier["remote"] >= len(prompt(2)) - P
    assert out.outputs[0].token_ids == golden[2]
    a.check_integrity()
    a.tiers.close()
    b.tiers.close()


def test_write_back_sends_pages_when_they_leave_the_device(tiny, golden, redis_server) -> None:
    flushdb(redis_server)
    # a device pool of 17 pages: the second 256-token prompt evicts all of the first one's
    a = make_engine(
        tiny, redis_server.url, kv_cache_tokens=17 * P, remote_write_policy="write_back"
    )
    run(a, prompt(2))
    a.tiers.sync()
    assert redis_server.client().dbsize() == 0  # write-back: nothing left the device yet
    run(a, prompt(3))
    a.tiers.sync()
    assert redis_server.client().dbsize() > 0
    b = make_engine(tiny, redis_server.url)
    out = run(b, prompt(2))
    assert out.cached_tokens_by_tier["remote"] > 0
    assert out.outputs[0].token_ids == golden[2]
    a.tiers.close()
    b.tiers.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap", "fingerprint"])
def test_bad_values_are_detected_and_recomputed(tiny, golden, redis_server, damage) -> None:
    flushdb(redis_server)
    a = make_engine(tiny, redis_server.url, host_write_policy="write_through")
    ids = prompt(4)
    run(a, ids)
    a.tiers.sync()
    fp = a.tiers.fingerprint
    keys = [a.tiers.remote.namespace + h for h in chain_hashes(fp, ids, P, None)]
    r = redis_server.client()
    bad = 5  # damage page 5: pages 0-4 still load, the rest is recomputed
    value = r.get(keys[bad])
    assert value is not None
    if damage == "flip":
        body = bytearray(value)
        body[HEADER.size + 100] ^= 0xFF
        r.set(keys[bad], bytes(body))
    elif damage == "truncate":
        r.set(keys[bad], value[: len(value) // 2])
    elif damage == "swap":  # a valid value of another page under this key
        r.set(keys[bad], r.get(keys[bad + 1]))
    else:  # the same page written by another model
        forged = bytearray(value)
        forged[12:44] = b"\x07" * 32  # the header's fingerprint field
        r.set(keys[bad], bytes(forged))
    b = make_engine(tiny, redis_server.url)
    out = run(b, ids)
    assert out.cached_tokens_by_tier["remote"] == bad * P
    assert out.outputs[0].token_ids == golden[4]
    rs = b.stats()["tiers"]["remote"]
    reason = {"flip": "checksum", "truncate": "truncated", "swap": "key"}.get(damage, damage)
    assert rs["corrupt_values"] == 1 and rs[f"corrupt_{reason}"] == 1, rs
    _repaired(b, keys[bad], ids, bad)  # deleted, and B's recomputed page written through
    b.check_integrity()
    a.tiers.close()
    b.tiers.close()


def _repaired(engine, rkey: bytes, ids: list[int], page: int) -> None:
    """The bad value under ``rkey`` (page ``page`` of ``ids``) is gone: ``engine`` deleted it,
    recomputed the page and (write-through, the default) sent its own, which verifies."""
    from radixkv.cache.kv_mac import verify
    from radixkv.cache.remote_store import REMOTE_MAGIC

    engine.tiers.sync()
    remote = engine.tiers.remote
    value = _client_of(remote).get(rkey)
    key = chain_hashes(engine.tiers.fingerprint, ids, P, None)[page]
    assert value is not None
    size = engine.tiers.kv_pool.bytes_per_page
    assert verify(value, REMOTE_MAGIC, remote.fingerprint, key, remote.mac_key, size) is None


def _client_of(remote: RemoteStore):
    import redis

    return redis.Redis.from_url(remote.url)


def test_salts_never_hit_each_other(tiny, golden, redis_server) -> None:
    flushdb(redis_server)
    a = make_engine(tiny, redis_server.url, host_write_policy="write_through")
    ids = prompt(5)
    run(a, ids, salt="tenant-a")
    a.tiers.sync()
    n_keys = redis_server.client().dbsize()
    b = make_engine(tiny, redis_server.url, host_write_policy="write_through")
    other = run(b, ids, salt="tenant-b")
    assert other.cached_tokens_by_tier.get("remote", 0) == 0
    assert other.cached_tokens == 0
    unsalted = make_engine(tiny, redis_server.url)
    assert run(unsalted, ids).cached_tokens == 0
    b.tiers.sync()
    unsalted.tiers.sync()
    # disjoint key sets per salt: tenant-a, tenant-b and the unsalted one (write-through)
    assert redis_server.client().dbsize() == 3 * n_keys
    c = make_engine(tiny, redis_server.url)
    same = run(c, ids, salt="tenant-a")
    assert same.cached_tokens_by_tier["remote"] >= len(ids) - 2 * P
    assert same.outputs[0].token_ids == other.outputs[0].token_ids == golden[5]
    for e in (a, b, unsalted, c):
        e.tiers.close()


def _wait(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_redis_killed_mid_run_then_back(tiny, golden, caplog) -> None:
    server = RedisServer()
    server.start()
    try:
        a = make_engine(tiny, server.url, host_write_policy="write_through")
        remote = a.tiers.remote
        remote.retry_max = 1.0  # probe at least once a second while down (default 10 s)
        assert run(a, prompt(1)).outputs[0].token_ids == golden[1]
        a.tiers.sync()
        server.stop()  # Redis goes away mid-run
        with caplog.at_level(logging.WARNING, logger="radixkv.cache.remote_store"):
            for s in (2, 3, 4):  # requests keep working, the tier turns itself off
                assert run(a, prompt(s)).outputs[0].token_ids == golden[s]
                a.tiers.sync()
        assert not remote.available
        warnings = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
        st = remote.stats()
        assert st["went_down"] == 1 and st["writes_skipped_down"] + st["writes_failed"] > 0
        a.check_integrity()
        server.start()  # Redis is back (empty): the writer's probe turns the tier on again
        assert _wait(lambda: remote.available), remote.stats()
        assert remote.stats()["came_back"] == 1
        run(a, prompt(5))
        a.tiers.sync()
        b = make_engine(tiny, server.url)
        out = run(b, prompt(5))
        assert out.cached_tokens_by_tier["remote"] >= len(prompt(5)) - 2 * P
        assert out.outputs[0].token_ids == golden[5]
        a.tiers.close()
        b.tiers.close()
    finally:
        server.stop()


def test_remote_store_alone_batches_and_bookkeeping(redis_server) -> None:
    """The store by itself: pipelined writes, MGET in batches, a miss ends the run."""
    flushdb(redis_server)
    fp = b"\x01" * 32
    store = RemoteStore(redis_server.url, fp, batch_pages=4)
    keys = chain_hashes(fp, list(range(200)), 8)  # 25 pages
    for i, k in enumerate(keys[:20]):
        assert store.put(k, bytes([i]) * 64)
    store.sync()
    assert not store.put(keys[0], b"x" * 64)  # written recently: skipped
    got = store.get_prefix(keys, 64)
    assert [g[0] for g in got] == list(range(20))
    assert store.get_prefix(keys, 32) == []  # wrong page size: truncated, deleted
    assert store.stats()["corrupt_truncated"] == 1
    other = RemoteStore(redis_server.url, b"\x02" * 32)
    assert other.get_prefix(keys[1:], 64) == []  # another fingerprint never reads them
    assert other.stats()["corrupt_fingerprint"] == 1
    store.check_integrity()
    other.check_integrity()
    store.close()
    other.close()
    with pytest.raises(ValueError, match="redis://"):
        RemoteStore("http://127.0.0.1:1", fp)


def test_a_slow_redis_never_blocks_the_caller(redis_server) -> None:
    """The writer queue bounds what the engine hands over: with the writer stuck, the pages
    beyond its room are neither snapshotted (``to_send``) nor waited for (``put``): they are
    counted as dropped, and everything queued is sent once the writer moves again."""
    flushdb(redis_server)
    fp = b"\x05" * 32
    store = RemoteStore(redis_server.url, fp, max_pending=4, batch_pages=1)
    keys = chain_hashes(fp, list(range(80)), 8)  # 10 pages
    gate = threading.Event()
    assert store.put(keys[0], lambda: gate.wait(10) and bytes([0]) * 64)  # the writer waits
    assert _wait(lambda: store._queue.qsize() == 0)  # ... holding page 0
    assert store.to_send(keys[1:]) == [0, 1, 2, 3]  # room for four: no copy of the others
    assert store.stats()["writes_dropped"] == 5
    t0 = time.monotonic()
    assert all(store.put(k, bytes([i + 1]) * 64) for i, k in enumerate(keys[1:5]))
    assert not store.put(keys[5], bytes([5]) * 64)  # queue full: dropped, not waited for
    assert time.monotonic() - t0 < 1.0
    assert store.stats()["writes_dropped"] == 6
    gate.set()
    store.sync()
    assert [g[0] for g in store.get_prefix(keys, 64)] == [0, 1, 2, 3, 4]
    store.check_integrity()
    store.close()


def test_simulator_counts_remote_hits() -> None:
    """The simulator's remote tier: prefixes evicted from a small device come back from it."""
    from radixkv.sim.simulator import simulate

    g = torch.Generator().manual_seed(0)
    systems = [torch.randint(0, 999, (64,), generator=g).tolist() for _ in range(8)]
    trace = [
        {"input_ids": systems[i % 8] + torch.randint(0, 999, (8,), generator=g).tolist()}
        for i in range(64)
    ]
    alone = simulate(trace, 200, 4)
    res = simulate(trace, 200, 4, remote_capacity_tokens=4000)
    assert alone["cached_tokens"] == 0  # 8 prompts cycling through a 200-token device
    assert res["cached_tokens_by_tier"]["remote"] == res["cached_tokens"] > 0
    assert res["cached_tokens"] == pytest.approx(res["optimal_hit_rate"] * res["prompt_tokens"])
    small = simulate(trace, 200, 4, remote_capacity_tokens=200)  # LRU too small to help
    assert small["cached_tokens_by_tier"]["remote"] < res["cached_tokens_by_tier"]["remote"]


def test_bad_url_is_refused(tiny) -> None:
    with pytest.raises(ValueError, match="remote_cache_url"):
        make_engine(tiny, "localhost:6379")


def test_serve_flag_sets_the_knob() -> None:
    from radixkv.cli import build_parser
    from radixkv.server.cli import engine_kwargs

    args = build_parser().parse_args(["serve", "--remote-cache", "redis://127.0.0.1:1/0"])
    assert engine_kwargs(args)["remote_cache_url"] == "redis://127.0.0.1:1/0"
    assert "remote_write_policy" not in engine_kwargs(args)  # the engine's default
    args = build_parser().parse_args(["serve", "--remote-write-policy", "write_back"])
    assert engine_kwargs(args)["remote_write_policy"] == "write_back"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--remote-write-policy", "sometimes"])
    cluster = "redis+cluster://127.0.0.1:7000"
    args = build_parser().parse_args(["serve", "--remote-cache", cluster])
    assert engine_kwargs(args)["remote_cache_url"] == cluster


def test_pages_are_sent_again_after_a_flush(tiny, golden, redis_server) -> None:
    """The store's memory of what it sent never stands in for Redis: after Redis lost the pages
    and the engine flushed its cache, recomputed pages are sent again."""
    flushdb(redis_server)
    a = make_engine(tiny, redis_server.url, host_write_policy="write_through")
    ids = prompt(3)
    run(a, ids)
    a.tiers.sync()
    assert redis_server.client().dbsize() > 0
    flushdb(redis_server)  # Redis dropped them (maxmemory, restart, FLUSHDB)
    assert a.flush_cache()
    run(a, ids)
    a.tiers.sync()
    b = make_engine(tiny, redis_server.url)
    out = run(b, ids)
    assert out.cached_tokens_by_tier["remote"] >= len(ids) - 2 * P
    assert out.outputs[0].token_ids == golden[3]
    a.tiers.close()
    b.tiers.close()


def _key_file(path, secret: bytes):
    path.write_bytes(secret + b"\n")
    path.chmod(0o600)
    return str(path)


def test_a_planted_redis_value_is_a_miss_unless_signed_with_the_shared_secret(
    tiny, golden, redis_server, tmp_path
) -> None:
    """Whoever can write to Redis and knows the model and the tokens can compute a page's key;
    without the replicas' secret the value it plants is refused (``corrupt_mac``), deleted and
    recomputed, while values written by a replica with the shared secret are hits."""
    from radixkv.cache.kv_mac import seal
    from radixkv.cache.remote_store import REMOTE_MAGIC

    flushdb(redis_server)
    shared = _key_file(tmp_path / "shared.key", b"replicas-shared-secret-0123456789")
    a = make_engine(
        tiny, redis_server.url, host_write_policy="write_through", kv_mac_key_file=shared
    )
    ids = prompt(4)
    run(a, ids)
    a.tiers.sync()
    # the attacker: the key the engine would use, and real KV of the wrong page (page 6 of the
    # prompt) as the payload, with a well-formed header and crc, signed with its own guess
    fp, ns = a.tiers.fingerprint, a.tiers.remote.namespace
    keys = chain_hashes(fp, ids, P, None)
    r = redis_server.client()
    bad = 5
    wrong = r.get(ns + keys[bad + 1])[HEADER.size :]
    guess = b"the-attackers-guess-0123456789"
    r.set(ns + keys[bad], seal(REMOTE_MAGIC, fp, keys[bad], wrong, guess) + wrong)
    b = make_engine(tiny, redis_server.url, kv_mac_key_file=shared)
    out = run(b, ids)
    assert out.cached_tokens_by_tier["remote"] == bad * P  # pages 0-4 are hits, 5 is refused
    assert out.outputs[0].token_ids == golden[4]
    rs = b.stats()["tiers"]["remote"]
    assert rs["corrupt_mac"] == 1 and rs["corrupt_values"] == 1, rs
    _repaired(b, ns + keys[bad], ids, bad)  # deleted; B's own page written in its place
    # the same plant signed with the shared secret is used: the MAC is what refused it
    secret = a.tiers.remote.mac_key
    r.set(ns + keys[bad], seal(REMOTE_MAGIC, fp, keys[bad], wrong, secret) + wrong)
    c = make_engine(tiny, redis_server.url, kv_mac_key_file=shared)
    assert run(c, ids).cached_tokens_by_tier["remote"] > bad * P
    # a replica with another secret shares nothing, and still answers right
    other = _key_file(tmp_path / "other.key", b"another-clusters-secret-987654321")
    d = make_engine(tiny, redis_server.url, kv_mac_key_file=other)
    out_d = run(d, ids)
    assert out_d.cached_tokens_by_tier.get("remote", 0) == 0
    assert out_d.outputs[0].token_ids == golden[4]
    assert d.stats()["tiers"]["remote"]["corrupt_mac"] == 1
    for e in (a, b, c, d):
        e.tiers.close()


def test_without_a_shared_secret_the_remote_tier_warns(redis_server, monkeypatch, caplog) -> None:
    """No key file, no environment secret, no disk tier: a per-process key and a warning; the
    environment's secret is used when set."""
    from radixkv.cache import kv_mac

    monkeypatch.delenv(kv_mac.MAC_KEY_ENV, raising=False)
    monkeypatch.setattr(kv_mac, "_process_key", None)
    with caplog.at_level(logging.WARNING, logger="radixkv.cache.kv_mac"):
        s1 = RemoteStore(redis_server.url, b"\x01" * 32, background=False)
        s2 = RemoteStore(redis_server.url, b"\x01" * 32, background=False)
    assert s1.mac_key == s2.mac_key  # one key per process
    assert sum("will not share Redis values" in m for m in caplog.messages) == 1
    monkeypatch.setenv(kv_mac.MAC_KEY_ENV, "from-the-environment-0123456789")
    s3 = RemoteStore(redis_server.url, b"\x01" * 32, background=False)
    assert s3.mac_key == b"from-the-environment-0123456789"
    for s in (s1, s2, s3):
        s.close()
