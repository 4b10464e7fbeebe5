"""Scheduling policies: the order each admits waiting requests in, and what it does to cache hits.

``lpm`` (the default) admits the waiting request with the longest device-cached prefix first (ties
in arrival order). ``dfs-weight`` walks the radix tree depth first, heaviest subtree (most waiting
requests) first, a node's own requests after its subtrees, so requests with nothing cached go
last. Both put preempted (resumed) requests first and fall back to arrival order (``fcfs``) past
``LPM_MAX_QUEUE`` waiting requests or with the prefix cache off. The unit tests drive
:class:`Scheduler` on a hand-built tree; the engine tests check the effect on cached tokens.
"""

from __future__ import annotations

import pytest
import torch

from radixkv import Engine, SamplingParams
from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.radix_tree import RadixTree
from radixkv.config import EngineConfig
from radixkv.engine.kv_manager import KVManager
from radixkv.engine.request import SeqStatus, Sequence
from radixkv.engine.scheduler import LPM_MAX_QUEUE, Scheduler

P = 4


def make_scheduler(policy: str, prefix_cache: bool = True, **knobs) -> Scheduler:
    config = EngineConfig(schedule_policy=policy, page_size=P, **knobs)
    allocator = BlockAllocator(64, P)
    tree = RadixTree(allocator, P)
    return Scheduler(config, KVManager(allocator, tree, prefix_cache, lambda src, dst: None))


def cache(sched: Scheduler, tokens: list[int]) -> None:
    """Put ``tokens`` (a page multiple) into the tree, as a finished request would."""
    pages = sched.kv.allocator.allocate(len(tokens) // P)
    present = sched.kv.tree.insert(tokens, pages)
    if present:
        sched.kv.allocator.free(pages[: present // P])


def seq(request_id: str, tokens: list[int]) -> Sequence:
    return Sequence(request_id, 0, list(tokens), SamplingParams(max_tokens=4), None, 0.0, None)


# A tree with a branch at A (children A1, A2) and a separate path B, all page multiples:
#   root -> A (8 tokens) -> A1 (+4), A2 (+4);  root -> B (8 tokens)
A = list(range(100, 108))
A1 = A + list(range(200, 204))
A2 = A + list(range(300, 304))
B = list(range(400, 408))
# Waiting requests in arrival order, with the node their cached prefix ends at and its length.
WAITING = {
    "r0": [1, 2, 3, 4, 5],  # nothing cached (root)
    "r1": B + [9, 9, 9],  # B: 8
    "r2": A1 + [5, 5],  # A1: 12
    "r3": A2 + [6, 6],  # A2: 12
    "r4": A1 + [7, 7, 7],  # A1: 12
    "r5": A + [8, 8, 8, 8, 8],  # A (mismatches A1 and A2 after it): 8
    "r6": B + [1, 1],  # B: 8
}
CACHED = {"r0": 0, "r1": 8, "r2": 12, "r3": 12, "r4": 12, "r5": 8, "r6": 8}


def scheduler_with_queue(policy: str, **knobs) -> Scheduler:
    sched = make_scheduler(policy, **knobs)
    for tokens in (A1, A2, B):
        cache(sched, tokens)
    for request_id, tokens in WAITING.items():
        sched.add(seq(request_id, tokens))
    assert {s.request_id: sched.kv.peek(s)[0] for s in sched.waiting} == CACHED
    return sched


def order(sched: Scheduler) -> list[str]:
    return [s.request_id for s in sched._ordered_waiting()]


# Expected orders, read off the implementation:
# lpm: cached length descending, ties in arrival order.
LPM_ORDER = ["r2", "r3", "r4", "r1", "r5", "r6", "r0"]
# dfs-weight: weights A 4 (r2 r3 r4 r5), B 2, A1 2, A2 1, root 7. Root's subtrees heaviest
# first: A before B; in A: A1 (r2 r4) before A2 (r3), then A's own r5; then B (r1 r6); the
# root's own r0 last.
DFS_ORDER = ["r2", "r4", "r3", "r5", "r1", "r6", "r0"]
FCFS_ORDER = list(WAITING)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("fcfs", FCFS_ORDER), ("lpm", LPM_ORDER), ("dfs-weight", DFS_ORDER)],
)
def test_waiting_order_of_each_policy(policy: str, expected: list[str]) -> None:
    assert order(scheduler_with_queue(policy)) == expected


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("fcfs", FCFS_ORDER), ("lpm", LPM_ORDER), ("dfs-weight", DFS_ORDER)],
)
def test_admission_follows_the_order(policy: str, expected: list[str]) -> None:
    """One step admits in the policy's order (batch order), each with its cached prefix; with
    one slot, the first request of the order is the one admitted."""
    sched = scheduler_with_queue(policy)
    batch = sched.schedule()
    assert [s.request_id for s, _ in batch.entries] == expected
    for s, chunk in batch.entries:
        assert s.cached_tokens == CACHED[s.request_id]
        assert chunk == s.num_tokens - CACHED[s.request_id]  # the whole uncached rest
    sched = scheduler_with_queue(policy, max_running_requests=1)
    batch = sched.schedule()
    assert [s.request_id for s, _ in batch.entries] == expected[:1]
    assert [s.request_id for s in sched.waiting] == [r for r in WAITING if r != expected[0]]


def test_dfs_weight_ties_go_in_arrival_order() -> None:
    """Equal-weight subtrees: the one whose first request arrived first goes first; requests at
    the same node keep arrival order; nothing-cached requests go after every hit."""
    sched = make_scheduler("dfs-weight")
    for tokens in (A1, A2, B):
        cache(sched, tokens)
    arrivals = {
        "n0": [7, 7, 7, 7, 7],  # nothing cached
        "b0": B + [1],
        "a2": A2 + [2],
        "a1": A1 + [3],
        "b1": B + [4],
        "n1": [8, 8, 8, 8, 8],
        "a2'": A2 + [5],
    }
    for request_id, tokens in arrivals.items():
        sched.add(seq(request_id, tokens))
    # A (3) before B (2); in A, A2 (2) before A1 (1); then B; the nothing-cached last.
    assert order(sched) == ["a2", "a2'", "a1", "b0", "b1", "n0", "n1"]
    sched = make_scheduler("dfs-weight")
    for tokens in (A1, A2, B):
        cache(sched, tokens)
    for request_id in ("b0", "a1", "b1", "a2"):  # A and B weigh 2 each; b0 arrived first
        sched.add(seq(request_id, arrivals[request_id]))
    assert order(sched) == ["b0", "b1", "a1", "a2"]


def test_dfs_weight_places_a_hit_inside_an_edge_with_that_edge() -> None:
    """A prefix cached by one request only is one long edge, not yet split: a hit that ends
    partway through it belongs to its subtree (not to the root, with the nothing-cached)."""
    sched = make_scheduler("dfs-weight")
    for tokens in (A1, B):  # A1 is a single 12-token edge
        cache(sched, tokens)
    arrivals = {
        "b0": B + [1],
        "p0": A + [2, 2, 2, 2, 2],  # 8 of A1's 12 tokens
        "n0": [7, 7, 7, 7, 7],
        "k0": A1 + [3],  # all 12
        "p1": A + [4, 4, 4, 4, 4],
    }
    for request_id, tokens in arrivals.items():
        sched.add(seq(request_id, tokens))
    edge = sched.kv.tree.root.children[tuple(A[:P])]
    assert edge.key == A1
    assert [sched.kv.peek(s) for s in sched.waiting][1:4] == [
        (8, edge),
        (0, sched.kv.tree.root),
        (12, edge),
    ]
    assert order(sched) == ["p0", "k0", "p1", "b0", "n0"]


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_preempted_requests_go_first(policy: str) -> None:
    sched = scheduler_with_queue(policy)
    resumed = [s for s in sched.waiting if s.request_id in ("r0", "r6")]
    for s in resumed:
        s.preemptions = 1
    rest = [r for r in (LPM_ORDER if policy == "lpm" else DFS_ORDER) if r not in ("r0", "r6")]
    assert order(sched) == ["r0", "r6"] + rest  # resumed in queue order, then the policy's


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_arrival_order_without_prefix_cache_or_past_the_queue_limit(policy: str) -> None:
    sched = make_scheduler(policy, prefix_cache=False)
    for request_id, tokens in WAITING.items():
        sched.add(seq(request_id, tokens))
    assert order(sched) == FCFS_ORDER
    sched = scheduler_with_queue(policy)
    assert order(sched) != FCFS_ORDER
    for i in range(LPM_MAX_QUEUE + 1 - len(WAITING)):
        sched.add(seq(f"x{i}", [50 + i % 100, 1, 2, 3, 4]))
    assert len(sched.waiting) == LPM_MAX_QUEUE + 1
    assert order(sched) == [s.request_id for s in sched.waiting]  # arrival order


def test_scheduler_helpers_leave_the_tree_untouched() -> None:
    """Ordering only peeks: no node is split, locked or refreshed."""
    sched = scheduler_with_queue("dfs-weight")
    nodes, pages = sched.kv.tree.num_nodes(), sorted(sched.kv.tree.all_pages())
    order(sched)
    assert sched.kv.tree.num_nodes() == nodes and sorted(sched.kv.tree.all_pages()) == pages
    assert sched.kv.tree.protected_size == 0
    assert all(s.status is SeqStatus.WAITING for s in sched.waiting)


# -- the engine (tiny random model): cached tokens under a small pool ----------------------------
def toks(seed: int, n: int) -> list[int]:
    return torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def engine_for(tiny_model, policy: str, **knobs) -> Engine:
    knobs.setdefault("page_size", P)
    return Engine(tiny_model, dtype="float32", schedule_policy=policy, **knobs)


def test_cache_first_policies_keep_a_hit_that_fcfs_evicts(tiny_model) -> None:
    """A 48-token prefix X is cached (split by two earlier requests); then S1 (X + 8), N (64 new
    tokens) and S2 (X + 8) arrive together in a 96-token pool. fcfs admits S1 (hit) and a first
    chunk of N, which takes the rest of the pool; S2 waits, and N's later chunks push X out
    once S1 is done, so S2 misses. lpm and dfs-weight admit S1 and S2 first (both hits, X
    locked), then N."""
    X = toks(1, 48)
    warm = [X + toks(2, 8), X + toks(3, 8)]
    S1, N, S2 = X + toks(5, 8), toks(4, 64), X + toks(6, 8)
    hits, texts = {}, {}
    for policy in ("fcfs", "lpm", "dfs-weight"):
        engine = engine_for(tiny_model, policy, kv_cache_tokens=96)
        engine.generate(warm, GREEDY)
        outs = engine.generate([S1, N, S2], GREEDY)
        hits[policy] = [o.cached_tokens for o in outs]
        texts[policy] = [o.token_ids for o in outs]
        engine.check_integrity()
    assert hits["lpm"] == hits["dfs-weight"] == [48, 0, 48]
    assert hits["fcfs"][0] == 48 and hits["fcfs"][2] < 48, hits["fcfs"]
    assert texts["lpm"] == texts["dfs-weight"] == texts["fcfs"]


def test_shared_prefix_workload_caches_more_than_fcfs(tiny_model) -> None:
    """Three system prompts, four questions each, arriving interleaved (X Y Z X Y Z ...), two
    slots and a pool of about two prompts: the cache-aware policies keep serving the group
    whose prefix is cached, fcfs thrashes between groups."""
    systems = [toks(10 + g, 40) for g in range(3)]
    prompts = [systems[g] + toks(100 + 10 * g + q, 6) for q in range(4) for g in range(3)]
    cached, outputs = {}, {}
    for policy in ("fcfs", "lpm", "dfs-weight"):
        engine = engine_for(tiny_model, policy, kv_cache_tokens=128, max_running_requests=2)
        outs = engine.generate(prompts, GREEDY)
        cached[policy] = engine.stats()["cached_tokens_total"]
        outputs[policy] = [o.token_ids for o in outs]
        engine.check_integrity()
    assert cached["lpm"] > cached["fcfs"] and cached["dfs-weight"] > cached["fcfs"], cached
    assert outputs["lpm"] == outputs["dfs-weight"] == outputs["fcfs"]


def _mixed_run(
    tiny_model,
    first: dict[str, list[int]],
    later: dict[str, list[int]],
    max_tokens: int,
    **knobs,
) -> tuple[list[tuple[int, int]], dict[str, list[int]]]:
    """``first`` is prefilled in one step and decodes from then on, ``later`` arrives after it
    (fcfs, a 64-token step): (decodes, prefill tokens) of every step, and each request's greedy
    tokens; the engine's integrity is checked after every step."""
    engine = engine_for(tiny_model, "fcfs", chunked_prefill_tokens=64, **knobs)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    steps: list[tuple[int, int]] = []
    schedule = engine.scheduler.schedule

    def recording():
        batch = schedule()
        decodes = sum(1 for s, n in batch.entries if n == 1 and not s.in_prefill)
        steps.append((decodes, batch.num_tokens - decodes))
        return batch

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    out: dict[str, list[int]] = {k: [] for k in [*first, *later]}
    for k, p in first.items():
        engine.add_request(k, p, params)
    pending = engine.step()
    for k, p in later.items():
        engine.add_request(k, p, params)
    while engine.has_unfinished():
        for o in pending + engine.step():
            out[o.request_id].extend(o.new_token_ids)
        pending = []
        engine.check_integrity()
    return steps, out


def test_a_step_that_decodes_carries_at_most_mixed_prefill_tokens(tiny_model) -> None:
    """Decodes wait for their step: beside them a prefill gets ``mixed_prefill_tokens`` at most,
    while a step with no decode uses the whole ``chunked_prefill_tokens``; outputs are the same
    as with one budget for both (greedy)."""
    first, later = {"a": toks(1, 6)}, {"b": toks(2, 150), "c": toks(3, 90)}
    steps, tokens = _mixed_run(tiny_model, first, later, 12, mixed_prefill_tokens=8)
    mixed = [p for d, p in steps if d and p]
    assert mixed and max(mixed) <= 8, steps
    assert any(p > 8 for d, p in steps if not d), "a step without decodes keeps the whole budget"
    wide, same = _mixed_run(tiny_model, first, later, 12, mixed_prefill_tokens=64)
    assert max(p for d, p in wide if d) > 8  # the knob is what made the difference
    assert tokens == same


def _mixed_steps(
    tiny_model, waiting: int, **knobs
) -> tuple[list[tuple[int, int]], dict[str, list[int]]]:
    """Three short requests decode while ``waiting`` long prompts arrive."""
    first = {f"d{i}": toks(10 + i, 6) for i in range(3)}
    later = {f"w{i}": toks(20 + i, 150) for i in range(waiting)}
    return _mixed_run(tiny_model, first, later, 8, **knobs)


@pytest.mark.parametrize(
    ("waiting", "knobs", "first_mixed"),
    [
        (1, {}, 64 * 1 // 4),  # 1 waiting beside 3 decodes: a quarter of the 64-token budget
        (3, {}, 64 * 3 // 6),  # 3 waiting beside 3 decodes: half of it
        (1, {"mixed_prefill_min_tokens": 24}, 24),  # the floor
        (3, {"mixed_prefill_tokens": 20, "mixed_prefill_min_tokens": 8}, 20),  # the cap
        (1, {"mixed_prefill_tokens": 40, "mixed_prefill_min_tokens": 40}, 40),  # fixed budget
    ],
)
def test_a_step_that_decodes_gives_prefill_the_waiting_requests_share(
    tiny_model, waiting: int, knobs: dict[str, int], first_mixed: int
) -> None:
    """Beside d decodes a step carries chunked_prefill_tokens x w / (w + d) prefill tokens for w
    requests waiting for a first token, within [mixed_prefill_min_tokens, mixed_prefill_tokens]
    (default floor 512 is above this test's 64-token budget: the knobs set a small one), and the
    greedy tokens are those of a fixed budget."""
    knobs = {"mixed_prefill_min_tokens": 1, **knobs}
    steps, out = _mixed_steps(tiny_model, waiting, **knobs)
    assert steps[1] == (3, first_mixed), steps
    _, fixed = _mixed_steps(tiny_model, waiting, mixed_prefill_tokens=64)
    assert out == fixed


def test_a_burst_tail_that_fits_one_step_runs_in_one_step(tiny_model) -> None:
    """Beside 3 decodes, waiting requests whose uncached rest all fits in what the step can
    carry (64 - 3 tokens) run in that one step instead of their share of it (2 of 5: 25
    tokens); the rest counts past each prompt's cached prefix. Greedy tokens as a fixed
    budget's."""
    knobs = {"mixed_prefill_min_tokens": 1}
    first = {f"d{i}": toks(10 + i, 6) for i in range(3)}
    short = {"w0": toks(20, 20), "w1": toks(21, 20)}  # 40 tokens: all fit in 61
    steps, out = _mixed_run(tiny_model, first, short, 8, **knobs)
    assert steps[1] == (3, 40), steps
    _, fixed = _mixed_run(tiny_model, first, short, 8, mixed_prefill_tokens=64)
    assert out == fixed
    # 62-token prompts on a 40-token prefix that a decoding request cached: 2 x 22 <= 61
    prefix = toks(30, 40)
    first = {"d0": prefix + toks(10, 2), "d1": toks(11, 6), "d2": toks(12, 6)}
    cached = {"w0": prefix + toks(20, 22), "w1": prefix + toks(21, 22)}
    steps, out = _mixed_run(tiny_model, first, cached, 8, **knobs)
    assert steps[:2] == [(0, 54), (3, 44)], steps
    _, fixed = _mixed_run(tiny_model, first, cached, 8, mixed_prefill_tokens=64)
    assert out == fixed


def test_engine_config_refuses_a_bad_mixed_prefill_floor() -> None:
    with pytest.raises(ValueError, match="mixed_prefill_min_tokens"):
        EngineConfig(mixed_prefill_min_tokens=0).validate()
