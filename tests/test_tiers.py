"""Offload tiers: host residency in the radix tree, host/disk tiers in the engine, restarts,
corrupt files, per-tier accounting (tiny random Llama; pure-Python parts need no model)."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest
import torch

from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.disk_store import DiskStore, chain_hashes
from radixkv.cache.host_pool import HostPool
from radixkv.cache.radix_tree import RadixTree
from radixkv.cache.tiers import TieredCache
from radixkv.sim.simulator import simulate

P = 16
SYS_LEN = 512


# ---------------------------------------------------------------------------- fixtures
class _Tok:
    """Minimal tokenizer: prompts are token id lists; decode prints ids."""

    eos_token_id = 1
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [3 + ord(c) % 240 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True, **_: object) -> str:
        return " ".join(str(i) for i in ids)


def _tiny(seed: int, name: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    from radixkv.model.loader import LoadedModel

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in pname:
                p.mul_(3.0)
    return LoadedModel(hf_model=model, tokenizer=_Tok(), config=config, name=name)


@pytest.fixture(scope="module")
def tiny():
    return _tiny(1234, "tiny-tiers")


@pytest.fixture(scope="module")
def tiny_other():
    """Same shapes, other weights: another model fingerprint."""
    return _tiny(99, "tiny-tiers")


def make_engine(model, **knobs):
    from radixkv import Engine

    knobs.setdefault("page_size", P)
    knobs.setdefault("dtype", "float32")
    return Engine(model, **knobs)


def greedy(n: int = 4):
    from radixkv import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def system_prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (SYS_LEN,), generator=g).tolist() for _ in range(n)]


def cycle_workload(rounds: int = 4, seed: int = 0) -> list[list[int]]:
    """4 different 512-token system prompts in turn, each with a short distinct question."""
    systems = system_prompts(4, seed)
    g = torch.Generator().manual_seed(seed + 1)
    return [
        systems[i] + torch.randint(3, 250, (10,), generator=g).tolist()
        for _ in range(rounds)
        for i in range(4)
    ]


def run_sequential(engine, prompts, params=None) -> list[list[int]]:
    out = []
    for p in prompts:
        (o,) = engine.generate([p], params or greedy())
        out.append(o.token_ids)
        engine.check_integrity()
    return out


def hit_rate(engine) -> float:
    return engine.stats()["hit_rate"]


def assert_idle_clean(engine) -> None:
    engine.check_integrity()
    s = engine.stats()
    assert s["running"] == 0 and s["waiting"] == 0
    assert s["pages_used"] == s["pages_cached"], s
    assert s["cache_protected_tokens"] == 0


# ---------------------------------------------------------------------------- tree residency
def _sim_tiers(device_pages: int, host_pages: int, disk_tokens: int = 0, page_size: int = 2):
    alloc = BlockAllocator(device_pages, page_size)
    tree = RadixTree(alloc, page_size)
    host = HostPool(host_pages, page_size) if host_pages else None
    disk = DiskStore(None, max(1, disk_tokens) * 1000, b"\0" * 32) if disk_tokens else None
    tiers = TieredCache(tree, alloc, None, host, disk, min_load_tokens=0)
    return alloc, tree, tiers


def _put(tree: RadixTree, alloc: BlockAllocator, tokens: list[int]) -> None:
    """Match, lock, allocate the rest (evicting), insert, release: the engine's flow."""
    Pz = tree.page_size
    m = tree.match_prefix(tokens)
    tree.lock(m.node)
    need = len(tokens) // Pz - len(m.pages)
    if need > alloc.num_free:
        tree.evict((need - alloc.num_free) * Pz)
    new = alloc.allocate(need)
    ret = tree.insert(tokens, m.pages + new)
    if ret // Pz > len(m.pages):
        alloc.free(new[: ret // Pz - len(m.pages)])
    tree.unlock(m.node)


def test_device_eviction_keeps_node_on_host_and_load_brings_it_back() -> None:
    alloc, tree, tiers = _sim_tiers(device_pages=4, host_pages=8)
    a = [1, 2, 3, 4, 5, 6]
    _put(tree, alloc, a)
    assert tree.evict(100) == 6
    tree.check_integrity()
    tiers.check_integrity()
    assert tree.total_size == 0 and tree.host_size == 6 and alloc.num_free == 4
    m = tree.match_prefix(a)
    assert m.num_tokens == 0 and m.host_tokens == 6 and len(m.host_nodes) == 1
    tree.lock(m.node)
    loaded = tiers.load_prefix(a, None, m)
    assert loaded.num_tokens == 6 and loaded.by_tier == {"device": 0, "host": 6, "disk": 0}
    assert tree.total_size == 6 and tree.host_size == 6  # on both tiers now
    tree.check_integrity()
    tiers.check_integrity()
    tree.unlock(loaded.node)
    # re-eviction is free: the host copy is kept
    writes = tiers.counters["host_writes"]
    tree.evict(100)
    assert tiers.counters["host_writes"] == writes
    tree.check_integrity()


def test_insert_over_host_only_nodes_adopts_pages_and_split_keeps_residency() -> None:
    alloc, tree, tiers = _sim_tiers(device_pages=8, host_pages=8)
    _put(tree, alloc, [1, 2, 3, 4, 5, 6, 7, 8])
    tree.evict(100)
    # a match ending inside the host-only edge splits it; both halves stay host-only
    m = tree.match_prefix([1, 2, 3, 4, 9, 9])
    assert m.host_tokens == 4 and m.num_tokens == 0
    tree.check_integrity()
    # recomputing [1..6] re-adopts device pages for the host-only part
    _put(tree, alloc, [1, 2, 3, 4, 5, 6])
    tree.check_integrity()
    tiers.check_integrity()
    m = tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert m.num_tokens == 6 and m.host_tokens == 2


def test_host_eviction_only_takes_host_only_leaves() -> None:
    alloc, tree, tiers = _sim_tiers(device_pages=6, host_pages=4)
    for s in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]):
        _put(tree, alloc, s)
        tree.check_integrity()
    tree.evict(100)  # 12 tokens to host, 8 fit (4 pages): the LRU node is dropped
    tree.check_integrity()
    tiers.check_integrity()
    assert tree.host_size == 8
    assert tree.match_prefix([1, 2, 3, 4]).host_tokens == 0
    assert tree.match_prefix([9, 10, 11, 12]).host_tokens == 4


def test_reset_keeps_pinned_path_and_frees_host_pages() -> None:
    alloc, tree, tiers = _sim_tiers(device_pages=8, host_pages=8)
    _put(tree, alloc, [1, 2, 3, 4])
    _put(tree, alloc, [1, 2, 3, 4, 5, 6, 7, 8])
    assert tree.pin([1, 2, 3, 4]) == 4
    tree.evict(100)  # the unpinned child goes to the host under the pinned parent
    assert tree.host_size == 4 and tree.total_size == 4
    tree.check_integrity()
    tree.reset()
    tree.check_integrity()
    tiers.check_integrity()
    assert tree.host_size == 0 and tiers.host is not None and tiers.host.num_used == 0
    assert tree.match_prefix([1, 2, 3, 4]).num_tokens == 4


def test_random_operations_keep_both_tiers_consistent() -> None:
    rng = random.Random(7)
    for policy in ("write_back", "write_through"):
        alloc = BlockAllocator(12, 2)
        tree = RadixTree(alloc, 2)
        host = HostPool(10, 2)
        disk = DiskStore(None, 60 * 40, b"\1" * 32)
        tiers = TieredCache(tree, alloc, None, host, disk, policy, min_load_tokens=0)
        locked = []
        for _ in range(600):
            op = rng.random()
            toks = [rng.randrange(1, 4) for _ in range(rng.randrange(2, 12))]
            if op < 0.5:
                m = tree.match_prefix(toks)
                tree.lock(m.node)
                res = tiers.load_prefix(toks, None, m)
                need = len(toks) // 2 - len(res.pages)
                if need > alloc.num_free:
                    tree.evict((need - alloc.num_free) * 2)
                if need <= alloc.num_free:
                    new = alloc.allocate(need)
                    ret = tree.insert(toks, res.pages + new)
                    if ret // 2 > len(res.pages):
                        alloc.free(new[: ret // 2 - len(res.pages)])
                    m2 = tree.match_prefix(toks[: len(toks) // 2 * 2])
                    assert m2.num_tokens == len(toks) // 2 * 2
                    tree.lock(m2.node)
                    tree.unlock(res.node)
                    res.node = m2.node
                if rng.random() < 0.3:
                    locked.append(res.node)
                else:
                    tree.unlock(res.node)
            elif op < 0.7:
                tree.evict(rng.randrange(1, 10))
            elif op < 0.8:
                tree.evict_host(rng.randrange(1, 10))
            elif locked:
                tree.unlock(locked.pop(rng.randrange(len(locked))))
            tree.check_integrity()
            tiers.check_integrity()
        for node in locked:
            tree.unlock(node)
        tree.reset()
        assert alloc.num_free == alloc.num_pages and host.num_free == host.num_pages


def test_simulator_reports_hits_per_tier() -> None:
    trace = [{"input_ids": p, "output_len": 4} for p in cycle_workload(rounds=4)]
    plain = simulate(trace, 640, page_size=P)
    host = simulate(trace, 640, page_size=P, host_capacity_tokens=4096)
    disk = simulate(trace, 640, page_size=P, disk_capacity_tokens=1 << 16)
    assert plain["token_hit_rate"] < 0.05
    assert "cached_tokens_by_tier" not in plain
    assert host["token_hit_rate"] >= 0.9 * host["optimal_hit_rate"]
    assert host["cached_tokens_by_tier"]["host"] == host["cached_tokens"]
    assert disk["cached_tokens_by_tier"]["disk"] == disk["cached_tokens"] > 0


# ---------------------------------------------------------------------------- host tier (engine)
def test_host_tier_recovers_cycling_system_prompts(tiny) -> None:
    prompts = cycle_workload(rounds=4)
    roomy = make_engine(tiny, kv_cache_tokens=16384)
    want = run_sequential(roomy, prompts)
    optimum = hit_rate(roomy)
    small = make_engine(tiny, kv_cache_tokens=640)
    assert run_sequential(small, prompts) == want
    assert hit_rate(small) < 0.05
    tiered = make_engine(tiny, kv_cache_tokens=640, host_cache_tokens=4096)
    assert run_sequential(tiered, prompts) == want
    assert hit_rate(tiered) >= 0.9 * optimum > 0
    stats = tiered.stats()
    by_tier = stats["cached_tokens_by_tier"]
    assert by_tier["host"] >= 0.9 * stats["cached_tokens_total"]
    assert sum(by_tier.values()) == stats["cached_tokens_total"]
    t = stats["tiers"]
    assert t["host_loads"] >= 12 and t["host_writes"] > 0
    assert t["host_pages_used"] + t["host_pages_free"] == t["host_pages_total"]
    assert_idle_clean(tiered)
    assert_idle_clean(small)


def test_write_through_and_load_threshold(tiny) -> None:
    prompts = cycle_workload(rounds=2, seed=3)
    want = run_sequential(make_engine(tiny, kv_cache_tokens=16384), prompts)
    wt = make_engine(
        tiny, kv_cache_tokens=640, host_cache_tokens=4096, host_write_policy="write_through"
    )
    assert run_sequential(wt, prompts) == want
    assert wt.stats()["cached_tokens_by_tier"]["host"] >= 4 * (SYS_LEN - P)
    assert_idle_clean(wt)
    # a threshold above every continuation: nothing is loaded, everything is recomputed
    skip = make_engine(tiny, kv_cache_tokens=640, host_cache_tokens=4096)
    skip.tiers.min_load_tokens = 10**6
    assert run_sequential(skip, prompts) == want
    assert skip.stats()["cached_tokens_by_tier"]["host"] == 0
    assert skip.stats()["tiers"]["loads_skipped"] >= 4
    assert_idle_clean(skip)


def test_concurrent_requests_with_tiers_keep_outputs(tiny) -> None:
    """A batch of requests on a tight device pool (preemptions, evictions mid-flight)."""
    prompts = cycle_workload(rounds=2, seed=5)
    params = greedy(8)
    want = [o.token_ids for o in make_engine(tiny, kv_cache_tokens=16384).generate(prompts, params)]
    engine = make_engine(
        tiny, kv_cache_tokens=1280, host_cache_tokens=2048, chunked_prefill_tokens=256
    )
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.check_integrity()
    assert [got[f"r{i}"] for i in range(len(prompts))] == want
    stats = engine.stats()
    # preempted requests published their pages, which went to the host and came back
    assert stats["preemptions_total"] > 0 and stats["tiers"]["host_loads"] > 0
    assert_idle_clean(engine)


def test_flush_drops_host_tier(tiny) -> None:
    engine = make_engine(tiny, kv_cache_tokens=640, host_cache_tokens=4096)
    run_sequential(engine, cycle_workload(rounds=1))
    assert engine.stats()["tiers"]["host_pages_used"] > 0
    assert engine.flush_cache()
    assert engine.stats()["tiers"]["host_pages_used"] == 0
    assert_idle_clean(engine)


# ---------------------------------------------------------------------------- disk tier (engine)
def _disk_engine(model, path: Path, **knobs):
    knobs.setdefault("kv_cache_tokens", 640)
    return make_engine(model, disk_cache_dir=str(path), **knobs)


@pytest.fixture(scope="module")
def golden(tiny, tmp_path_factory):
    """A disk directory written by one engine (write-back via device eviction, no host tier),
    the prompts it saw and its greedy outputs."""
    path = tmp_path_factory.mktemp("golden")
    prompts = cycle_workload(rounds=1, seed=11)
    engine = _disk_engine(tiny, path)
    want = run_sequential(engine, prompts)
    # all four system prompts were evicted from the device at least once, except the last
    engine.flush_cache()
    engine.tiers.close()
    files = sorted(os.listdir(path))
    assert len(files) >= 3 * (SYS_LEN // P)
    return path, prompts, want


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _sys_files(engine, prompt: list[int]) -> list[Path]:
    """Files of the system prompt's pages, in chain order."""
    keys = chain_hashes(engine.tiers.fingerprint, prompt[:SYS_LEN], P)
    return [Path(engine.tiers.disk._file(k)) for k in keys]


def test_restart_serves_known_system_prompt_from_disk(tiny, golden, tmp_path) -> None:
    path, prompts, want = golden
    path = _copy(path, tmp_path / "d")
    engine = _disk_engine(tiny, path)  # a new engine: empty device, files on disk
    (out,) = engine.generate([prompts[0]], greedy())
    assert out.cached_tokens_by_tier["disk"] >= SYS_LEN - P
    assert out.cached_tokens == out.cached_tokens_by_tier["disk"]
    assert out.token_ids == want[0]
    t = engine.stats()["tiers"]
    assert t["disk_loads"] == 1 and t["corrupt_files"] == 0
    assert engine.stats()["cached_tokens_by_tier"]["disk"] == out.cached_tokens
    assert_idle_clean(engine)
    # and the loaded prefix is on the device now
    (again,) = engine.generate([prompts[0]], greedy())
    assert again.cached_tokens_by_tier["device"] >= SYS_LEN - P
    engine.tiers.close()


def test_restart_with_host_and_write_through(tiny, tmp_path) -> None:
    prompts = cycle_workload(rounds=1, seed=13)
    first = make_engine(
        tiny,
        kv_cache_tokens=16384,
        host_cache_tokens=4096,
        host_write_policy="write_through",
        disk_cache_dir=str(tmp_path),
    )
    want = run_sequential(first, prompts)
    first.tiers.close()
    second = make_engine(tiny, kv_cache_tokens=16384, disk_cache_dir=str(tmp_path))
    got = run_sequential(second, prompts)
    assert got == want
    assert second.stats()["cached_tokens_by_tier"]["disk"] >= 4 * (SYS_LEN - P)
    assert_idle_clean(second)
    second.tiers.close()


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "empty"])
def test_damaged_files_are_detected_counted_and_recomputed(tiny, golden, tmp_path, damage) -> None:
    path, prompts, want = golden
    path = _copy(path, tmp_path / "d")
    engine = _disk_engine(tiny, path)
    files = _sys_files(engine, prompts[0])
    assert all(f.exists() for f in files)
    victim = files[0]
    data = bytearray(victim.read_bytes())
    if damage == "corrupt":
        data[-5] ^= 0xFF
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(bytes(data[: len(data) // 2]))
    else:
        victim.write_bytes(b"")
    (out,) = engine.generate([prompts[0]], greedy())
    assert out.token_ids == want[0]
    assert out.cached_tokens_by_tier["disk"] == 0  # the chain is broken at its first page
    t = engine.stats()["tiers"]
    assert t["corrupt_files"] == 1
    reason = "checksum" if damage == "corrupt" else "truncated"
    assert t["corrupt_by_reason"][reason] == 1
    assert not victim.exists()
    assert_idle_clean(engine)
    engine.tiers.close()


def test_damage_in_the_middle_loads_the_valid_part(tiny, golden, tmp_path) -> None:
    path, prompts, want = golden
    path = _copy(path, tmp_path / "d")
    engine = _disk_engine(tiny, path)
    files = _sys_files(engine, prompts[0])
    data = bytearray(files[10].read_bytes())
    data[100] ^= 0x01
    files[10].write_bytes(bytes(data))
    (out,) = engine.generate([prompts[0]], greedy())
    assert out.token_ids == want[0]
    assert out.cached_tokens_by_tier["disk"] == 10 * P
    assert engine.stats()["tiers"]["corrupt_files"] == 1
    assert_idle_clean(engine)
    engine.tiers.close()


def test_files_swapped_between_fingerprints_are_detected(
    tiny, tiny_other, golden, tmp_path
) -> None:
    path, prompts, want = golden
    path = _copy(path, tmp_path / "d")
    other = _disk_engine(tiny_other, path)
    want_other = run_sequential(other, prompts)
    other.flush_cache()
    other.tiers.close()
    mine = _disk_engine(tiny, path)
    assert mine.tiers.fingerprint != other.tiers.fingerprint
    a = _sys_files(mine, prompts[0])[0]
    b = _sys_files(other, prompts[0])[0]
    assert a.exists() and b.exists() and a != b
    tmp = a.with_suffix(".swap")
    os.replace(a, tmp)
    os.replace(b, a)
    os.replace(tmp, b)
    (out,) = mine.generate([prompts[0]], greedy())
    assert out.token_ids == want[0] and out.cached_tokens_by_tier["disk"] == 0
    assert mine.stats()["tiers"]["corrupt_by_reason"]["fingerprint"] == 1
    mine.tiers.close()
    other2 = _disk_engine(tiny_other, path)
    (out2,) = other2.generate([prompts[0]], greedy())
    assert out2.token_ids == want_other[0] and out2.cached_tokens_by_tier["disk"] == 0
    assert other2.stats()["tiers"]["corrupt_by_reason"]["fingerprint"] == 1
    assert_idle_clean(mine)
    assert_idle_clean(other2)
    other2.tiers.close()


def test_disk_budget_is_respected(tiny, tmp_path) -> None:
    engine = _disk_engine(tiny, tmp_path, disk_cache_bytes=200_000)
    run_sequential(engine, cycle_workload(rounds=1, seed=17))
    engine.flush_cache()
    t = engine.stats()["tiers"]
    assert 0 < t["disk_bytes"] <= 200_000
    assert t["disk_evicted_files"] > 0
    assert sum(f.stat().st_size for f in tmp_path.glob("*.kv")) == t["disk_bytes"]
    assert_idle_clean(engine)
    engine.tiers.close()
