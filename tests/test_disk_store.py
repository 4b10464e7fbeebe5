"""DiskStore: atomic files, verified reads, LRU bound, restart, bounded writer queue (no torch)."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from radixkv.cache.allocator import IntegrityError
from radixkv.cache.disk_store import HEADER, DiskStore, chain_hashes

FP = hashlib.sha256(b"model-a").digest()
FP2 = hashlib.sha256(b"model-b").digest()


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def store(path: Path, cap: int = 1 << 20, fp: bytes = FP, **kw) -> DiskStore:
    return DiskStore(path, cap, fp, **kw)


def test_roundtrip_restart_and_no_temp_files(tmp_path: Path) -> None:
    s = store(tmp_path)
    for i in range(5):
        assert s.put(key(i), bytes([i]) * 100)
    s.sync()
    assert s.num_files == 5 and s.num_bytes == 5 * (HEADER.size + 100)
    assert not s.put(key(0), b"x" * 100)  # present: refresh only
    assert s.get(key(3)) == bytes([3]) * 100
    assert s.get(key(42)) is None
    s.check_integrity()
    s.close()
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    again = store(tmp_path, background=False)
    assert again.num_files == 5
    assert again.get(key(4)) == bytes([4]) * 100
    again.check_integrity()


def test_lru_eviction_respects_the_byte_bound(tmp_path: Path) -> None:
    size = HEADER.size + 100
    s = store(tmp_path, cap=3 * size, background=False)
    for i in range(3):
        s.put(key(i), b"a" * 100)
    s.get(key(0))  # 0 is now the most recent: 1 goes first
    s.put(key(3), b"b" * 100)
    assert s.contains(key(0)) and not s.contains(key(1))
    assert s.num_bytes <= 3 * size and s.counters["evicted_files"] == 1
    assert len(list(tmp_path.glob("*.kv"))) == 3
    s.put(key(9), b"c" * (4 * size))  # larger than the whole store: never kept
    assert not s.contains(key(9)) and s.num_bytes <= 3 * size
    s.check_integrity()
    # a restart over budget trims the oldest files
    small = store(tmp_path, cap=2 * size, background=False)
    assert small.num_files == 2 and small.num_bytes <= 2 * size


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("flip", "checksum"),
        ("truncate", "truncated"),
        ("short_header", "truncated"),
        ("magic", "format"),
        ("other_model", "fingerprint"),
        ("renamed", "key"),
    ],
)
def test_bad_files_are_detected_counted_and_removed(tmp_path: Path, damage, reason) -> None:
    s = store(tmp_path, background=False)
    s.put(key(1), b"payload" * 20)
    s.put(key(2), b"other" * 20)
    f1 = Path(s._file(key(1)))
    data = bytearray(f1.read_bytes())
    if damage == "flip":
        data[-1] ^= 1
    elif damage == "truncate":
        data = data[:-3]
    elif damage == "short_header":
        data = data[:10]
    elif damage == "magic":
        data[0:8] = b"NOTAKV!!"
    if damage == "other_model":
        o = store(tmp_path / "o", fp=FP2, background=False)
        o.put(key(1), b"payload" * 20)
        data = bytearray(Path(o._file(key(1))).read_bytes())
    if damage == "renamed":
        data = bytearray(Path(s._file(key(2))).read_bytes())
    f1.write_bytes(bytes(data))
    fresh = store(tmp_path, background=False)  # as after a restart
    assert fresh.get(key(1)) is None
    assert fresh.counters["corrupt_files"] == 1
    assert fresh.counters[f"corrupt_{reason}"] == 1
    assert not f1.exists() and not fresh.contains(key(1))
    assert fresh.get(key(2)) is not None  # the others are fine
    fresh.check_integrity()


def test_full_writer_queue_drops_and_counts(tmp_path: Path) -> None:
    gate = threading.Event()

    def slow() -> bytes:
        gate.wait(10)
        return b"z" * 10

    s = store(tmp_path, max_pending=1)
    assert s.put(key(0), slow)  # taken by the writer, which blocks on the gate
    accepted = sum(s.put(key(i), b"y" * 10) for i in range(1, 6))
    assert accepted <= 2 and s.counters["writes_dropped"] >= 3
    gate.set()
    s.sync()
    assert s.contains(key(0))
    s.check_integrity()
    s.close()


def test_chain_hashes_name_prefixes() -> None:
    a = chain_hashes(FP, list(range(40)), 8)
    b = chain_hashes(FP, list(range(32)) + [7] * 8, 8)
    assert len(a) == 5 and a[:4] == b[:4] and a[4] != b[4]
    assert chain_hashes(FP, list(range(40)), 8, salt="u1")[0] != a[0]
    assert chain_hashes(FP2, list(range(40)), 8)[0] != a[0]
    assert chain_hashes(FP, list(range(40)), 8, num_pages=2) == a[:2]


def test_simulation_mode_and_integrity_errors(tmp_path: Path) -> None:
    sim = DiskStore(None, 10 * (HEADER.size + 4), FP)
    for i in range(20):
        sim.put(key(i), 4)
    assert sim.num_files == 10 and sim.get(key(19)) == b"" and sim.get(key(0)) is None
    sim.check_integrity()
    sim._bytes += 1
    with pytest.raises(IntegrityError):
        sim.check_integrity()
    with pytest.raises(ValueError):
        DiskStore(tmp_path, 0, FP)
    with pytest.raises(ValueError):
        DiskStore(tmp_path, 10, b"short")
