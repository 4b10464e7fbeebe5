"""The child-process pool and per-key bound that the template sandbox and the grammar compiler
share (radixkv/engine/child_pool.py): a spent child is killed and replaced, a closed pool kills
its children, each key is bounded and the keyless key (None) is not."""

from __future__ import annotations

import pytest

from radixkv.engine.child_pool import ChildPool, KeyLimit

MODULE = "radixkv.engine.template_sandbox"  # a child that renders templates: cheap to start


def test_a_spent_child_is_killed_and_replaced_and_a_kept_one_reused() -> None:
    pool = ChildPool(MODULE, 256 << 20, 1)
    pool.start({})
    try:
        first = pool.lend(5)
        assert first is not None and pool.lend(0.05) is None  # size 1: none left to lend
        pool.check_integrity()
        pool.give_back(first, keep=True)
        again = pool.lend(5)
        assert again is first
        pool.give_back(again, keep=False)  # spent: killed, counted, replaced
        assert not first.alive() and pool.killed == 1
        fresh = pool.lend(5)
        assert fresh is not None and fresh is not first and fresh.alive()
        fresh.kill()  # died while lent: given back "kept", it is still replaced
        pool.give_back(fresh, keep=True)
        assert pool.killed == 2 and len(pool.pids()) == 1
        pool.check_integrity()
    finally:
        pool.close()
    assert pool.pids() == []


def test_a_closed_pool_kills_idle_children_now_and_lent_ones_on_return() -> None:
    pool = ChildPool(MODULE, 256 << 20, 2)
    pool.start({})
    lent = pool.lend(5)
    assert lent is not None
    idle_pids = set(pool.pids()) - {lent.pid}
    pool.close()
    assert pool.pids() == [lent.pid] and idle_pids
    pool.give_back(lent, keep=True)
    assert not lent.alive() and pool.pids() == []
    with pytest.raises(RuntimeError, match="closed"):
        pool.start({})


def test_each_key_is_bounded_and_the_keyless_key_is_not() -> None:
    keys = KeyLimit(1)
    assert keys.acquire("a") and not keys.acquire("a") and keys.acquire("b")
    assert all(keys.acquire(None) for _ in range(10)) and keys.in_flight(None) == 0
    assert keys.total() == 2
    keys.check_integrity()
    keys.release("a")
    keys.release(None)
    assert keys.acquire("a") and keys.in_flight("a") == 1
    with pytest.raises(ValueError):
        KeyLimit(0)
