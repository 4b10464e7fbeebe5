"""In-step prefix sharing: a request borrows the pages of a prefix that a sibling prefill writes in
the same step (``Scheduler._admit`` -> ``KVManager.borrow``).

It is only right if every attention backend stores a layer's new K/V for the whole batch before
any row attends; the runner-level test checks that on every backend this host runs, against the
same request run a step later (and shows that unwritten pages would be caught). The engine tests
check what the scheduler does with it: first tokens one step after the burst, the prefix computed
once, outputs and logprobs equal to an engine that shares nothing, integrity through preemption
and aborts.
"""

from __future__ import annotations

import pytest
import torch
from test_model import TRITON_DEVICE

from radixkv import Engine, SamplingParams
from radixkv.model import native
from radixkv.model.runner import ModelRunner, RequestSlice

PAGE = 8

# (dtype, RADIXKV_FP32_ATTENTION, kv_cache_dtype, attention_backend)
BACKENDS = [
    pytest.param(torch.float32, "native", "auto", "torch", id="fp32-native"),
    pytest.param(torch.float32, "cascade", "auto", "torch", id="fp32-cascade"),
    pytest.param(torch.float32, "plain", "auto", "torch", id="fp32-plain"),
    pytest.param(torch.bfloat16, "native", "auto", "torch", id="bf16"),
    pytest.param(torch.float32, "native", "int8", "torch", id="fp32-int8"),
    pytest.param(torch.float32, "native", "fp8_e4m3", "torch", id="fp32-fp8"),
    pytest.param(torch.float32, "native", "auto", "triton", id="triton"),
]


def _runner(tiny_llama, dtype, kv_cache_dtype, name) -> ModelRunner:
    return ModelRunner(
        tiny_llama,
        num_pages=12,
        page_size=PAGE,
        dtype=dtype,
        attention_backend=name,
        kv_cache_dtype=kv_cache_dtype,
        device=TRITON_DEVICE if name == "triton" else "cpu",
    )


@pytest.mark.parametrize("dtype, mode, kv_cache_dtype, name", BACKENDS)
def test_every_backend_reads_a_prefix_written_in_the_same_step(
    tiny_llama, monkeypatch, dtype, mode, kv_cache_dtype, name
):
    """B borrows A's first two pages while A's prefill writes them: B's logits equal B's logits
    when it runs one step after A (the pages written before), and differ from B over pages that
    were never written (so the comparison can fail)."""
    monkeypatch.setenv("RADIXKV_FP32_ATTENTION", mode)
    g = torch.Generator().manual_seed(11)
    a = torch.randint(3, 250, (3 * PAGE,), generator=g).tolist()
    b = a[: 2 * PAGE] + torch.randint(3, 250, (PAGE - 1,), generator=g).tolist()
    a_pages, b_pages = [7, 2, 9], [7, 2, 4]  # B's table starts with A's first two pages

    same = _runner(tiny_llama, dtype, kv_cache_dtype, name)
    out = same.forward(
        same.build_batch(
            [RequestSlice(a, 0, a_pages), RequestSlice(b[2 * PAGE :], 2 * PAGE, b_pages)]
        )
    )
    together = out[1].float().cpu()

    later = _runner(tiny_llama, dtype, kv_cache_dtype, name)
    later.forward(later.build_batch([RequestSlice(a, 0, a_pages)]))
    after = later.forward(later.build_batch([RequestSlice(b[2 * PAGE :], 2 * PAGE, b_pages)]))
    after = after[0].float().cpu()

    unwritten = _runner(tiny_llama, dtype, kv_cache_dtype, name)
    blind = (
        unwritten.forward(unwritten.build_batch([RequestSlice(b[2 * PAGE :], 2 * PAGE, b_pages)]))[
            0
        ]
        .float()
        .cpu()
    )

    # float32 math (quantized pages too: both runs read the same stored codes) vs bf16 rows
    tol = 2e-4 if dtype == torch.float32 else 5e-2
    scale = after.abs().max().item()
    err = (together - after).abs().max().item()
    assert err <= tol * scale, (type(same.backend).__name__, err, scale)
    # unwritten prefix pages move the logits by about their own size (1.2-1.3x here)
    assert (blind - after).abs().max().item() > 0.25 * scale, "unwritten pages went unseen"


def test_the_backends_above_cover_this_hosts_kernels(tiny_llama, monkeypatch):
    """The parametrization reaches the native kernels wherever they are built (a pick that fell
    back to torch would leave the native path of in-step sharing untested)."""
    if not native.available():
        pytest.skip("the native kernels are not built on this host")
    monkeypatch.setenv("RADIXKV_FP32_ATTENTION", "native")
    names = {
        type(_runner(tiny_llama, dtype, "auto", "torch").backend).__name__
        for dtype in (torch.float32, torch.bfloat16)
    }
    assert any("Native" in n for n in names), names


def make_engine(tiny_model, **knobs) -> Engine:
    knobs.setdefault("page_size", 4)
    knobs.setdefault("dtype", "float32")
    return Engine(tiny_model, **knobs)


def burst(groups: int, per_group: int, shared: int, own: int, seed: int) -> list[list[int]]:
    """``groups`` system prompts of ``shared`` tokens, each with ``per_group`` requests of ``own``
    tokens of their own, interleaved as a chat API receives them (group of request i: i % groups)."""
    g = torch.Generator().manual_seed(seed)
    systems = [torch.randint(3, 200, (shared,), generator=g).tolist() for _ in range(groups)]
    return [
        systems[i % groups] + torch.randint(3, 200, (own,), generator=g).tolist()
        for i in range(groups * per_group)
    ]


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)


def _run(
    engine: Engine, prompts: list[list[int]], check: bool = True, salts: list | None = None
) -> dict:
    """Every request of ``prompts`` at once (request i with ``salts[i % len(salts)]``); per
    request its tokens, logprobs and the step of its first token."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY, salt=salts[i % len(salts)] if salts else None)
    got: dict[str, dict] = {}
    step = 0
    while engine.has_unfinished():
        step += 1
        for out in engine.step():
            rec = got.setdefault(out.request_id, {"tokens": [], "logprobs": [], "first": step})
            rec["tokens"] += out.new_token_ids
            rec["logprobs"] += [
                lp[t].logprob for lp, t in zip(out.logprobs or [], out.new_token_ids)
            ]
        if check:
            engine.check_integrity()
    return got


def _same_outputs(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for rid in want:
        assert got[rid]["tokens"] == want[rid]["tokens"], rid
        lp, ref = torch.tensor(got[rid]["logprobs"]), torch.tensor(want[rid]["logprobs"])
        assert torch.allclose(lp, ref, atol=1e-4), (rid, lp, ref)


@pytest.mark.parametrize("kv_layout", ["paged", "virtual"])
def test_a_burst_on_new_system_prompts_gets_first_tokens_a_step_sooner(tiny_model, kv_layout):
    """Four new system prompts, eight chats each, at once: each prompt's first request computes
    it and its seven siblings borrow it in the same step, before the next prompt's cold prefill
    (lpm), so the first step answers a whole group and every prompt token is computed once.
    Tokens and logprobs are those of an engine that shares nothing."""
    prompts = burst(groups=4, per_group=8, shared=64, own=6, seed=3)
    # the budget holds one system prompt and its siblings' suffixes, not two system prompts
    engine = make_engine(tiny_model, kv_layout=kv_layout, chunked_prefill_tokens=128)
    got = _run(engine, prompts)
    firsts = sorted(rec["first"] for rec in got.values())
    assert firsts[:8] == [1] * 8, firsts  # a whole group answered by the first step
    # every sibling reuses its system prompt: borrowed in the step it is computed, or (a
    # prompt whose first chunk the budget cut short) its first pages from the tree, the rest
    # borrowed the step after
    borrowed = engine.scheduler.num_borrowed_tokens
    assert 3 * 7 * 64 <= borrowed < 4 * 7 * 64, borrowed
    # 4 system prompts + 32 suffixes once, then 5 decode steps of 32
    assert engine.counters["forward_tokens"] == 4 * 64 + 32 * 6 + 32 * 5
    stats = engine.stats()
    assert stats["cached_tokens_total"] == 4 * 7 * 64
    assert stats["borrowed_tokens_total"] == borrowed
    engine.check_integrity()

    alone = make_engine(tiny_model, kv_layout=kv_layout, enable_prefix_cache=False)
    _same_outputs(got, _run(alone, prompts))


def test_two_salts_in_one_step_never_borrow_each_others_prefix(tiny_model):
    """One system prompt sent under two salts (two tenants), interleaved, all in one step: each
    salt's first request computes the prefix and only its own salt's siblings borrow it, so the
    prefix is computed once per salt and nothing crosses (issue 59: the scheduler's salt checks
    had no test with two salts in a step). Outputs are those of an engine sharing nothing."""
    prompts = burst(groups=1, per_group=8, shared=32, own=5, seed=6)
    salts = ["tenant-a", "tenant-b"]
    engine = make_engine(tiny_model, chunked_prefill_tokens=4096)
    got = _run(engine, prompts, salts=salts)
    assert all(rec["first"] == 1 for rec in got.values())
    # the prefix twice (once a salt), 8 suffixes, then 5 decode steps of 8
    assert engine.counters["forward_tokens"] == 2 * 32 + 8 * 5 + 8 * 5
    assert engine.scheduler.num_borrowed_tokens == 2 * 3 * 32  # 3 siblings a salt
    engine.check_integrity()
    _same_outputs(got, _run(make_engine(tiny_model, enable_prefix_cache=False), prompts))


def test_without_lpm_borrowing_still_computes_each_prefix_once(tiny_model):
    """fcfs keeps arrival order (no borrowers moved forward) but still borrows where it can."""
    prompts = burst(groups=2, per_group=4, shared=32, own=5, seed=4)
    engine = make_engine(tiny_model, schedule_policy="fcfs", chunked_prefill_tokens=4096)
    got = _run(engine, prompts)
    assert all(rec["first"] == 1 for rec in got.values())
    assert engine.counters["forward_tokens"] == 2 * 32 + 8 * 5 + 8 * 5
    _same_outputs(got, _run(make_engine(tiny_model, enable_prefix_cache=False), prompts))


def test_a_chunk_short_of_the_shared_pages_makes_siblings_wait(tiny_model):
    """When the owner's chunk stops before the end of the shared prefix the siblings wait for it
    to reach the tree (dedupe as before) rather than compute it twice."""
    prompts = burst(groups=1, per_group=6, shared=96, own=4, seed=5)
    engine = make_engine(tiny_model, chunked_prefill_tokens=64)
    got = _run(engine, prompts)
    assert engine.counters["forward_tokens"] == 96 + 6 * 4 + 6 * 5
    assert engine.scheduler.num_borrowed_tokens == 5 * 32  # borrowed from the last chunk
    _same_outputs(got, _run(make_engine(tiny_model, enable_prefix_cache=False), prompts))


def test_aborting_the_owner_and_preemption_keep_borrowers_whole(tiny_model):
    """The owner aborted after the step it shared, and a pool so small that borrowers are
    preempted and recomputed: integrity every step, and the survivors' outputs unchanged."""
    prompts = burst(groups=2, per_group=5, shared=40, own=6, seed=6)
    want = _run(make_engine(tiny_model, enable_prefix_cache=False), prompts)

    engine = make_engine(tiny_model, chunked_prefill_tokens=4096)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.step()
    assert engine.scheduler.num_borrowed_tokens > 0
    assert engine.abort("r0") and engine.abort("r1")  # each group's owner
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.check_integrity()
    for i in range(2, len(prompts)):
        assert want[f"r{i}"]["tokens"][1:] == got[f"r{i}"], i

    tight = make_engine(tiny_model, kv_cache_tokens=160, chunked_prefill_tokens=4096)
    _same_outputs(_run(tight, prompts), want)
    assert tight.stats()["preemptions_total"] > 0
    assert tight.scheduler.num_borrowed_tokens > 0
