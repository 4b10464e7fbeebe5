"""Engine: continuous batching over the radix cache, checked against transformers."""

from __future__ import annotations

import pytest
import torch
from oracle import FP32, Oracle, check_greedy_tokens

from radixkv import Engine, SamplingParams
from radixkv.cache.partial_page import MIN_PARTIAL_TOKENS

SYSTEM = (
    "You are a meticulous assistant for a travel agency. Answer in one short sentence, "
    "name concrete places, avoid lists, and never invent prices or opening hours. "
    "If a question is ambiguous, answer the most likely reading."
)
QUESTIONS = [
    "What is the capital of France?",
    "Which river flows through Vienna?",
    "Name a famous museum in Madrid.",
    "Where is the Colosseum?",
    "What language is spoken in Brazil?",
    "Which city is known for canals in Italy?",
]


def chat_prompts(engine: Engine, questions: list[str], system: str = SYSTEM) -> list[list[int]]:
    return [
        engine.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": q}]
        )
        for q in questions
    ]


def assert_matches_oracle(oracle: Oracle, prompt: list[int], output: list[int], path: str) -> int:
    """Every emitted greedy token is the float64 oracle's argmax wherever the oracle's top-2
    margin is beyond what float32 arithmetic can flip (tests/oracle.py); returns how many
    tokens were decisive. (The reference forms are the two whole-sequence ones: a bound only
    matters on a near-tie, and the decode form would double the test's time.)"""
    seq = prompt + output[:-1]
    truth, bound, _ = oracle.judged(seq, slice(len(prompt) - 1, None), FP32)
    return check_greedy_tokens(output, truth, bound, path)


def assert_clean(engine: Engine) -> None:
    """Idle engine: integrity holds and every used page is held, unlocked, by the tree."""
    engine.check_integrity()
    stats = engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["pages_used"] == stats["pages_cached"], stats
    assert stats["cache_protected_tokens"] == 0


# -- the real model ----------------------------------------------------------------------------
@pytest.mark.real_model
@pytest.mark.parametrize(
    "knobs",
    [
        dict(enable_prefix_cache=True),
        dict(enable_prefix_cache=False),
        dict(enable_prefix_cache=True, kv_cache_tokens=128, chunked_prefill_tokens=48),
    ],
    ids=["cache-on", "cache-off", "tiny-pool"],
)
def test_greedy_agrees_with_transformers(real_model, real_oracle, knobs):
    engine = Engine(real_model, page_size=16, dtype="float32", **knobs)
    prompts = chat_prompts(engine, QUESTIONS)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    decisive = 0
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt
        assert len(out.token_ids) == 10
        decisive += assert_matches_oracle(real_oracle, prompt, out.token_ids, "engine")
    assert decisive > len(prompts) * 5, "too few decisive tokens to judge the engine"
    stats = engine.stats()
    if knobs.get("kv_cache_tokens") == 128:
        assert stats["preemptions_total"] > 0, "the tiny pool was meant to force preemption"
        assert engine.tree.num_evicted_tokens > 0, "the tiny pool was meant to force eviction"
    if not knobs["enable_prefix_cache"]:
        assert stats["cached_tokens_total"] == 0
    assert_clean(engine)


@pytest.mark.real_model
def test_cascade_attention_greedy_agrees_with_transformers(real_model, real_oracle):
    """The shared-prefix (cascade) CPU backend, forced in fp32 on a shared system prompt."""
    from radixkv.model.attention.cascade_backend import CascadeTorchBackend

    engine = Engine(real_model, page_size=16, dtype="float32", max_running_requests=3)
    engine.runner.backend = backend = CascadeTorchBackend()
    steps = []
    prepare = backend.prepare

    def spy(batch, dtype):
        meta = prepare(batch, dtype)
        steps.append((batch, meta))
        return meta

    backend.prepare = spy
    prompts = chat_prompts(engine, QUESTIONS, system=SYSTEM + " " + SYSTEM)  # > 64 tokens
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert assert_matches_oracle(real_oracle, prompt, out.token_ids, "cascade engine") > 4
    # the groups: each one's pages are the shared prompt's tree pages, the first pages of every
    # member's page table, within every member's cached prefix; the whole shared prompt is
    # grouped at some step
    P = engine.page_size
    shared = min(next(i for i, t in enumerate(p) if t != prompts[0][i]) for p in prompts[1:])
    tree_pages = engine.tree.match_prefix(prompts[0][:shared]).pages
    assert len(tree_pages) == shared // P
    spans = []
    for batch, meta in steps:
        if not meta.groups:
            continue
        table, starts = batch.page_table.tolist(), batch.extend_starts
        for group in meta.groups:
            s = group.num_tokens // P
            assert 0 < group.num_tokens <= shared // P * P
            runs = group.pages.view(-1, s).tolist()
            assert all(run == tree_pages[:s] for run in runs)
            members = {
                i
                for row in group.real_rows.tolist()
                for i, start in enumerate(starts)
                if start <= row < start + batch.extend_lens[i]
            }
            assert len(members) >= 2 * len(runs)
            for i in members:
                assert table[i][:s] == tree_pages[:s]
                assert batch.prefix_lens[i] >= group.num_tokens
            spans.append(group.num_tokens)
    assert spans, "the shared system prompt should have formed a cascade group"
    assert max(spans) == shared // P * P
    assert_clean(engine)


@pytest.mark.real_model
def test_cached_tokens_exact_and_second_turn_hits(real_model):
    P = 16
    engine = Engine(real_model, page_size=P, dtype="float32")
    prompts = chat_prompts(engine, QUESTIONS)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    (first,) = engine.generate([prompts[0]], params)
    assert first.cached_tokens == 0
    warm = prompts[0] + first.token_ids[:-1]  # tokens whose KV went into the tree

    def lcp(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    in_tree = warm[: len(warm) // P * P]  # the tree holds whole pages
    outs = engine.generate(prompts[1:], params)
    for prompt, out in zip(prompts[1:], outs):
        shared = min(lcp(prompt, in_tree), len(prompt) - 1)
        expected = shared // P * P
        if shared - expected >= MIN_PARTIAL_TOKENS:  # copied from the tree's next page
            expected = shared
        assert out.cached_tokens == expected
        assert expected >= len(prompts[0]) // 2  # the system prompt is most of it
    # the next turn of a conversation hits its whole history (prompt and generated tokens)
    follow = prompts[1] + outs[0].token_ids + [engine.tokenizer.eos_token_id]
    (turn2,) = engine.generate([follow], params)
    assert turn2.cached_tokens == (len(prompts[1]) + len(outs[0].token_ids) - 1) // P * P
    assert_clean(engine)


@pytest.mark.real_model
def test_partial_page_reuse_agrees_with_the_oracle_and_cache_off(real_model, real_oracle):
    """A prompt whose shared prefix ends 9 tokens into a page the tree holds whole gets those 9
    rows by page copy (cached_tokens counts them), and its greedy tokens and logprobs are the
    ones computed from scratch: the float64 oracle's, and a cache-off engine's within float32
    noise."""
    P = 16
    engine = Engine(real_model, page_size=P, dtype="float32")
    prompts = chat_prompts(engine, QUESTIONS)
    base = prompts[0]
    shared = (len(base) // P - 1) * P + 9  # inside base's last whole page
    tail = prompts[1][-12:]
    assert tail[0] != base[shared]
    other = base[:shared] + tail
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    (first,) = engine.generate([base], params)
    (out,) = engine.generate([other], params)
    assert out.cached_tokens == shared, (out.cached_tokens, shared)
    assert out.cached_tokens_by_tier == {"device": shared}
    assert assert_matches_oracle(real_oracle, other, out.token_ids, "partial page") >= 4
    (again,) = engine.generate([base], params)  # the donor page is unchanged
    assert again.token_ids == first.token_ids
    off = Engine(real_model, page_size=P, dtype="float32", enable_prefix_cache=False)
    (ref,) = off.generate([other], params)
    assert out.token_ids == ref.token_ids
    pairs = zip(out.outputs[0].logprobs, ref.outputs[0].logprobs, out.token_ids, strict=True)
    for got, want, tok in pairs:
        assert abs(got[tok].logprob - want[tok].logprob) < 1e-3
    assert_clean(engine)


@pytest.mark.parametrize("kv_layout, P", [("paged", 8), ("virtual", 32)])
def test_partial_page_reuse_needs_enough_tokens_and_keeps_the_donor(tiny_model, kv_layout, P):
    """Below MIN_PARTIAL_TOKENS the match stays page aligned; at or above it the page's rows
    are copied; the donor's own request repeats its tokens; integrity holds throughout (the
    virtual layout, whose pages must span whole OS pages, maps the copied page like any other)."""
    # the virtual layout maps host memory, so it is a CPU engine's even where CUDA is present
    # (elsewhere it falls back to paged, as the GPU run of these tests found)
    on = {"device": "cpu"} if kv_layout == "virtual" else {}
    engine = make_engine(tiny_model, page_size=P, kv_layout=kv_layout, **on)
    assert engine.runner.kv_layout == kv_layout
    g = torch.Generator().manual_seed(3)
    base = torch.randint(5, 200, (5 * P,), generator=g).tolist()
    tail = [201, 202, 203, 204, 205]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (first,) = engine.generate([base], params)
    few = 2 * P + MIN_PARTIAL_TOKENS - 1
    (short,) = engine.generate([base[:few] + tail], params)
    assert short.cached_tokens == 2 * P
    engine.check_integrity()
    enough = 3 * P + MIN_PARTIAL_TOKENS + 1
    (long,) = engine.generate([base[:enough] + tail], params)
    assert long.cached_tokens == enough
    engine.check_integrity()
    off = make_engine(tiny_model, page_size=P, enable_prefix_cache=False)
    (ref,) = off.generate([base[:enough] + tail], params)
    assert long.token_ids == ref.token_ids
    (repeat,) = engine.generate([base], params)
    assert repeat.token_ids == first.token_ids
    assert_clean(engine)


# -- the tiny random model: scheduler mechanics ---------------------------------------------------
def make_engine(tiny_model, **knobs) -> Engine:
    knobs.setdefault("page_size", 4)
    knobs.setdefault("dtype", "float32")
    return Engine(tiny_model, **knobs)


def test_engine_holds_every_assembled_part(tiny_model):
    """The engine takes each part ``assemble`` built by name: a part added to EngineParts and not
    to Engine.__init__ fails here; the tiers observe the same tree the KV manager uses."""
    from dataclasses import fields

    from radixkv.engine.assembly import EngineParts

    e = make_engine(tiny_model, host_cache_tokens=64)
    missing = [f.name for f in fields(EngineParts) if not hasattr(e, f.name)]
    assert not missing, f"Engine.__init__ drops assembled parts {missing}"
    assert e.tiers is not None and e.tiers.tree is e.tree is e.kv.tree
    assert e.tree.on_evict is not None and e.tree.host_allocator is e.tiers.host.allocator
    e.check_integrity()


def rand_prompts(n: int, length: int, seed: int, shared: int = 0, vocab: int = 200):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab, (shared,), generator=g).tolist()
    return [prefix + torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def test_preemption_and_eviction_keep_greedy_outputs(tiny_model):
    prompts = rand_prompts(8, 30, seed=1, shared=20)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = make_engine(tiny_model, kv_cache_tokens=4096)
    want = [o.token_ids for o in roomy.generate(prompts, params)]
    tight = make_engine(tiny_model, kv_cache_tokens=160, chunked_prefill_tokens=32)
    got = [o.token_ids for o in tight.generate(prompts, params)]
    assert tight.stats()["preemptions_total"] > 0
    assert got == want
    assert_clean(roomy)
    assert_clean(tight)


def test_in_batch_dedupe_computes_shared_prefix_once(tiny_model):
    engine = make_engine(tiny_model, page_size=4, chunked_prefill_tokens=4096)
    prompts = rand_prompts(32, 8, seed=2, shared=256)
    engine.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    # one request computes the 256 shared tokens; the 31 others only their own suffix (+ one
    # token recomputed at the page boundary at most) and their decode step.
    computed = engine.counters["forward_tokens"]
    assert computed <= 256 + 32 * (8 + 4) + 32, computed
    assert engine.stats()["cached_tokens_total"] >= 31 * 256
    assert_clean(engine)


def test_abort_mid_flight_leaks_nothing(tiny_model):
    engine = make_engine(tiny_model, kv_cache_tokens=1024, chunked_prefill_tokens=16)
    prompts = rand_prompts(10, 40, seed=3, shared=16)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=30, temperature=0.0))
    finished: dict[str, str | None] = {}  # request id -> finish reason
    for step in range(12):
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished, "a request finished twice"
                finished[out.request_id] = out.finish_reason
        engine.check_integrity()
        if step == 3:
            assert not finished, "nothing finishes in 4 steps of 16-token chunks"
            assert engine.abort("r0") and engine.abort("r5") and engine.abort("r9")
            assert not engine.abort("nope")
    # the three aborted mid-flight were reported once, as aborted, the step after
    assert {r for r, why in finished.items() if why == "abort"} == {"r0", "r5", "r9"}
    live = {f"r{i}" for i in range(10)} - set(finished)
    assert len(live) >= 3, finished  # the rest are still mid-flight: aborting them is the test
    for i in range(10):
        assert engine.abort(f"r{i}") is (f"r{i}" in live)  # finished ones are unknown now
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == sorted(live)
    assert all(o.finished and o.finish_reason == "abort" and not o.new_token_ids for o in outs)
    assert not engine.has_unfinished()
    assert_clean(engine)


def test_parallel_sampling_shares_prompt_pages(tiny_model):
    engine = make_engine(tiny_model, page_size=8)
    prompt = rand_prompts(1, 21, seed=4)[0]  # not a page multiple: the tail page is shared
    (out,) = engine.generate(
        [prompt], SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    )
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "seeded samples should differ"
    # the prompt was prefilled once: 21 prompt tokens + 4 x 11 decode tokens
    assert engine.counters["forward_tokens"] == 21 + 4 * 11
    (again,) = engine.generate(
        [prompt], SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    )
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    (greedy,) = engine.generate([prompt], SamplingParams(n=3, max_tokens=6, temperature=0.0))
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1
    assert_clean(engine)


def test_every_sampling_knob_runs_on_the_engines_device(tiny_model):
    """Temperature, top-k, top-p, min-p, the three penalties, logit_bias, min_tokens, logprobs,
    n > 1 and beam search in one batch, on the device the engine picked (CUDA where there is
    one; the per-request streams stay on the host, so a seed gives the same draws anywhere):
    every request finishes, logprobs are finite, and seeded requests repeat their tokens."""
    engine = make_engine(tiny_model, page_size=8)
    prompts = rand_prompts(6, 19, seed=11)
    common = {"max_tokens": 8, "ignore_eos": True}
    params = [
        SamplingParams(temperature=0.8, top_k=20, seed=1, **common),
        SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05, seed=2, **common),
        SamplingParams(
            temperature=0.7,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            presence_penalty=0.3,
            seed=3,
            **common,
        ),
        SamplingParams(
            temperature=1.0, logit_bias={7: 4.0}, min_tokens=6, logprobs=3, seed=4, **common
        ),
        SamplingParams(n=2, temperature=1.0, seed=5, **common),
        SamplingParams(n=2, use_beam_search=True, logprobs=2, **common),
    ]
    first = engine.generate(prompts, params)
    again = engine.generate(prompts, params)
    for out, rerun in zip(first, again):
        assert all(len(c.token_ids) == 8 for c in out.outputs)
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in rerun.outputs]
    for entry in first[3].outputs[0].logprobs:
        assert all(torch.isfinite(torch.tensor(lp.logprob)) for lp in entry.values())
    assert_clean(engine)


def test_stop_conditions(tiny_model):
    engine = make_engine(tiny_model)
    prompt = rand_prompts(1, 12, seed=5)[0]
    (free,) = engine.generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    stop_id = free.token_ids[5]
    (stopped,) = engine.generate(
        [prompt],
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_id], ignore_eos=True),
    )
    first = free.token_ids.index(stop_id)
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"
    # stop strings (byte tokens: one character per ASCII token): the very first character,
    # one spanning the first two tokens, one spanning two tokens further on, two at once (the
    # earliest wins), and one that never occurs
    ids, text, tok = free.token_ids, free.text, engine.tokenizer
    assert text == tok.decode(ids)
    pair = next(i for i in range(1, len(ids) - 1) if ids[i] < 128 and ids[i + 1] < 128)
    later = chr(ids[pair]) + chr(ids[pair + 1])
    assert ids[0] < 128 and ids[1] < 128, "the cases below want ASCII first tokens"
    cases = [[text[:1]], [text[:2]], [later], [later, text[:2]], ["\x00\x00"]]
    for stop in cases:
        (s,) = engine.generate(
            [prompt], SamplingParams(max_tokens=12, temperature=0.0, stop=stop, ignore_eos=True)
        )
        hits = [text.find(x) for x in stop if x in text]
        if not hits:
            assert s.finish_reason == "length" and s.text == text and s.token_ids == ids
            continue
        assert s.finish_reason == "stop", stop
        assert s.text == text[: min(hits)], stop
        # it stopped at the token that completed the stop string
        done = next(
            k for k in range(1, len(ids) + 1) if any(x in tok.decode(ids[:k]) for x in stop)
        )
        assert s.token_ids == ids[:done], stop
    assert_clean(engine)


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight"])
def test_schedule_policies_give_same_greedy_outputs(tiny_model, policy):
    prompts = rand_prompts(6, 10, seed=6, shared=12) + rand_prompts(6, 10, seed=7, shared=12)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    ref = make_engine(tiny_model, schedule_policy="fcfs", enable_prefix_cache=False)
    want = [o.token_ids for o in ref.generate(prompts, params)]
    engine = make_engine(tiny_model, schedule_policy=policy, max_running_requests=3)
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    assert_clean(engine)


def test_bad_values_raise_clear_errors(tiny_model):
    with pytest.raises(ValueError, match="page_size"):
        make_engine(tiny_model, page_size=0)
    with pytest.raises(ValueError, match="schedule_policy"):
        make_engine(tiny_model, schedule_policy="random")
    with pytest.raises(ValueError, match="eviction_policy"):
        make_engine(tiny_model, eviction_policy="mru")
    with pytest.raises(TypeError, match="unknown Engine option"):
        make_engine(tiny_model, kv_cache_tokenz=10)
    engine = make_engine(tiny_model, kv_cache_tokens=64)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", [], SamplingParams())
    with pytest.raises(ValueError, match="KV cache"):
        engine.add_request("b", list(range(3, 60)), SamplingParams(max_tokens=16))
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request("c", [10**9], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("d", [5, 6], SamplingParams(temperature=-1))
    engine.add_request("e", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("e", [5, 6], SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    assert_clean(engine)


def test_forked_sample_reads_its_own_logits_next_to_a_chunked_prefill(tiny_model):
    """n > 1 finishing its prompt in the step where another prompt is mid-chunk (regression)."""
    short, long_ = rand_prompts(1, 10, seed=8)[0], rand_prompts(1, 100, seed=9)[0]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = make_engine(tiny_model).generate([short], params)[0].token_ids
    engine = make_engine(tiny_model, chunked_prefill_tokens=32, schedule_policy="fcfs")
    forked = SamplingParams(n=2, max_tokens=6, temperature=0.0, ignore_eos=True)
    out, _ = engine.generate([short, long_], [forked, params])
    assert [c.token_ids for c in out.outputs] == [alone, alone]
    assert_clean(engine)


def test_request_that_cannot_fit_beside_pins_is_refused_or_aborted_not_spun(tiny_model):
    from radixkv.engine.pinning import PinnedCapacityError

    engine = make_engine(tiny_model, kv_cache_tokens=64, page_size=4)
    waiting = rand_prompts(1, 30, seed=11)[0]
    # admitted before the pin exists: it must end (abort), never spin
    engine.add_request("big", waiting, SamplingParams(max_tokens=20))
    pinned = rand_prompts(1, 40, seed=10)[0]
    assert engine.pin_prefix(pinned) == 40
    outs = []
    for _ in range(200):
        outs += engine.step()
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished(), "the engine spun on a request that can never fit"
    assert outs and outs[-1].finish_reason in ("abort", "length")
    engine.check_integrity()
    # arriving after the pin: refused at admission, nothing queued
    with pytest.raises(PinnedCapacityError, match="pinned"):
        engine.add_request("late", rand_prompts(1, 30, seed=12)[0], SamplingParams(max_tokens=20))
    assert not engine.has_unfinished()
    engine.check_integrity()
