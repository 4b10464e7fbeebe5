from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixkv.cache.allocator import BlockAllocator, IntegrityError
from radixkv.cache.eviction import check_entry_order
from radixkv.cache.radix_tree import RadixTree, TreeEvents, TreeNode


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(num_pages: int = 64, page_size: int = 1, policy: str = "lru", clock: Any = None):
    alloc = BlockAllocator(num_pages, page_size)
    tree = RadixTree(alloc, page_size, policy, clock=clock or FakeClock())
    return alloc, tree


def put(tree: RadixTree, alloc: BlockAllocator, tokens: list[int], salt: Hashable = None) -> int:
    """Insert like a request that did not match first: allocate, insert, free duplicates."""
    P = tree.page_size
    pages = alloc.allocate(len(tokens) // P)
    ret = tree.insert(tokens, pages, salt)
    alloc.free(pages[: ret // P])
    return ret


def cached_prefixes(tree: RadixTree) -> dict[tuple[Hashable, tuple[int, ...]], int]:
    """(salt, page-aligned prefix) -> page holding the last page of that prefix, by tree walk."""
    P = tree.page_size
    out: dict[tuple[Hashable, tuple[int, ...]], int] = {}

    def rec(node: TreeNode, salt: Hashable, prefix: tuple[int, ...]) -> None:
        for child in node.children.values():
            if child.is_namespace:
                rec(child, child.salt, ())
                continue
            for i, page in enumerate(child.value):
                out[(salt, prefix + tuple(child.key[: (i + 1) * P]))] = page
            rec(child, salt, prefix + tuple(child.key))

    rec(tree.root, None, ())
    return out


def check_all(tree: RadixTree, alloc: BlockAllocator) -> None:
    tree.check_integrity()
    alloc.check_integrity()
    pages = tree.all_pages()
    assert len(pages) == len(set(pages))
    # nobody but the tree holds pages between operations in these tests
    assert alloc.num_used == len(pages)
    assert all(alloc.refcount(p) == 1 for p in pages)
    assert tree.total_size == len(pages) * tree.page_size
    assert tree.evictable_size + tree.protected_size == tree.total_size


# ---------------------------------------------------------------------------- basics
@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_insert_match_basic(page_size: int) -> None:
    alloc, tree = make(page_size=page_size)
    seq = list(range(100, 117))  # 17 tokens: not a page multiple for 2 and 4
    n = len(seq) - len(seq) % page_size
    assert put(tree, alloc, seq) == 0
    m = tree.match_prefix(seq)
    assert m.num_tokens == n and len(m.pages) == n // page_size
    assert m.node is not tree.root
    # a second insert of the same tokens reports everything present
    assert put(tree, alloc, seq) == n
    # diverging in the middle of the edge splits it
    other = seq[:8] + [1] * 8
    assert put(tree, alloc, other) == 8
    m2 = tree.match_prefix(other)
    assert m2.num_tokens == 16 and m2.pages[: 8 // page_size] == m.pages[: 8 // page_size]
    check_all(tree, alloc)


def test_page_alignment() -> None:
    alloc, tree = make(page_size=4)
    put(tree, alloc, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # caches 8 tokens
    assert tree.total_size == 8
    # the query matches 6 tokens, but only one full page counts
    m = tree.match_prefix([1, 2, 3, 4, 5, 6, 0, 0])
    assert m.num_tokens == 4 and len(m.pages) == 1
    # a query shorter than a page matches nothing
    assert tree.match_prefix([1, 2, 3]).num_tokens == 0
    # match ends mid-edge: node is split so the handle's path is exactly the match
    assert len(m.node.key) == 4 and m.node.parent is tree.root
    check_all(tree, alloc)


def test_partial_page_finds_the_child_page_that_starts_like_the_rest() -> None:
    alloc, tree = make(page_size=4)
    put(tree, alloc, [1, 2, 3, 4, 5, 6, 7, 8])
    put(tree, alloc, [1, 2, 3, 4, 5, 9, 9, 9])
    put(tree, alloc, [1, 2, 3, 4, 5, 6, 7, 0], salt="other")
    before = cached_prefixes(tree)
    m = tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 1])
    assert m.num_tokens == 4
    page, r = tree.partial_page(m.node, [1, 2, 3, 4, 5, 6, 7, 1], 4, 3)
    assert r == 3 and page == before[(None, (1, 2, 3, 4, 5, 6, 7, 8))]
    assert tree.partial_page(m.node, [1, 2, 3, 4, 5, 6, 7, 1], 4, 2)[1] == 2  # at most limit
    assert tree.partial_page(m.node, [1, 2, 3, 4, 2, 6], 4, 3) == (-1, 0)  # no child starts so
    # from the root: the first pages of the salted namespace only
    page, r = tree.partial_page(tree.root, [1, 2, 3, 0], 0, 3, salt="other")
    assert r == 3 and page == before[("other", (1, 2, 3, 4))]
    assert tree.partial_page(tree.root, [1, 2, 3, 0], 0, 3, salt="absent") == (-1, 0)
    assert cached_prefixes(tree) == before  # changes nothing
    check_all(tree, alloc)


def test_match_does_not_change_cached_set() -> None:
    alloc, tree = make(page_size=2)
    put(tree, alloc, [1, 2, 3, 4, 5, 6, 7, 8])
    before = cached_prefixes(tree)
    tree.match_prefix([1, 2, 3, 4, 9, 9])
    assert cached_prefixes(tree) == before
    check_all(tree, alloc)


def test_insert_requires_enough_pages() -> None:
    alloc, tree = make(page_size=2)
    with pytest.raises(ValueError, match="needs 2 pages"):
        tree.insert([1, 2, 3, 4], [0])


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="eviction_policy"):
        RadixTree(None, 1, "random")
    with pytest.raises(ValueError, match="page_size"):
        RadixTree(BlockAllocator(4, 2), 4)


# ---------------------------------------------------------------------------- eviction order
def test_lru_order() -> None:
    alloc, tree = make()
    a, b, c = [1, 1, 1], [2, 2, 2], [3, 3, 3]
    for s in (a, b, c):
        put(tree, alloc, s)
    tree.match_prefix(a)  # a is now the most recent
    assert tree.evict(1) == 3
    assert tree.match_prefix(b).num_tokens == 0  # b (oldest untouched) went first
    assert tree.match_prefix(a).num_tokens == 3
    tree.match_prefix(c)  # c newest, a older
    tree.evict(1)
    assert tree.match_prefix(a).num_tokens == 0 and tree.match_prefix(c).num_tokens == 3
    check_all(tree, alloc)


def test_lfu_order() -> None:
    alloc, tree = make(policy="lfu")
    a, b, c = [1, 1], [2, 2], [3, 3]
    for s in (a, b, c):
        put(tree, alloc, s)
    for _ in range(3):
        tree.match_prefix(a)
    tree.match_prefix(b)
    tree.match_prefix(c)
    tree.match_prefix(c)
    tree.evict(1)  # b has the fewest hits
    assert tree.match_prefix(b).num_tokens == 0
    tree.evict(1)  # now c (2+1 hits) vs a (3+1 hits)
    assert tree.match_prefix(c).num_tokens == 0 and tree.match_prefix(a).num_tokens == 2
    check_all(tree, alloc)


def test_fifo_order_ignores_access() -> None:
    alloc, tree = make(policy="fifo")
    a, b, c = [1, 1], [2, 2], [3, 3]
    for s in (a, b, c):
        put(tree, alloc, s)
    for _ in range(5):
        tree.match_prefix(a)
    tree.evict(1)
    assert tree.match_prefix(a).num_tokens == 0
    assert tree.match_prefix(b).num_tokens == 2
    tree.evict(1)
    assert tree.match_prefix(b).num_tokens == 0 and tree.match_prefix(c).num_tokens == 2
    check_all(tree, alloc)


def test_parent_becomes_evictable_after_children() -> None:
    alloc, tree = make()
    put(tree, alloc, [1, 2, 3, 4])
    put(tree, alloc, [1, 2, 5, 6])
    assert tree.evict(1) == 2  # one leaf (2 tokens)
    assert tree.evict(3) == 4  # the other leaf then the shared parent
    assert tree.total_size == 0 and alloc.num_free == alloc.num_pages
    check_all(tree, alloc)


def test_evict_frees_pages_and_calls_hook() -> None:
    alloc, tree = make(page_size=2)
    seen: list[tuple[int, list[int], list[int]]] = []

    def hook(node: TreeNode, pages: list[int]) -> None:
        # called before the pages are freed: the tree still holds them
        seen.append((len(node.key), list(pages), [alloc.refcount(p) for p in pages]))

    tree.observe(TreeEvents(on_evict=hook))
    with pytest.raises(RuntimeError, match="already has an observer"):
        tree.observe(TreeEvents())
    put(tree, alloc, [1, 2, 3, 4, 5])
    assert tree.evict(100) == 4
    assert seen == [(4, [0, 1], [1, 1])]
    assert alloc.num_free == alloc.num_pages
    check_all(tree, alloc)


def test_simulation_mode_without_allocator() -> None:
    tree = RadixTree(None, 2)
    assert tree.insert([1, 2, 3, 4], [10, 11]) == 0
    assert tree.match_prefix([1, 2, 3, 4]).pages == [10, 11]
    assert tree.evict(4) == 4 and tree.total_size == 0
    tree.check_integrity()


# ---------------------------------------------------------------------------- locks
def test_lock_protects_matched_path_only() -> None:
    alloc, tree = make(page_size=2)
    put(tree, alloc, [1, 2, 3, 4, 5, 6, 7, 8])
    m = tree.match_prefix([1, 2, 3, 4, 0, 0])  # splits after 4 tokens
    tree.lock(m.node)
    assert tree.protected_size == 4 and tree.evictable_size == 4
    check_all(tree, alloc)
    assert tree.evict(100) == 4  # only the unlocked tail goes
    assert tree.match_prefix([1, 2, 3, 4]).num_tokens == 4
    assert tree.evict(100) == 0
    check_all(tree, alloc)
    tree.unlock(m.node)
    assert tree.evictable_size == 4 and tree.protected_size == 0
    assert tree.evict(100) == 4
    check_all(tree, alloc)
    with pytest.raises(ValueError, match="not locked"):
        tree.unlock(m.node)


def test_split_inherits_lock() -> None:
    alloc, tree = make()
    put(tree, alloc, [1, 2, 3, 4, 5, 6])
    m = tree.match_prefix([1, 2, 3, 4, 5, 6])
    tree.lock(m.node)
    tree.lock(m.node)
    put(tree, alloc, [1, 2, 3, 9])  # splits the locked edge after 3 tokens
    check_all(tree, alloc)
    assert m.node.parent.lock_ref == 2 and m.node.lock_ref == 2
    assert tree.protected_size == 6 and tree.evictable_size == 1
    tree.unlock(m.node)
    tree.unlock(m.node)
    assert tree.protected_size == 0 and tree.evictable_size == 7
    check_all(tree, alloc)


def test_lock_root_is_noop() -> None:
    alloc, tree = make()
    m = tree.match_prefix([1, 2])
    assert m.node is tree.root and m.num_tokens == 0 and m.pages == []
    tree.lock(m.node)
    tree.unlock(m.node)
    check_all(tree, alloc)


# ---------------------------------------------------------------------------- salts / pins / reset
def test_salt_isolation() -> None:
    alloc, tree = make(page_size=2)
    seq = [1, 2, 3, 4]
    assert put(tree, alloc, seq, salt="alice") == 0
    assert tree.match_prefix(seq).num_tokens == 0
    assert tree.match_prefix(seq, salt="bob").num_tokens == 0
    assert put(tree, alloc, seq, salt="bob") == 0  # nothing shared across salts
    assert put(tree, alloc, seq) == 0
    a = tree.match_prefix(seq, salt="alice").pages
    b = tree.match_prefix(seq, salt="bob").pages
    d = tree.match_prefix(seq).pages
    assert len({*a, *b, *d}) == 6
    check_all(tree, alloc)
    assert tree.evict(100) == 12
    assert not tree.root.children  # empty namespaces are dropped too
    check_all(tree, alloc)


def test_pin_and_expiry() -> None:
    clock = FakeClock()
    alloc, tree = make(clock=clock)
    put(tree, alloc, [1, 2, 3, 4])
    put(tree, alloc, [5, 6])
    assert tree.pin([1, 2, 3, 9], ttl=10) == 3  # pins the cached prefix [1, 2, 3]
    assert tree.num_pins == 1 and tree.protected_size == 3
    check_all(tree, alloc)
    assert tree.evict(100) == 3  # [4] and [5, 6]
    assert tree.match_prefix([1, 2, 3]).num_tokens == 3
    clock.now = 9.9
    assert tree.evict(100) == 0
    clock.now = 10.0  # expired: dropped lazily
    check_all(tree, alloc)
    assert tree.num_pins == 0
    assert tree.evict(100) == 3
    check_all(tree, alloc)


def test_pin_without_ttl_and_unpin() -> None:
    clock = FakeClock()
    alloc, tree = make(clock=clock)
    put(tree, alloc, [1, 2, 3])
    assert tree.pin([1, 2, 3]) == 3
    assert tree.pin([1, 2, 3], ttl=1) == 3  # does not shorten an unlimited pin
    assert tree.pin([7]) == 0  # nothing cached: nothing pinned
    clock.now = 1000.0
    assert tree.evict(100) == 0
    assert tree.reset() == 0
    assert tree.unpin([1, 2, 3, 4]) == 1
    assert tree.unpin([1, 2, 3]) == 0
    assert tree.evict(100) == 3
    check_all(tree, alloc)


def test_pin_budgets_count_path_unions_and_refuse_without_change() -> None:
    from radixkv.cache.pins import PinBudgetError

    clock = FakeClock()
    alloc, tree = make(clock=clock)
    put(tree, alloc, [1, 2, 3, 4])
    put(tree, alloc, [1, 2, 5, 6])
    put(tree, alloc, [1, 2, 3], salt="t")
    assert tree.pin([1, 2, 3, 4], budget=4) == 4
    # [1, 2] is shared with the first pin: the second adds [5, 6] only -> 6 tokens held
    with pytest.raises(PinBudgetError, match="6 tokens .* budget of 5"):
        tree.pin([1, 2, 5, 6], budget=5)
    assert tree.num_pins == 1 and tree.pinned_tokens() == 4  # the refusal changed nothing
    check_all(tree, alloc)
    assert tree.pin([1, 2, 5, 6], budget=6) == 4
    assert tree.pinned_tokens() == 6 and tree.pinned_tokens(whole_tree=True) == 6
    # a namespace has a budget of its own; the whole tree's counts it too
    with pytest.raises(PinBudgetError, match="this namespace"):
        tree.pin([1, 2, 3], salt="t", namespace_budget=2)
    with pytest.raises(PinBudgetError, match="the server"):
        tree.pin([1, 2, 3], salt="t", budget=8)
    assert tree.pin([1, 2, 3], salt="t", budget=9, namespace_budget=3) == 3
    assert tree.pinned_tokens("t") == 3 and tree.pinned_tokens(whole_tree=True) == 9
    assert tree.pin([1, 2, 3, 4], budget=0) == 4  # re-pinning (extending) is never refused
    check_all(tree, alloc)
    assert tree.unpin_all() == 3
    assert tree.num_pins == 0 and tree.pinned_tokens(whole_tree=True) == 0
    assert tree.evict(100) == 9
    check_all(tree, alloc)


def test_pin_extend() -> None:
    clock = FakeClock()
    alloc, tree = make(clock=clock)
    put(tree, alloc, [1, 2])
    tree.pin([1, 2], ttl=5)
    tree.pin([1, 2], ttl=20)
    clock.now = 6
    assert tree.evict(100) == 0
    clock.now = 20
    assert tree.evict(100) == 2
    check_all(tree, alloc)


def test_reset_keeps_locked_and_pinned() -> None:
    alloc, tree = make(page_size=2)
    put(tree, alloc, [1, 2, 3, 4, 5, 6])
    put(tree, alloc, [7, 8, 9, 10], salt="s")
    put(tree, alloc, [11, 12])
    m = tree.match_prefix([1, 2, 3, 4])
    tree.lock(m.node)
    tree.pin([11, 12])
    assert tree.reset() == 2 + 4  # [5, 6] and the whole salt "s"
    assert set(cached_prefixes(tree)) == {(None, (1, 2)), (None, (1, 2, 3, 4)), (None, (11, 12))}
    check_all(tree, alloc)
    tree.unlock(m.node)
    tree.unpin([11, 12])
    assert tree.reset() == 6
    assert tree.total_size == 0 and alloc.num_free == alloc.num_pages
    check_all(tree, alloc)


def test_integrity_catches_corruption() -> None:
    alloc, tree = make()
    put(tree, alloc, [1, 2, 3])
    put(tree, alloc, [1, 2, 4])
    tree.eviction._evictable += 1  # corrupt the count the index keeps
    with pytest.raises(IntegrityError, match="evictable_size"):
        tree.check_integrity()
    tree.eviction._evictable -= 1
    leaf = tree.match_prefix([1, 2, 3]).node
    leaf.last_access += 100  # changed without re-sorting
    with pytest.raises(IntegrityError, match="stale"):
        tree.check_integrity()


def test_entry_order_check_catches_disorder_and_foreign_entries() -> None:
    """``check_order``'s check (public iteration only, no sortedcontainers internals)."""
    a, b = TreeNode([1], [0], None, uid=1), TreeNode([2], [1], None, uid=2)
    ea, eb = (1, a.uid, a), (2, b.uid, b)
    a.evict_entry, b.evict_entry = ea, eb
    check_entry_order([ea, eb], "evict_entry")
    with pytest.raises(AssertionError, match="out of order"):
        check_entry_order([eb, ea], "evict_entry")
    with pytest.raises(AssertionError, match="not its entry"):
        check_entry_order([ea, (3, b.uid, b)], "evict_entry")


# ---------------------------------------------------------------------------- property test
SALTS = [None, "a", "b"]
token_seqs = st.lists(st.integers(0, 2), min_size=0, max_size=10)
ops_strategy = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.sampled_from(SALTS), token_seqs),
        st.tuples(st.just("match"), st.sampled_from(SALTS), token_seqs, st.booleans()),
        st.tuples(st.just("unlock"), st.integers(0, 10)),
        st.tuples(st.just("evict"), st.integers(0, 12)),
        st.tuples(
            st.just("pin"), st.sampled_from(SALTS), token_seqs, st.sampled_from([None, 1, 3])
        ),
        st.tuples(st.just("unpin"), st.sampled_from(SALTS), token_seqs),
        st.tuples(st.just("tick"), st.integers(0, 3)),
        st.tuples(st.just("reset")),
    ),
    max_size=30,
)


def _longest(ref: dict, salt: Hashable, seq: list[int], P: int) -> int:
    k = len(seq) - len(seq) % P
    while k > 0 and (salt, tuple(seq[:k])) not in ref:
        k -= P
    return k


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    policy=st.sampled_from(["lru", "lfu", "fifo"]),
    ops=ops_strategy,
)
def test_random_operations_against_reference(page_size: int, policy: str, ops: list) -> None:
    P = page_size
    clock = FakeClock()
    alloc, tree = make(num_pages=24, page_size=P, policy=policy, clock=clock)
    ref: dict[tuple[Hashable, tuple[int, ...]], int] = {}  # cached prefix -> page
    held: list[tuple[TreeNode, Hashable, tuple[int, ...]]] = []  # lock handles
    pins: dict[tuple[Hashable, tuple[int, ...]], float] = {}  # pinned prefix -> expiry

    def protected_prefixes() -> set:
        out = set()
        live = [(s, p) for (s, p), exp in pins.items() if exp > clock.now]
        for s, p in [(s, p) for _, s, p in held] + live:
            for k in range(P, len(p) + 1, P):
                out.add((s, p[:k]))
        return out

    for op in ops:
        kind = op[0]
        if kind == "insert":
            _, salt, seq = op
            n = len(seq) - len(seq) % P
            expected = _longest(ref, salt, seq, P)
            need = n // P
            if not alloc.can_allocate(need):
                tree.evict((need - alloc.num_free) * P)
                ref = {k: v for k, v in cached_prefixes(tree).items()}
                expected = _longest(ref, salt, seq, P)
            if alloc.can_allocate(need):
                pages = alloc.allocate(need)
                ret = tree.insert(seq, pages, salt)
                assert ret == expected
                alloc.free(pages[: ret // P])
                for i in range(ret // P, n // P):
                    ref[(salt, tuple(seq[: (i + 1) * P]))] = pages[i]
        elif kind == "match":
            _, salt, seq, do_lock = op
            m = tree.match_prefix(seq, salt)
            k = _longest(ref, salt, seq, P)
            assert m.num_tokens == k
            assert m.pages == [ref[(salt, tuple(seq[: (i + 1) * P]))] for i in range(k // P)]
            if k == 0:
                assert m.node is tree.root
            if do_lock:
                tree.lock(m.node)
                if k:
                    held.append((m.node, salt, tuple(seq[:k])))
        elif kind == "unlock":
            if held:
                node, _, _ = held.pop(op[1] % len(held))
                tree.unlock(node)
        elif kind == "evict":
            must_keep = protected_prefixes()
            ret = tree.evict(op[1])
            now = cached_prefixes(tree)
            assert all(now[k] == ref[k] for k in now)  # only removals, same pages
            assert (len(ref) - len(now)) * P == ret
            assert must_keep <= set(now)
            if ret < op[1]:
                assert tree.evictable_size == 0
            ref = now
        elif kind == "pin":
            _, salt, seq, ttl = op
            k = _longest(ref, salt, seq, P)
            assert tree.pin(seq, salt, ttl) == k
            if k:
                key = (salt, tuple(seq[:k]))
                old = pins.get(key, float("-inf"))
                if old <= clock.now:
                    old = float("-inf")
                pins[key] = max(old, float("inf") if ttl is None else clock.now + ttl)
        elif kind == "unpin":
            _, salt, seq = op
            k = _longest(ref, salt, seq, P)
            gone = [
                key
                for key, exp in pins.items()
                if key[0] == salt and exp > clock.now and tuple(seq[:k])[: len(key[1])] == key[1]
            ]
            assert tree.unpin(seq, salt) == len(gone)
            for key in gone:
                del pins[key]
        elif kind == "tick":
            clock.now += op[1]
        elif kind == "reset":
            must_keep = protected_prefixes()
            tree.reset()
            now = cached_prefixes(tree)
            assert set(now) == must_keep
            ref = now
        pins = {k: v for k, v in pins.items() if v > clock.now}
        check_all(tree, alloc)
        assert set(cached_prefixes(tree)) == set(ref)


@pytest.mark.parametrize("page_size", [1, 4])
def test_peek_prefix_agrees_with_match_and_changes_nothing(page_size):
    alloc, tree = make(num_pages=64, page_size=page_size)
    P = page_size
    a = list(range(100, 100 + 8 * P))
    b = a[: 4 * P] + list(range(500, 500 + 4 * P))
    for seq in (a, b):
        tree.insert(seq, alloc.allocate(len(seq) // P))
    probes = [a, b, a[: 6 * P] + [9] * (2 * P), a[: 4 * P + 1], [7] * (3 * P), a[:P] + [1]]
    nodes_before = tree.num_nodes()
    peeked = [tree.peek_prefix(probe)[0] for probe in probes]
    assert tree.num_nodes() == nodes_before, "peek must not split nodes"
    assert peeked == [tree.match_prefix(probe).num_tokens for probe in probes]
    # peek does not refresh LRU: the first-inserted leaf is still evicted first
    alloc2, tree2 = make(num_pages=64, page_size=P)
    x, y = [1] * (2 * P), [2] * (2 * P)
    tree2.insert(x, alloc2.allocate(2))
    tree2.insert(y, alloc2.allocate(2))
    tree2.peek_prefix(x)
    tree2.evict(2 * P)
    assert tree2.match_prefix(x).num_tokens == 0 and tree2.match_prefix(y).num_tokens == 2 * P
    tree.check_integrity()
    tree2.check_integrity()
