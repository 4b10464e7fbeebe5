"""Background commit of the KV pool (radixkv.model.prefault): contents never change, the thread
waits for idle time, commits everything when left alone, and stops when asked."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from radixkv.model import hugepages
from radixkv.model.hugepages import huge_zeros, populate
from radixkv.model.prefault import Prefaulter

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")


def _resident_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@linux
def test_populate_commits_memory_without_changing_a_byte():
    t = huge_zeros((16 << 20,), torch.uint8)  # 16 MB of lazily zeroed memory
    t[5] = 7
    t[(9 << 20) + 3] = 9
    before = _resident_kb()
    if not populate(t, 0, t.numel()):
        pytest.skip("MADV_POPULATE_WRITE is unsupported by this kernel")
    assert _resident_kb() - before >= 12 << 10  # most of the 16 MB is resident now
    assert int(t[5]) == 7 and int(t[(9 << 20) + 3]) == 9
    assert int(t.sum()) == 16  # everything else still reads as zero


def test_populate_refuses_empty_ranges_and_other_devices():
    t = huge_zeros((16 << 20,), torch.uint8)
    assert not populate(t, t.numel(), 100)  # past the end
    meta = torch.empty(10, device="meta")
    assert not populate(meta, 0, 10)


@linux
def test_prefaulter_waits_for_idle_then_commits_everything_and_keeps_contents():
    tensors = [huge_zeros((4 << 20,), torch.float32) for _ in range(3)]  # 3 x 16 MB
    for i, t in enumerate(tensors):
        t[i * 1000] = i + 1.5
    idle = threading.Event()
    pf = Prefaulter(tensors, idle.is_set)
    pf.start()
    time.sleep(0.3)
    assert pf.committed == 0  # busy the whole time: nothing done
    idle.set()
    deadline = time.monotonic() + 30
    while not pf.done and time.monotonic() < deadline:
        time.sleep(0.02)
    pf.stop()
    if not pf.supported:
        pytest.skip("MADV_POPULATE_WRITE is unsupported by this kernel")
    assert pf.committed == pf.total == 3 * (16 << 20)
    for i, t in enumerate(tensors):
        assert float(t[i * 1000]) == i + 1.5 and float(t.abs().sum()) == i + 1.5


def test_prefaulter_stops_while_waiting_for_idle(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(hugepages, "populate", lambda *a: calls.append(1) or True)
    pf = Prefaulter([huge_zeros((4 << 20,), torch.float32)], lambda: False)
    pf.start()
    start = time.monotonic()
    pf.stop(timeout=5)
    assert time.monotonic() - start < 1.0
    assert pf._thread is not None and not pf._thread.is_alive()
    assert not calls and pf.committed == 0


@linux
def test_a_server_with_prefault_commits_its_pool_while_idle_and_keeps_serving():
    """``create_app(prefault_kv=True)`` on the real engine (tiny Llama): the pool is committed in
    idle time, and a request served afterwards answers as one served before."""
    import httpx
    from fake_engine import ServerThread
    from test_server import build_tiny_engine

    from radixkv.server.app import create_app

    engine = build_tiny_engine()
    app = create_app(engine, model_name="tiny", prefault_kv=True)
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 4, "temperature": 0}
    with ServerThread(app) as srv:
        first = httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=30).json()
        pf = app.state.prefaulter
        deadline = time.monotonic() + 30
        while not pf.done and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pf.supported, "MADV_POPULATE_WRITE failed on this host"
        assert pf.committed == pf.total > 0
        again = httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=30).json()
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert create_app(engine, model_name="tiny").state.prefaulter is None  # off by default


@linux
def test_commit_pool_commits_an_engines_whole_pool_before_a_burst(tiny_model):
    """bench_w1's start-up (``commit_pool``): every K/V byte of the pool becomes resident (a
    fresh pool is lazily zeroed: nothing of it is), and no byte changes."""
    from radixkv import Engine
    from radixkv.model.prefault import commit_pool, pool_tensors

    engine = Engine(tiny_model, kv_cache_tokens=1 << 18)  # tensors over huge_zeros's minimum
    tensors = pool_tensors(engine)
    total = sum(t.untyped_storage().nbytes() for t in tensors)
    assert tensors and total >= 8 << 20
    before = _resident_kb()
    committed = commit_pool(engine)
    if committed == 0:
        pytest.skip("MADV_POPULATE_WRITE is unsupported by this kernel")
    grown = (_resident_kb() - before) * 1024
    assert committed == total and grown >= 0.9 * total, (committed, grown, total)
    assert all(float(t.abs().sum()) == 0 for t in tensors)  # contents unchanged (fresh pool)
