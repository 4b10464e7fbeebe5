"""Several processes on one disk directory (issue 28): a store opening the directory never removes
another live process's temporary files, and two processes writing at once lose and corrupt
nothing. Real processes (multiprocessing, spawn), no mocks."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

from radixkv.cache.disk_store import DiskStore

FP = hashlib.sha256(b"model-a").digest()
PAGES = 300


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def payload(i: int) -> bytes:
    return hashlib.sha256(b"page %d" % i).digest() * 64  # 2 KB, a function of the key only


def _writer(path: str, first: int, ready: mp.Event, go: mp.Event, errors: mp.Queue) -> None:
    store = DiskStore(path, 1 << 30, FP)
    ready.set()
    go.wait(30)
    for i in range(first, first + PAGES):
        store.put(key(i), payload(i))
        # reopening the directory (as a replica starting up does) while the other one writes
        if i % 50 == 0:
            DiskStore(path, 1 << 30, FP, background=False).close()
    store.close()
    errors.put(store.counters["write_errors"])


def test_two_processes_write_one_directory_at_once(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    ready = [ctx.Event(), ctx.Event()]
    go = ctx.Event()
    errors: mp.Queue = ctx.Queue()
    # overlapping keys: both write pages 150..299, each its own 0..149 / 300..449
    procs = [
        ctx.Process(target=_writer, args=(str(tmp_path), first, ready[n], go, errors))
        for n, first in enumerate((0, PAGES // 2))
    ]
    for p in procs:
        p.start()
    for r in ready:
        assert r.wait(60)
    go.set()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert [errors.get(timeout=5), errors.get(timeout=5)] == [0, 0]  # no write failed
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    reader = DiskStore(tmp_path, 1 << 30, FP, background=False)
    for i in range(PAGES + PAGES // 2):
        assert reader.get(key(i)) == payload(i), i  # every page there, verified, intact
    reader.check_integrity()
    assert reader.counters.get("corrupt", 0) == 0


def test_opening_a_directory_keeps_a_live_writers_temp_file_and_removes_a_dead_ones(
    tmp_path: Path,
) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        page = key(1).hex() + ".kv"
        live = tmp_path / f"{page}.{sleeper.pid}.{'ab' * 8}.tmp"
        dead_pid = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dead = tmp_path / f"{page}.{dead_pid}.{'cd' * 8}.tmp"
        for f in (live, dead):
            f.write_bytes(b"half-written")
        os.chmod(tmp_path, 0o700)
        DiskStore(tmp_path, 1 << 20, FP, background=False).close()
        assert live.exists(), "another live process's file was removed"
        assert not dead.exists(), "a dead writer's leftover was kept"
    finally:
        sleeper.kill()
        sleeper.wait()
