"""Partial load-back (issue 13): a host/disk hit that does not fit whole in the device pages left
by running requests loads its longest prefix that fits; the rest is recomputed. Bookkeeping-only
tiers (no model) for the exact page accounting, the tiny engine for outputs."""

from __future__ import annotations

import pytest

from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.disk_store import DiskStore
from radixkv.cache.host_pool import HostPool
from radixkv.cache.radix_tree import RadixTree
from radixkv.cache.tiers import TieredCache

P = 2


def _tiers(device_pages: int, host_pages: int, disk: bool = False, min_load: int = 0):
    alloc = BlockAllocator(device_pages, P)
    tree = RadixTree(alloc, P)
    host = HostPool(host_pages, P) if host_pages else None
    store = DiskStore(None, 10**6, b"\0" * 32) if disk else None
    return alloc, tree, TieredCache(tree, alloc, None, host, store, min_load_tokens=min_load)


def _put(tree: RadixTree, alloc: BlockAllocator, tokens: list[int]) -> None:
    m = tree.match_prefix(tokens)
    tree.lock(m.node)
    new = alloc.allocate(len(tokens) // P - len(m.pages))
    ret = tree.insert(tokens, m.pages + new)
    if ret // P > len(m.pages):
        alloc.free(new[: ret // P - len(m.pages)])
    tree.unlock(m.node)


def _check(tree: RadixTree, alloc: BlockAllocator, tiers: TieredCache) -> None:
    alloc.check_integrity()
    tree.check_integrity()
    tiers.check_integrity()


@pytest.mark.parametrize("reserve", [0, 1])
def test_host_hit_larger_than_free_pages_loads_the_prefix_that_fits(reserve: int) -> None:
    alloc, tree, tiers = _tiers(device_pages=8, host_pages=16)
    a = list(range(10, 22))  # 12 tokens = 6 pages, in two nodes (split by a sibling)
    _put(tree, alloc, a)
    _put(tree, alloc, a[:6] + [99, 98])
    tree.evict(100)
    assert tree.total_size == 0 and tree.host_size == 14
    running = alloc.allocate(5)  # held by "running requests": 3 pages free, none evictable
    m = tree.match_prefix(a)
    assert m.num_tokens == 0 and m.host_tokens == 12
    tree.lock(m.node)
    loaded = tiers.load_prefix(a, None, m, reserve_pages=reserve)
    fit = 3 - reserve
    assert loaded.num_tokens == fit * P and loaded.by_tier["host"] == fit * P
    assert len(loaded.pages) == fit and alloc.num_free == reserve
    assert tiers.counters["partial_loads"] == 1
    assert tiers.counters["partial_pages_recomputed"] == 6 - fit
    _check(tree, alloc, tiers)
    # the loaded part is on both tiers now, the rest still on the host: nothing was lost
    tree.unlock(loaded.node)
    alloc.free(running)
    again = tree.match_prefix(a)
    assert again.num_tokens == fit * P and again.host_tokens == 12 - fit * P
    tree.lock(again.node)
    whole = tiers.load_prefix(a, None, again)
    assert whole.num_tokens == 12 and whole.by_tier == {
        "device": fit * P,
        "host": 12 - fit * P,
        "disk": 0,
    }
    tree.unlock(whole.node)
    _check(tree, alloc, tiers)


def test_disk_hit_partial_and_host_then_disk() -> None:
    alloc, tree, tiers = _tiers(device_pages=6, host_pages=0, disk=True)
    a = list(range(30, 42))  # 6 pages, written to disk on device eviction
    _put(tree, alloc, a)
    tree.evict(100)
    assert tree.total_size == 0 and tiers.disk is not None and tiers.disk.num_files == 6
    held = alloc.allocate(2)  # 4 free
    m = tree.match_prefix(a)
    tree.lock(m.node)
    loaded = tiers.load_prefix(a, None, m, reserve_pages=1)
    assert loaded.num_tokens == 3 * P and loaded.by_tier["disk"] == 3 * P
    assert tiers.counters["disk_load_pages"] == 3 and tiers.counters["partial_loads"] == 1
    _check(tree, alloc, tiers)
    tree.unlock(loaded.node)
    alloc.free(held)
    _check(tree, alloc, tiers)


def test_host_and_disk_cut_inside_the_disk_part() -> None:
    alloc, tree, tiers = _tiers(device_pages=6, host_pages=2, disk=True)
    a = list(range(50, 62))  # 6 pages: the host keeps 2 of them, the disk has all
    _put(tree, alloc, a[:4])
    _put(tree, alloc, a)
    tree.evict(100)  # LRU leaf [4:12] then [0:4]: host holds one node, the rest reaches disk
    tree.evict_host(100)  # everything to disk
    _put(tree, alloc, a[:4])  # [0:4] on the device again
    tree.evict(100)  # ... and to the host (2 pages)
    assert tree.host_size == 4
    held = alloc.allocate(2)  # 4 free: 2 host pages + 2 of the 4 disk pages fit
    m = tree.match_prefix(a)
    assert m.host_tokens == 4
    tree.lock(m.node)
    loaded = tiers.load_prefix(a, None, m)
    assert loaded.by_tier == {"device": 0, "host": 4, "disk": 4} and loaded.num_tokens == 8
    assert tiers.counters["partial_pages_recomputed"] == 2
    _check(tree, alloc, tiers)
    tree.unlock(loaded.node)
    alloc.free(held)
    _check(tree, alloc, tiers)


def test_too_small_to_be_worth_it_is_skipped() -> None:
    alloc, tree, tiers = _tiers(device_pages=8, host_pages=16, min_load=4 * P)
    a = list(range(10, 22))
    _put(tree, alloc, a)
    tree.evict(100)
    held = alloc.allocate(5)  # 3 pages fit, below the 4-page threshold
    m = tree.match_prefix(a)
    tree.lock(m.node)
    loaded = tiers.load_prefix(a, None, m)
    assert loaded.num_tokens == 0 and tiers.counters["loads_skipped"] == 1
    assert tiers.counters["partial_loads"] == 0 and alloc.num_free == 3
    tree.unlock(loaded.node)
    alloc.free(held)
    _check(tree, alloc, tiers)


# ------------------------------------------------------------------------------ the engine
PE = 16  # engine page size


def _prompt(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def _engine(model, **knobs):
    from radixkv import Engine

    base = dict(page_size=PE, dtype="float32", kv_cache_tokens=256, host_cache_tokens=2048)
    base.update(knobs)
    return Engine(model, **base)


def _greedy(n: int = 4):
    from radixkv import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _oracle(model, prompts: list[list[int]]) -> list[list[int]]:
    roomy = _engine(model, kv_cache_tokens=4096, host_cache_tokens=0)
    return [o.token_ids for o in roomy.generate(prompts, _greedy())]


def _run_beside_a_long_request(model, wait_steps: int, monkeypatch) -> tuple[dict, dict, object]:
    """``a`` (161 tokens) is served, pushed to the host by ``b``, then asked again while a
    100 + 60-token request runs on the 16-page device pool (7 to 10 pages)."""
    import radixkv.engine.scheduler as scheduler_mod

    monkeypatch.setattr(scheduler_mod, "LOAD_WAIT_STEPS", wait_steps)
    a, b, long = _prompt(161, 3), _prompt(161, 4), _prompt(100, 5)
    engine = _engine(model)
    engine.generate([a], _greedy())
    engine.generate([b], _greedy())  # a goes to the host
    engine.add_request("long", long, _greedy(60))
    outs: dict[str, list[int]] = {"long": [], "a": []}
    cached: dict = {}
    for step in range(10_000):
        if step == 1:
            engine.add_request("a", a, _greedy())
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
            if o.request_id == "a":
                cached = dict(o.cached_tokens_by_tier)
        engine.check_integrity()
        if step > 1 and not engine.has_unfinished():
            break
    roomy = _engine(model, kv_cache_tokens=4096, host_cache_tokens=0)
    want = {
        "long": roomy.generate([long], _greedy(60))[0].token_ids,
        "a": roomy.generate([a], _greedy())[0].token_ids,
    }
    assert outs == want
    return cached, engine.stats()["tiers"], engine


def test_engine_waits_for_running_requests_then_loads_whole(tiny_model, monkeypatch) -> None:
    """A host hit that does not fit beside a running request waits for it (instead of
    recomputing) and is then loaded whole."""
    cached, tiers, engine = _run_beside_a_long_request(tiny_model, 64, monkeypatch)
    assert engine.scheduler.num_load_waits > 0 and tiers["loads_waiting"] > 0
    assert cached["host"] == 160 and tiers["partial_loads"] == 0, (cached, tiers)


def test_engine_partial_load_beside_a_running_request(tiny_model, monkeypatch) -> None:
    """Without waiting, the same hit is loaded as far as it fits beside the running request and
    the rest recomputed; the outputs do not change."""
    cached, tiers, engine = _run_beside_a_long_request(tiny_model, 0, monkeypatch)
    assert engine.scheduler.num_load_waits == 0
    assert tiers["partial_loads"] >= 1 and tiers["partial_pages_recomputed"] >= 1, tiers
    assert 0 < cached["host"] < 160, cached
