"""kv_layout="virtual": contiguous per-sequence K/V ranges mapped over a shared memfd page pool."""

from __future__ import annotations

import gc
import logging

import pytest
import torch
from oracle import FP32, check_rows

from radixkv import Engine, SamplingParams
from radixkv.config import EngineConfig
from radixkv.model.virtual_kv import (
    MapLimitError,
    VirtualKV,
    VirtualKVPool,
    count_process_mappings,
    virtual_layout_problem,
)

# the tiny Llama has 2 KV heads x 16 dims x 4 B = 128 B per token: 32 tokens = one 4 KiB page
PS = 32


def rand_prompts(n: int, length: int, seed: int, shared: int = 0, vocab: int = 200):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab, (shared,), generator=g).tolist()
    return [prefix + torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def kv_memfd_lines() -> int:
    with open("/proc/self/maps") as f:
        return sum("radixkv-kv" in line for line in f)


def run_both(model, prompts, params, **knobs):
    """Greedy outputs of the paged and the virtual layout (checked clean) for the same knobs."""
    knobs.setdefault("dtype", "float32")
    knobs.setdefault("page_size", PS)
    got = {}
    for layout in ("paged", "virtual"):
        engine = Engine(model, kv_layout=layout, **knobs)
        assert engine.runner.kv_layout == layout
        outs = engine.generate(prompts, params)
        engine.check_integrity()
        got[layout] = [[c.token_ids for c in o.outputs] for o in outs]
        if layout == "virtual":
            v = engine.runner.virtual
            assert v.ranges == {} and v.mappings == 0, "ranges left after every request ended"
            assert v.map_calls > 0
        got[layout + "_engine"] = engine
    assert got["virtual"] == got["paged"]
    return got


@pytest.mark.parametrize("cache", [True, False], ids=["cache-on", "cache-off"])
def test_virtual_equals_paged_tiny(tiny_model, cache):
    prompts = rand_prompts(6, 37, seed=1, shared=70)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    got = run_both(tiny_model, prompts, params, enable_prefix_cache=cache)
    if cache:
        assert got["virtual_engine"].stats()["cached_tokens_total"] > 0


def test_virtual_small_pool_eviction_preemption_and_forks(tiny_model):
    prompts = rand_prompts(8, 30, seed=2, shared=40)
    params = SamplingParams(n=2, max_tokens=30, temperature=0.0, ignore_eos=True)
    got = run_both(tiny_model, prompts, params, kv_cache_tokens=12 * PS, chunked_prefill_tokens=32)
    engine = got["virtual_engine"]
    assert engine.stats()["preemptions_total"] > 0, "the small pool was meant to preempt"
    assert engine.tree.num_evicted_tokens > 0, "the small pool was meant to evict"


def test_forks_sample_equal_to_paged(tiny_model):
    prompt = rand_prompts(1, 50, seed=3)[0]  # not a page multiple: the tail page is shared (COW)
    params = SamplingParams(n=4, max_tokens=20, temperature=1.0, seed=5, ignore_eos=True)
    run_both(tiny_model, [prompt], params)


def test_prefix_hit_maps_the_same_page_into_two_ranges(tiny_model):
    engine = Engine(tiny_model, kv_layout="virtual", dtype="float32", page_size=PS)
    shared = rand_prompts(1, 3 * PS, seed=4)[0]
    engine.generate([shared + [5, 6]], SamplingParams(max_tokens=1, temperature=0.0))
    for i, tail in enumerate(([7, 8, 9], [10, 11])):
        engine.add_request(f"r{i}", shared + tail, SamplingParams(max_tokens=8, temperature=0.0))
    engine.step()
    engine.check_integrity()
    running = engine.scheduler.running
    assert len(running) == 2 and all(s.cached_tokens == 3 * PS for s in running)
    a, b = running
    assert a.pages[:3] == b.pages[:3], "a prefix hit shares the tree's pages"
    v = engine.runner.virtual
    page = a.pages[1]
    pool = engine.runner.pool
    marker = torch.arange(PS * 2 * 16, dtype=torch.float32).view(PS, 2, 16) + 0.25
    saved = pool.k[1][page].clone()
    pool.k[1][page].copy_(marker)  # written once, through the paged view
    for seq in (a, b):
        k_view, _ = v.views(id(seq), 1, 3 * PS)
        assert k_view.is_contiguous()
        assert torch.equal(k_view[PS : 2 * PS], marker), "the range does not see the page"
    assert v.views(id(a), 1, PS)[0].data_ptr() != v.views(id(b), 1, PS)[0].data_ptr()
    pool.k[1][page].copy_(saved)
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()


def test_no_mapping_leak_after_aborts(tiny_model):
    engine = Engine(
        tiny_model,
        kv_layout="virtual",
        dtype="float32",
        page_size=PS,
        kv_cache_tokens=64 * PS,
        chunked_prefill_tokens=48,
    )
    v = engine.runner.virtual
    gc.collect()  # pools of earlier tests' engines unmap when collected
    before_memfd = kv_memfd_lines()
    before = count_process_mappings()
    for i, p in enumerate(rand_prompts(8, 60, seed=6, shared=50)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=40, temperature=0.0))
    for step in range(6):
        engine.step()
        engine.check_integrity()
        if step == 2:
            assert engine.abort("r1") and engine.abort("r4")
            engine.check_integrity()
    assert v.ranges, "requests were running"
    during = count_process_mappings()
    assert during > before
    assert kv_memfd_lines() > before_memfd, "the ranges map the memfd"
    for i in range(8):
        engine.abort(f"r{i}")
    engine.step()
    engine.check_integrity()
    assert v.ranges == {} and v.mappings == 0
    assert 1 <= kv_memfd_lines() <= before_memfd, "only pools' own views map a memfd"
    # torch's allocator may hold a few mappings of its own; the ranges held hundreds
    assert count_process_mappings() <= before + 8, (before, during, count_process_mappings())


def test_map_limit_falls_back_to_paged_steps(tiny_model, caplog):
    prompts = rand_prompts(4, 40, seed=7, shared=64)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [
        o.token_ids
        for o in Engine(tiny_model, dtype="float32", page_size=PS).generate(prompts, params)
    ]
    engine = Engine(tiny_model, kv_layout="virtual", dtype="float32", page_size=PS)
    v = engine.runner.virtual
    v.map_limit = v.base_mappings + 2 * v.num_tensors * 2 + 1  # room for ~one short sequence
    with caplog.at_level(logging.WARNING):
        got = [o.token_ids for o in engine.generate(prompts, params)]
    assert got == want
    assert engine.virtual_layout.paged_steps > 0
    assert "max_map_count" in caplog.text
    engine.check_integrity()
    with pytest.raises(MapLimitError):
        v.sync(12345, list(range(0, 16, 2)))
    assert 12345 not in v.ranges


def test_page_size_must_divide_os_pages(tiny_model, caplog):
    problem = virtual_layout_problem(16, 2, 16, torch.float32, torch.device("cpu"))
    assert problem is not None and "multiple of 32" in problem and "4096" in problem
    assert virtual_layout_problem(16, 3, 64, torch.float32, torch.device("cpu")) is None  # SmolLM2
    with pytest.raises(ValueError, match="multiple of the 4096 B OS page"):
        VirtualKVPool(2, 8, 16, 2, 16, torch.float32)
    with caplog.at_level(logging.WARNING):
        engine = Engine(tiny_model, kv_layout="virtual", dtype="float32", page_size=16)
    assert engine.runner.kv_layout == "paged" and engine.virtual_layout is None
    assert "falling back to kv_layout='paged'" in caplog.text
    with pytest.raises(ValueError, match="kv_layout"):
        EngineConfig(kv_layout="contiguous").validate()


def test_sync_remaps_only_what_changed_and_checks_the_kernel():
    pool = VirtualKVPool(2, 16, PS, 2, 16, torch.float32)
    v = VirtualKV(pool, 8 * PS)
    for layer in range(2):
        for page in range(16):
            pool.k[layer][page].fill_(layer * 100 + page)
            pool.v[layer][page].fill_(-(layer * 100 + page))
    v.sync(1, [3, 4, 5])
    calls = v.map_calls
    v.sync(1, [3, 4, 5, 9])  # one new slot: one mmap per tensor
    assert v.map_calls - calls == v.num_tensors
    v.sync(2, [3, 4, 11])
    v.check_integrity({1: [3, 4, 5, 9], 2: [3, 4, 11]})
    k, vv = v.views(1, 1, 4 * PS)
    assert k[:, 0, 0].tolist() == [103.0] * PS + [104.0] * PS + [105.0] * PS + [109.0] * PS
    assert vv[3 * PS, 0, 0].item() == -109.0
    v.sync(1, [3, 7])  # a replaced page (copy-on-write) and a shrunk table
    v.check_integrity({1: [3, 7], 2: [3, 4, 11]})
    assert v.views(1, 0, 2 * PS)[0][PS, 0, 0].item() == 7.0
    with pytest.raises(RuntimeError):
        v.views(1, 0, 3 * PS)  # slot 2 is PROT_NONE again: refused, not a segfault
    with pytest.raises(AssertionError, match="slot 1 maps page 7"):
        v.check_integrity({1: [3, 8], 2: [3, 4, 11]})
    with pytest.raises(AssertionError, match="gone"):
        v.check_integrity({1: [3, 7]})
    v.release_all()
    v.check_integrity({})
    assert v.mappings == 0


@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_virtual_fp32_matches_transformers_and_paged(real_model, real_oracle):
    from radixkv.model.runner import ModelRunner, RequestSlice

    runner = ModelRunner(real_model, kv_cache_tokens=2048, dtype=torch.float32, kv_layout="virtual")
    assert runner.kv_layout == "virtual"
    tok = real_model.tokenizer
    ids = tok.encode("The quick brown fox jumps over the lazy dog because it wanted to")
    pages = list(range(-(-(len(ids) + 1) // 16)))
    runner.virtual.sync(1, pages)
    fb = runner.build_batch([RequestSlice(ids[:-3], 0, pages)])
    fb.virtual_keys = [1]
    runner.forward(fb)
    fb = runner.build_batch([RequestSlice(ids[-3:], len(ids) - 3, pages)])  # prefix + extend
    fb.virtual_keys = [1]
    got = runner.forward(fb)[0]
    at = [len(ids) - 1]
    refs = [r[at] for r in real_oracle.references(ids, torch.float32, prefill=len(ids) - 3)]
    check_rows(got[None], real_oracle.logits(ids)[at], refs, FP32, "virtual", "last logits")
    runner.virtual.release_all()

    prompts = [
        tok.encode("You are a helpful assistant. Answer briefly. " + q)
        for q in ("What is the capital of France?", "Name a river in Vienna.")
    ]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for cache in (True, False):
        run_both(
            real_model,
            prompts,
            params,
            page_size=16,
            kv_cache_tokens=2048,
            enable_prefix_cache=cache,
        )
