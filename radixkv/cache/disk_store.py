"""Disk tier: KV pages as files in a directory, keyed by chained prefix hashes (no torch).

One file per page, named ``<key hex>.kv`` where ``key`` (32 bytes) is the page's chained hash:
``h_i = sha256(h_{i-1} | salt | tokens of page i)`` with ``h_{-1} = sha256(fingerprint)`` (see
:func:`chain_hashes`), so a key names a whole page-aligned prefix of one model. File layout (see
:mod:`radixkv.cache.kv_mac`)::

    header  = struct "<8sI32s32sQI32s": magic b"RKVPAGE2", format version 2, fingerprint (32 B),
              key (32 B), payload length, crc32 of the payload, HMAC-SHA256 (32 B) keyed by the
              replicas' secret over the other header fields and the payload
    payload = the page's K and V bytes (opaque here)

The directory is private: created with mode 0700, and an existing one must belong to this user
and be closed to group and others (``ValueError`` otherwise). Without a given secret, the MAC key
is the directory's ``kv_mac.key`` (created 0600 on first start, kept across restarts).

Files are written atomically (a temporary file in the same directory, named after the process
and a random token, created ``O_EXCL | O_NOFOLLOW`` with mode 0600, then ``os.replace``), by a
background writer thread fed through a bounded queue (a full queue drops the write and counts it:
the decode loop never waits on the disk). Reads are synchronous and verified: a file is opened
``O_NOFOLLOW``, must be a regular file no larger than a page can be (checked before reading), and
one that is truncated, corrupt (crc), of an older format, written for another model
(fingerprint), under another name (key) or with another secret (MAC: planted or forged) is
counted in ``stats()["corrupt_files"]`` (and by reason), removed, and reported as a miss.

The store is bounded by ``capacity_bytes`` (whole file sizes, headers included) and evicts least
recently used files (reads and re-writes refresh). It survives restarts: the index is rebuilt from
the directory at startup (regular ``*.kv`` files only), oldest modification time first; leftover
temporary files are removed.

``DiskStore(None, ...)`` is a directory-less, data-less store (keys and sizes only) for the
simulator.

Invariants (:meth:`check_integrity`): ``num_bytes`` is the sum of the indexed sizes and at most
``capacity_bytes``; with no write pending, no temporary file is left in the directory.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import queue
import secrets
import stat
import struct
import threading
import time
import weakref
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

from radixkv.cache.allocator import IntegrityError
from radixkv.cache.kv_mac import (
    HEADER,
    MIN_KEY_BYTES,
    REASONS,
    configured_mac_key,
    dir_mac_key,
    seal,
    verify,
)
from radixkv.cache.private_files import read_capped, secure_dir, write_new_file, writer_alive

__all__ = ["DiskStore", "HEADER", "MAGIC", "MAX_FILE_BYTES", "chain_hashes"]

logger = logging.getLogger(__name__)

MAGIC = b"RKVPAGE2"
SUFFIX = ".kv"
_TMP = ".tmp"
#: no file larger than this is ever read (nor one larger than the store's capacity, nor, when the
#: caller names the page size, one larger than a header and a page)
MAX_FILE_BYTES = 1 << 30


def _remove(path: str) -> None:
    """Remove ``path``; a file already gone is fine."""
    with contextlib.suppress(OSError):
        os.remove(path)


def _salt_bytes(salt: Hashable) -> bytes:
    if salt is None:
        return b""
    if isinstance(salt, str):
        return b"s" + salt.encode("utf-8", "surrogatepass")  # any str hashes, never raises
    return b"r" + repr(salt).encode("utf-8", "surrogatepass")


def chain_hashes(
    fingerprint: bytes,
    tokens: Sequence[int],
    page_size: int,
    salt: Hashable = None,
    num_pages: int | None = None,
    *,
    prev: bytes | None = None,
) -> list[bytes]:
    """Chained page hashes of ``tokens``: ``out[i]`` names the prefix ``tokens[:(i+1)*P]``.

    ``h_i = sha256(h_{i-1} + len(salt) + salt + int64 tokens of page i)``, ``h_{-1} =
    sha256(b"radixkv" + fingerprint)``. Only full pages are hashed (at most ``num_pages``).
    ``prev`` continues a chain: the hash of the page just before ``tokens`` (``h_{-1}`` when
    ``None``), so ``chain_hashes(fp, a + b, P) == x + chain_hashes(fp, b, P, prev=x[-1])`` for
    ``x = chain_hashes(fp, a, P)`` and page-aligned ``a``.
    """
    n = len(tokens) // page_size
    if num_pages is not None:
        n = min(n, num_pages)
    sb = _salt_bytes(salt)
    sb = struct.pack("<I", len(sb)) + sb
    h = hashlib.sha256(b"radixkv" + fingerprint).digest() if prev is None else prev
    out: list[bytes] = []
    tok = list(tokens[: n * page_size])
    for i in range(n):
        page = array("q", tok[i * page_size : (i + 1) * page_size]).tobytes()
        h = hashlib.sha256(h + sb + page).digest()
        out.append(h)
    return out


class DiskStore:
    """A bounded, persistent, LRU file store of page payloads keyed by 32-byte chained hashes.

    Args:
        path: directory (created if missing); ``None`` = simulation (no files, no data).
        capacity_bytes: bound on the bytes of all files (header included).
        fingerprint: 32 bytes identifying the model / dtype / page layout; written into every
            header and checked on every read.
        background: write through a writer thread (default) instead of synchronously.
        max_pending: bound of the writer queue (writes beyond it are dropped and counted).
        mac_key: the secret keying every file's MAC (at least 16 bytes); default:
            ``$RADIXKV_KV_MAC_KEY``, else the directory's ``kv_mac.key`` (created on first use).

    Raises ``ValueError`` for a directory others may use (see :func:`~.private_files.secure_dir`).

    Thread safety: one engine thread calls everything; the writer thread only touches the index
    under ``_lock``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        capacity_bytes: int,
        fingerprint: bytes,
        background: bool = True,
        max_pending: int = 1024,
        mac_key: bytes | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if len(fingerprint) != 32:
            raise ValueError("fingerprint must be 32 bytes (a sha256 digest)")
        self.path = None if path is None else os.fspath(path)
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, LRU first
        self._bytes = 0
        self._pending: set[bytes] = set()
        self.counters: dict[str, int] = {
            "writes": 0,
            "write_bytes": 0,
            "writes_dropped": 0,
            "write_errors": 0,
            "reads": 0,
            "read_bytes": 0,
            "misses": 0,
            "evicted_files": 0,
            "corrupt_files": 0,
            **{f"corrupt_{r}": 0 for r in (*REASONS, "oversize")},
        }
        self._queue: queue.Queue[tuple[bytes, Any] | None] | None = None
        self._thread: threading.Thread | None = None
        if mac_key is not None and len(mac_key) < MIN_KEY_BYTES:
            raise ValueError(f"mac_key must have at least {MIN_KEY_BYTES} bytes")
        self.mac_key = mac_key or b""
        if self.path is not None:
            secure_dir(self.path)
            self.mac_key = mac_key or configured_mac_key() or dir_mac_key(self.path)
            self._scan()
            if background:
                self._queue = queue.Queue(maxsize=max(1, max_pending))
                self._thread = threading.Thread(
                    target=self._writer, name="radixkv-disk-writer", daemon=True
                )
                self._thread.start()
                # finish queued writes at interpreter exit (a server shut down cleanly)
                ref = weakref.ref(self)
                atexit.register(lambda: (s := ref()) is not None and s.close())

    # ------------------------------------------------------------------ index
    def _file(self, key: bytes) -> str:
        assert self.path is not None
        return os.path.join(self.path, key.hex() + SUFFIX)

    def _scan(self) -> None:
        """Rebuild the index from the directory (oldest first); remove temporary leftovers of
        writers that are gone (another live process writing the same directory keeps its own)."""
        assert self.path is not None
        entries: list[tuple[float, bytes, int]] = []
        for name in os.listdir(self.path):
            full = os.path.join(self.path, name)
            if name.endswith(_TMP):
                with contextlib.suppress(OSError):  # gone meanwhile: its writer published it
                    if not writer_alive(name[: -len(_TMP)], os.lstat(full).st_mtime):
                        _remove(full)
                continue
            if not name.endswith(SUFFIX) or len(name) != 64 + len(SUFFIX):
                continue
            try:
                key = bytes.fromhex(name[:64])
                st = os.lstat(full)
            except (ValueError, OSError):
                continue
            if not stat.S_ISREG(st.st_mode):
                continue  # a symlink, a FIFO, a directory: never a page
            entries.append((st.st_mtime, key, st.st_size))
        entries.sort()
        for _, key, size in entries:
            self._index[key] = size
            self._bytes += size
        with self._lock:
            self._shrink(None)

    def _shrink(self, keep: bytes | None) -> None:
        """Evict LRU files until within capacity (``_lock`` held); never evicts ``keep``."""
        while self._bytes > self.capacity_bytes and self._index:
            key = next(iter(self._index))
            if key == keep:
                if len(self._index) == 1:
                    break
                self._index.move_to_end(key)
                continue
            size = self._index.pop(key)
            self._bytes -= size
            self.counters["evicted_files"] += 1
            if self.path is not None:
                _remove(self._file(key))

    def _record(self, key: bytes, size: int) -> None:
        with self._lock:
            old = self._index.pop(key, None)
            if old is not None:
                self._bytes -= old
            self._index[key] = size
            self._bytes += size
            if size > self.capacity_bytes:  # can never fit
                self._index.pop(key)
                self._bytes -= size
                self.counters["evicted_files"] += 1
                if self.path is not None:
                    _remove(self._file(key))
                return
            self._shrink(key)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size

    # ------------------------------------------------------------------ queries
    def contains(self, key: bytes) -> bool:
        """True when a file for ``key`` is indexed (it may still turn out corrupt on read)."""
        return key in self._index

    def touch(self, key: bytes) -> None:
        """Mark ``key`` most recently used (no-op when absent)."""
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)

    def pending(self, key: bytes) -> bool:
        """True when a write of ``key`` is queued and not finished yet."""
        return key in self._pending

    @property
    def num_files(self) -> int:
        return len(self._index)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    # ------------------------------------------------------------------ writes
    def put(self, key: bytes, payload: Any, wait: float | None = None) -> bool:
        """Store ``payload`` (bytes, or a zero-argument callable returning bytes, evaluated by the
        writer) under ``key``. Already stored or queued: refresh the LRU position and return
        False. Returns False when the write was dropped (queue full), True when accepted.
        ``wait`` (seconds): wait that long for room in a full queue before dropping (the
        shutdown flush); ``None`` never waits (the decode loop)."""
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return False
        if key in self._pending:
            return False
        if self.path is None:  # simulation: the payload is its size
            size = payload if isinstance(payload, int) else len(payload)
            self.counters["writes"] += 1
            self._record(key, HEADER.size + size)
            return True
        if self._queue is None:
            self._write(key, payload)
            return True
        try:
            self._pending.add(key)
            if wait is None:
                self._queue.put_nowait((key, payload))
            else:
                self._queue.put((key, payload), timeout=max(wait, 1e-3))
        except queue.Full:
            self._pending.discard(key)
            self.counters["writes_dropped"] += 1
            return False
        return True

    def _write(self, key: bytes, payload: Any) -> None:
        """Write one file (temporary name, then an atomic rename). A failure (disk full, the
        directory gone or read-only) is counted and logged, and leaves no temporary file."""
        tmp = None  # set once this write created it (never someone else's file)
        try:
            data = payload() if callable(payload) else payload
            header = seal(MAGIC, self.fingerprint, key, data, self.mac_key)
            final = self._file(key)
            name = f"{final}.{os.getpid()}.{secrets.token_hex(8)}{_TMP}"
            write_new_file(name, header, data)  # fails on anything planted at the name
            tmp = name
            os.replace(tmp, final)
        except Exception as exc:
            if tmp is not None:
                _remove(tmp)
            self.counters["write_errors"] += 1
            if self.counters["write_errors"] % 1000 == 1:
                logger.warning(
                    "disk tier: write failed (%s: %s); %d write errors so far (the page is "
                    "recomputed when needed)",
                    type(exc).__name__,
                    exc,
                    self.counters["write_errors"],
                )
            return
        self.counters["writes"] += 1
        self.counters["write_bytes"] += HEADER.size + len(data)
        self._record(key, HEADER.size + len(data))

    def _writer(self) -> None:
        assert self._queue is not None
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, payload = item
                self._write(key, payload)
                self._pending.discard(key)
            finally:
                self._queue.task_done()

    def sync(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is on disk (at most ``timeout`` seconds when given);
        True when the queue is drained."""
        q = self._queue
        if q is None:
            return True
        if timeout is None:
            q.join()
            return True
        deadline = time.monotonic() + timeout
        with q.all_tasks_done:
            while q.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                q.all_tasks_done.wait(left)
        return True

    # ------------------------------------------------------------------ reads
    def get(self, key: bytes, expect_len: int | None = None) -> bytes | None:
        """The verified payload stored under ``key``, or None (missing or bad: a bad file is
        counted by reason, removed and forgotten). ``expect_len``: the payload length a page
        has (a larger file is refused before any of it is read). Refreshes the LRU position."""
        if key not in self._index:
            self.counters["misses"] += 1
            return None
        if self.path is None:
            with self._lock:
                if key in self._index:
                    self._index.move_to_end(key)
            self.counters["reads"] += 1
            return b""
        limit = min(self.capacity_bytes, MAX_FILE_BYTES)
        if expect_len is not None:
            limit = min(limit, HEADER.size + expect_len)
        try:  # a symlink, a non-file or an oversized file is refused before reading
            data, reason = read_capped(self._file(key), limit)
        except OSError:
            self._forget(key)
            self.counters["misses"] += 1
            return None
        if data is None:
            self.discard(key, reason or "format")
            return None
        reason = verify(data, MAGIC, self.fingerprint, key, self.mac_key, expect_len)
        if reason is not None:
            self.discard(key, reason)
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        self.counters["reads"] += 1
        self.counters["read_bytes"] += len(data)
        return data[HEADER.size :]

    def discard(self, key: bytes, reason: str | None = None) -> None:
        """Remove ``key``'s file; with a ``reason`` (one of :data:`~.kv_mac.REASONS`, or
        ``oversize``) it is counted as a corrupt file."""
        self._forget(key)
        if self.path is not None:
            _remove(self._file(key))
        if reason is not None:
            self.counters["corrupt_files"] += 1
            name = f"corrupt_{reason}"
            self.counters[name] = self.counters.get(name, 0) + 1

    def clear(self) -> None:
        """Remove every file of the store (after finishing queued writes)."""
        self.sync()
        with self._lock:
            keys = list(self._index)
        for key in keys:
            self.discard(key)

    def close(self, timeout: float | None = None) -> bool:
        """Finish queued writes and stop the writer thread (idempotent). With ``timeout``, give
        up waiting after that many seconds (writes still queued are lost; a file being written
        stays a temporary file, removed at the next start). True when everything was written."""
        done = True
        if self._queue is not None and self._thread is not None:
            done = self.sync(timeout)
            if done:
                self._queue.put(None)
                self._thread.join(timeout=10 if timeout is None else max(timeout, 0.1))
            self._queue = None
            self._thread = None
        return done

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "files": self.num_files,
            "bytes": self.num_bytes,
            "capacity_bytes": self.capacity_bytes,
            "pending_writes": len(self._pending),
        }
        out.update(self.counters)
        return out

    def check_integrity(self) -> None:
        """Verify the invariants of the module docstring; raises :class:`IntegrityError`."""
        with self._lock:
            index = dict(self._index)
            total = self._bytes
        if sum(index.values()) != total:
            raise IntegrityError(f"disk bytes {total} != sum of indexed sizes")
        if total > self.capacity_bytes:
            raise IntegrityError(f"disk store holds {total} > capacity {self.capacity_bytes}")
        if self.path is None or self._pending:
            return
        # files may be damaged from outside at any time (that is detected on read); what we
        # control is that no temporary file outlives its write.
        try:
            names = os.listdir(self.path)
        except OSError:  # the directory went away or became unreadable: nothing can be left
            return
        leftovers = [n for n in names if n.endswith(_TMP)]
        if leftovers:
            raise IntegrityError(f"temporary files left behind: {leftovers[:3]}")

    def __repr__(self) -> str:
        return (
            f"DiskStore(path={self.path!r}, files={self.num_files}, bytes={self.num_bytes}, "
            f"capacity={self.capacity_bytes})"
        )
