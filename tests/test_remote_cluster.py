"""The remote KV tier on a real local Redis Cluster (three masters, no mocks): keys spread over
the shards, two engines share a prompt from the first request, a shard killed mid-run makes its
pages miss (requests keep working) and its pages come back when it returns, the MAC and the
password apply as on one server."""

from __future__ import annotations

import logging

import pytest
import redis_cluster_fixture
import torch
from redis_cluster_fixture import LocalCluster
from redis_fixture import free_port
from test_remote_tier import _wait, make_engine
from test_tiers import _tiny, greedy

from radixkv.cache.disk_store import HEADER, chain_hashes
from radixkv.cache.remote_conn import parse_remote_url
from radixkv.cache.remote_store import PASSWORD_ENV, RemoteStore

P = 16
redis_cluster = redis_cluster_fixture.redis_cluster  # a real 3-master cluster per module


@pytest.fixture(scope="module")
def tiny():
    return _tiny(1234, "tiny-remote-cluster")


def prompt(seed: int, n: int = 196) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (n,), generator=g).tolist()


def run(engine, ids: list[int]):
    (out,) = engine.generate([ids], greedy(6))
    engine.check_integrity()
    return out


def flushall(cluster: LocalCluster) -> None:
    for port in cluster.procs:
        cluster.client(port).flushall()


def per_shard(cluster: LocalCluster) -> dict[int, int]:
    return {port: cluster.client(port).dbsize() for port in cluster.procs}


@pytest.fixture(scope="module")
def golden(tiny):
    """Greedy outputs of an engine without any tier."""
    from radixkv import Engine

    eng = Engine(tiny, page_size=P, dtype="float32", kv_cache_tokens=4096)
    return {s: run(eng, prompt(s)).outputs[0].token_ids for s in (1, 2, 3, 4)}


def test_two_engines_share_through_the_cluster(tiny, golden, redis_cluster) -> None:
    """Defaults only: A's prompt pages spread over the masters as A caches them, and B's first
    request loads every whole page of it from the cluster."""
    flushall(redis_cluster)
    a = make_engine(tiny, redis_cluster.url)
    b = make_engine(tiny, redis_cluster.url)
    ids = prompt(1)
    out_a = run(a, ids)
    a.tiers.sync()
    counts = per_shard(redis_cluster)
    whole = len(ids) // P * P
    assert sum(counts.values()) >= whole // P
    assert sum(1 for n in counts.values() if n) > 1, counts  # spread over the shards
    out_b = run(b, ids)
    assert out_b.cached_tokens_by_tier["remote"] >= whole
    assert out_b.outputs[0].token_ids == out_a.outputs[0].token_ids == golden[1]
    rs = b.stats()["tiers"]["remote"]
    assert rs["shards"] == 3 and rs["shards_down"] == 0 and rs["corrupt_values"] == 0
    a.check_integrity()
    b.check_integrity()
    a.tiers.close()
    b.tiers.close()


def test_a_shard_killed_mid_run_misses_then_comes_back(tiny, golden, redis_cluster, caplog) -> None:
    flushall(redis_cluster)
    a = make_engine(tiny, redis_cluster.url)
    b = make_engine(tiny, redis_cluster.url)
    for e in (a, b):
        e.tiers.remote.retry_max = 0.5  # probe at least twice a second while a shard is down
    ids = prompt(2)
    run(a, ids)
    a.tiers.sync()
    # the victim: the master whose first page of the prompt comes latest (at least page 2, so
    # the pages before it are worth loading); B must load exactly the pages before it
    remote = a.tiers.remote
    keys = chain_hashes(a.tiers.fingerprint, ids, P, None)
    where = remote._shards.locate([remote.namespace + k for k in keys])
    first = {s: where.index(s) for s in set(where)}
    victim = max(first, key=first.__getitem__)
    assert first[victim] >= 2, first
    port = int(victim.rpartition(":")[2])
    redis_cluster.kill(port)
    try:
        with caplog.at_level(logging.WARNING, logger="radixkv.cache.remote_store"):
            out = run(b, ids)  # succeeds: the victim's pages miss, the rest is recomputed
            assert out.cached_tokens_by_tier["remote"] == first[victim] * P
            assert out.outputs[0].token_ids == golden[2]
            for s in (3, 4):  # both replicas keep serving (A writes to the live shards)
                assert run(a, prompt(s)).outputs[0].token_ids == golden[s]
                a.tiers.sync()
        rs = b.stats()["tiers"]["remote"]
        assert rs["available"] and rs["down_shards"] == [victim], rs
        assert rs["misses_down"] >= 1 and rs["went_down"] == 1
        sa = a.stats()["tiers"]["remote"]
        assert sa["went_down"] == 1 and sa["writes_skipped_down"] + sa["writes_failed"] > 0
        down = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(down) <= 2 and all(victim in r.getMessage() for r in down)  # once per store
        a.check_integrity()
        b.check_integrity()
    finally:
        redis_cluster.restart(port)  # same port, same nodes.conf: it owns its slots again
    for e in (a, b):
        assert _wait(lambda e=e: e.tiers.remote.stats()["shards_down"] == 0, 15.0), e.stats()[
            "tiers"
        ]
        assert e.tiers.remote.stats()["came_back"] == 1
    fresh = prompt(5)  # the restarted shard is empty: a new prompt shows its pages come back
    run(a, fresh)
    a.tiers.sync()
    assert per_shard(redis_cluster)[port] > 0
    c = make_engine(tiny, redis_cluster.url)
    out = run(c, fresh)
    assert out.cached_tokens_by_tier["remote"] >= len(fresh) // P * P
    a.check_integrity()
    c.check_integrity()
    for e in (a, b, c):
        e.tiers.close()


def test_cluster_store_alone_spreads_batches_and_checks_values(redis_cluster) -> None:
    """The store by itself on the cluster: writes and reads split by shard, a miss ends the
    run, a damaged value is refused and deleted, a foreign secret reads nothing."""
    flushall(redis_cluster)
    fp = b"\x03" * 32
    store = RemoteStore(redis_cluster.url, fp, batch_pages=4, mac_key=b"s" * 32)
    keys = chain_hashes(fp, list(range(240)), 8)  # 30 pages
    for i, k in enumerate(keys[:24]):
        assert store.put(k, bytes([i]) * 64)
    store.sync()
    assert sum(1 for n in per_shard(redis_cluster).values() if n) > 1
    assert [g[0] for g in store.get_prefix(keys, 64)] == list(range(24))
    assert store.stats()["misses"] == 1 and store.stats()["misses_down"] == 0
    rkey5 = store.namespace + keys[5]
    (owner,) = store._shards.locate([rkey5])  # the master of its slot
    r = redis_cluster.client(int(owner.rpartition(":")[2]))
    value = bytearray(r.get(rkey5))
    value[HEADER.size + 3] ^= 0xFF
    r.set(rkey5, bytes(value))
    assert len(store.get_prefix(keys, 64)) == 5
    assert store.stats()["corrupt_checksum"] == 1
    assert r.get(rkey5) is None  # deleted
    other = RemoteStore(redis_cluster.url, fp, mac_key=b"o" * 32, background=False)
    assert other.get_prefix(keys, 64) == []
    assert other.stats()["corrupt_mac"] == 1
    for s in (store, other):
        s.check_integrity()
        s.close()
    with pytest.raises(ValueError, match="database 0"):
        parse_remote_url(redis_cluster.url + "/3")
    assert parse_remote_url("rediss+cluster://h:1") == "rediss+cluster://h:1"


def test_a_cluster_that_is_down_at_start_is_a_miss_not_an_error(tiny, golden) -> None:
    """No node answers: the engine starts, serves, and the tier is off (probes keep trying)."""
    url = f"redis+cluster://127.0.0.1:{free_port()}"
    eng = make_engine(tiny, url)
    rs = eng.stats()["tiers"]["remote"]
    assert not rs["available"] and rs["went_down"] == 1
    assert run(eng, prompt(1)).outputs[0].token_ids == golden[1]
    assert eng.stats()["tiers"]["remote"]["lookups"] == 0
    eng.check_integrity()
    eng.tiers.close()


def test_password_from_the_environment(monkeypatch) -> None:
    """A cluster with ``requirepass``: the password comes from ``$RADIXKV_REDIS_PASSWORD`` (or
    the URL); without it the store is down, not broken."""
    if redis_cluster_fixture.shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (bash setup.sh installs it)")
    cluster = LocalCluster(password="cluster-secret-0123")
    try:
        cluster.start()
        fp = b"\x04" * 32
        keys = chain_hashes(fp, list(range(64)), 8)
        monkeypatch.delenv(PASSWORD_ENV, raising=False)
        refused = RemoteStore(cluster.url, fp, mac_key=b"s" * 32, background=False)
        assert not refused.available and refused.get_prefix(keys, 64) == []
        refused.close()
        monkeypatch.setenv(PASSWORD_ENV, "cluster-secret-0123")
        store = RemoteStore(cluster.url, fp, mac_key=b"s" * 32, background=False)
        for i, k in enumerate(keys):
            store.put(k, bytes([i]) * 64)
        assert len(store.get_prefix(keys, 64)) == len(keys)
        assert "cluster-secret" not in repr(store.stats())
        store.close()
        monkeypatch.delenv(PASSWORD_ENV)
        in_url = cluster.url.replace("://", "://:cluster-secret-0123@")
        store = RemoteStore(in_url, fp, mac_key=b"s" * 32, background=False)
        assert len(store.get_prefix(keys, 64)) == len(keys)
        assert "cluster-secret" not in repr(store.stats()) + repr(store)
        store.check_integrity()
        store.close()
    finally:
        cluster.stop()
