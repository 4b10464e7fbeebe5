"""The disk tier against someone who can reach its directory (no torch). Each test is an attack
(a planted or forged page, another user reading or owning the directory, a symlink where a
file will be written or read, a huge file) and checks that ordinary traffic still works."""

from __future__ import annotations

import hashlib
import os
import struct
import tracemalloc
import zlib
from pathlib import Path

import pytest

from radixkv.cache import disk_store
from radixkv.cache.disk_store import MAGIC, DiskStore
from radixkv.cache.kv_mac import KEY_FILE_NAME, MAC_KEY_ENV, configured_mac_key, seal

FP = hashlib.sha256(b"model-a").digest()
SECRET = b"the-replicas-shared-secret-0123456789"
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to another uid")


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def page(i: int) -> bytes:
    return bytes([i % 251]) * 300


def store(path: Path, **kw) -> DiskStore:
    kw.setdefault("background", False)
    return DiskStore(path, 1 << 20, FP, **kw)


def mode(path: Path) -> int:
    return os.lstat(path).st_mode & 0o777


def test_a_planted_file_signed_with_another_secret_is_a_miss_and_removed(tmp_path: Path) -> None:
    s = store(tmp_path / "cache")
    for i in range(3):
        s.put(key(i), page(i))
    victim = Path(s._file(key(1)))
    # the attacker knows the model and the tokens (so the key and the fingerprint) but not the
    # secret: a well-formed file (magic, fingerprint, key, length, crc all right), wrong MAC
    forged = b"\x00" * 300
    victim.write_bytes(seal(MAGIC, FP, key(1), forged, b"a-guess-at-the-secret-000") + forged)
    # the same from another store of the same model with a secret of its own
    other = store(tmp_path / "other")
    other.put(key(2), forged)
    os.replace(other._file(key(2)), s._file(key(2)))
    fresh = store(tmp_path / "cache")  # as after a restart: the planted files are indexed
    assert fresh.get(key(1)) is None and fresh.get(key(2)) is None
    assert fresh.counters["corrupt_mac"] == 2 and fresh.counters["corrupt_files"] == 2
    assert not victim.exists() and not fresh.contains(key(2))  # removed
    assert fresh.get(key(0)) == page(0)  # ordinary traffic: the store's own page is served
    fresh.check_integrity()


def test_a_page_written_with_the_shared_secret_is_a_hit_elsewhere(tmp_path: Path) -> None:
    a = store(tmp_path / "a", mac_key=SECRET)
    b = store(tmp_path / "b", mac_key=SECRET)
    a.put(key(7), page(7))
    os.link(a._file(key(7)), b._file(key(7)))
    again = store(tmp_path / "b", mac_key=SECRET)
    assert again.get(key(7)) == page(7) and again.counters["corrupt_files"] == 0
    # without a given secret each directory has its own key file, kept across restarts
    c = store(tmp_path / "c")
    c.put(key(8), page(8))
    assert store(tmp_path / "c").get(key(8)) == page(8)
    assert c.mac_key == (tmp_path / "c" / KEY_FILE_NAME).read_bytes().strip()
    assert c.mac_key != store(tmp_path / "d").mac_key


def test_files_of_the_previous_format_are_misses(tmp_path: Path) -> None:
    s = store(tmp_path)
    s.put(key(1), page(1))
    old = struct.Struct("<8sI32s32sQI")  # format 1: crc32 only
    body = page(1)
    Path(s._file(key(1))).write_bytes(
        old.pack(b"RKVPAGE1", 1, FP, key(1), len(body), zlib.crc32(body)) + body
    )
    assert s.get(key(1)) is None and s.counters["corrupt_format"] == 1
    s.put(key(1), page(1))  # written again in the current format
    assert s.get(key(1)) == page(1)


def test_the_directory_and_files_are_private_under_umask_022(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        root = tmp_path / "new" / "cache"
        s = DiskStore(root, 1 << 20, FP)  # the background writer
        for i in range(4):
            s.put(key(i), page(i))
        s.sync()
        assert mode(root) == 0o700
        names = os.listdir(root)
        assert sorted(names) == sorted([KEY_FILE_NAME] + [key(i).hex() + ".kv" for i in range(4)])
        assert all(mode(root / n) == 0o600 for n in names), {n: oct(mode(root / n)) for n in names}
        assert s.get(key(3)) == page(3)
        s.close()
    finally:
        os.umask(old)


def test_a_directory_others_can_read_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o755)
    with pytest.raises(ValueError, match=r"mode 755.*chmod 700"):
        store(d)
    d.chmod(0o700)  # the fix the message names
    s = store(d)
    s.put(key(1), page(1))
    assert s.get(key(1)) == page(1)


@as_root
def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, NOBODY, NOBODY)
    with pytest.raises(ValueError, match=f"owned by uid {NOBODY}"):
        store(d)
    # a symlink of another user standing for the directory
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(mine)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(ValueError, match=f"symlink owned by uid {NOBODY}"):
        store(link)
    os.lchown(link, os.geteuid(), os.getegid())  # this user's own symlink to its directory: fine
    s = store(link)
    s.put(key(1), page(1))
    assert s.get(key(1)) == page(1)


def test_a_symlink_at_the_temporary_name_is_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = tmp_path / "cache"
    s = store(d)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    # make the temporary name predictable (it is random) and plant a symlink there
    monkeypatch.setattr(disk_store.secrets, "token_hex", lambda n=None: "feedfacefeedface")
    tmp = f"{s._file(key(1))}.{os.getpid()}.feedfacefeedface.tmp"
    os.symlink(victim, tmp)
    assert s.put(key(1), page(1))
    assert s.counters["write_errors"] == 1 and not s.contains(key(1))
    assert victim.read_bytes() == b"precious" and os.path.islink(tmp)  # untouched, not removed
    os.remove(tmp)
    monkeypatch.undo()
    s.put(key(1), page(1))  # the next write, under a fresh name, works
    assert s.get(key(1)) == page(1)
    s.check_integrity()


def test_a_symlink_or_fifo_in_a_pages_place_is_not_read(tmp_path: Path) -> None:
    s = store(tmp_path / "cache")
    for i in range(3):
        s.put(key(i), page(i))
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"not a page")
    os.replace(s._file(key(0)), tmp_path / "elsewhere")
    os.symlink(secret, s._file(key(0)))
    os.remove(s._file(key(1)))
    os.mkfifo(s._file(key(1)), 0o600)  # an open for reading would block without O_NONBLOCK
    assert s.get(key(0)) is None and s.get(key(1)) is None
    assert s.counters["corrupt_format"] == 2
    assert not os.path.lexists(s._file(key(0))) and secret.read_bytes() == b"not a page"
    assert s.get(key(2)) == page(2)
    # a restart indexes regular files only
    os.symlink(secret, s._file(key(5)))
    assert not store(tmp_path / "cache").contains(key(5))


def test_an_oversized_file_is_never_read_into_memory(tmp_path: Path) -> None:
    s = store(tmp_path / "cache")
    s.put(key(1), page(1))
    s.put(key(2), page(2))
    os.truncate(s._file(key(1)), 256 << 20)  # a sparse 256 MiB file under a page's name
    tracemalloc.start()
    try:
        assert s.get(key(1)) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak  # refused on its size (the store's capacity), unread
    assert s.counters["corrupt_oversize"] == 1 and not os.path.exists(s._file(key(1)))
    # one byte more than a header and a page, when the caller names the page size
    with open(s._file(key(2)), "ab") as f:
        f.write(b"x")
    assert s.get(key(2), expect_len=len(page(2))) is None
    assert s.counters["corrupt_oversize"] == 2
    s.put(key(3), page(3))
    assert s.get(key(3), expect_len=len(page(3))) == page(3)


def test_the_key_file_must_be_private_and_long_enough(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "kv.key"
    f.write_bytes(SECRET + b"\n")
    f.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        configured_mac_key(str(f))
    f.chmod(0o600)
    assert configured_mac_key(str(f)) == SECRET
    f.write_bytes(b"short\n")
    with pytest.raises(ValueError, match="at least 16"):
        configured_mac_key(str(f))
    with pytest.raises(ValueError, match="does not exist"):
        configured_mac_key(str(tmp_path / "missing"))
    monkeypatch.setenv(MAC_KEY_ENV, SECRET.decode())
    assert configured_mac_key() == SECRET
    s = store(tmp_path / "cache")  # the environment's secret: no key file is created
    assert s.mac_key == SECRET and not (tmp_path / "cache" / KEY_FILE_NAME).exists()
    # a symlink planted as the directory's key file is refused, never followed
    monkeypatch.delenv(MAC_KEY_ENV)
    d = tmp_path / "planted"
    d.mkdir(mode=0o700)
    (d / KEY_FILE_NAME).symlink_to(f)
    with pytest.raises(ValueError, match="KV MAC key file"):
        store(d)
