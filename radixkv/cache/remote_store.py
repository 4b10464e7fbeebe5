"""The remote KV tier: page payloads in a shared Redis, Valkey or Redis Cluster, below the host
and disk tiers.

Several engine replicas pointed at one Redis share their prefixes: a page one replica wrote is
found by every other one that meets the same tokens. Keys are the disk tier's chained page hashes
(:func:`~radixkv.cache.disk_store.chain_hashes`: model fingerprint, salt and every earlier token),
stored as ``namespace + key``; a value is a header (magic ``b"RKVREM02"``, version,
fingerprint, key, length, crc32 and an HMAC-SHA256 over them and the payload: the layout of
:mod:`radixkv.cache.kv_mac`) followed by the page payload. A read verifies all of it: a missing,
short, damaged, foreign or unauthenticated value is a miss (a bad one is counted by reason and
deleted), and the request recomputes from there. Keys can be computed by anyone who knows the
model and the tokens; the MAC keeps whoever can write to Redis from planting KV that replicas
would serve (``corrupt_mac``). Its secret, ``mac_key``: the engine's ``kv_mac_key_file``, else
``$RADIXKV_KV_MAC_KEY``, the disk tier's key file, else a random key of this process (a warning:
replicas then share nothing).

The URL (:mod:`radixkv.cache.remote_conn`) names one server (``redis://``, ``rediss://``,
``unix://``) or a Redis Cluster (``redis+cluster://HOST:PORT``, ``rediss+cluster://``), whose
keys spread over its masters by hash slot. A password comes in the URL
(``redis://:PASSWORD@HOST:PORT/DB``) or, when the URL has none, from ``$RADIXKV_REDIS_PASSWORD``
(how ``radixkv cluster`` gives it to replicas, off their command lines); stats, logs and errors
show the URL through :func:`redact_url`.

Redis bounds itself (``maxmemory`` + ``allkeys-lru``); this store never assumes a page is still
there. It keeps no index of the server's keys, only:

* ``_recent``: keys written (or read) in the last ``recent_ttl`` seconds (bounded), so a page is
  not sent twice in a row; it never answers a lookup, and it is forgotten when a shard comes back
  after being down (it may have restarted empty) and on :meth:`forget_recent` (the engine's
  cache flush);
* ``_pending``: keys queued for the writer thread (which batches ``SET``s into one pipeline per
  shard);
* ``health`` (:class:`~radixkv.cache.remote_health.ShardHealth`): the shards that are down,
  each with its probe backoff.

Lookups (:meth:`RemoteStore.get_prefix`) fetch a chain continuation in batches (one ``MGET``, or
one pipeline per cluster master) and stop at the first miss. A connection failure turns that
shard *down*: one warning is logged, its keys miss and its writes are dropped without touching
the network (the other shards of a cluster keep serving), and the writer thread probes it
(``PING``) with exponential backoff until it answers; then it is *up* again (logged once). The
store is :attr:`~RemoteStore.available` while at least one shard is up.

``RemoteStore(None, ...)`` is a server-less, data-less store (an LRU of keys bounded by
``capacity_pages``) for the simulator.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from radixkv.cache.allocator import IntegrityError
from radixkv.cache.kv_mac import (
    HEADER,
    MIN_KEY_BYTES,
    REASONS,
    configured_mac_key,
    process_mac_key,
    seal,
    verify,
)
from radixkv.cache.remote_conn import (
    PASSWORD_ENV,
    Shards,
    open_shards,
    parse_remote_url,
    redact_url,
)
from radixkv.cache.remote_health import ShardHealth

__all__ = ["PASSWORD_ENV", "REMOTE_MAGIC", "RemoteStore", "parse_remote_url", "redact_url"]

logger = logging.getLogger(__name__)

REMOTE_MAGIC = b"RKVREM02"
_REASONS = REASONS


class RemoteStore:
    """Page payloads in Redis under chained-hash keys; see the module docstring.

    Args:
        url: ``redis://HOST:PORT[/DB]`` or ``redis+cluster://HOST:PORT``; ``None`` = simulation
            (no server, no data).
        fingerprint: 32 bytes identifying the model / dtype / page layout (in every header).
        namespace: prefix of every Redis key this store writes.
        background: write through a writer thread (default) instead of synchronously.
        max_pending: bound of the writer queue (writes beyond it are dropped and counted).
        batch_pages: pages per lookup batch / per write batch.
        timeout: socket connect/read timeout in seconds.
        retry_min, retry_max: backoff bounds (seconds) of the probes while a shard is down.
        recent_ttl: seconds a written (or read) key is not written again.
        capacity_pages: simulation only: pages kept (LRU).
        mac_key: the secret keying every value's MAC (at least 16 bytes; see the module
            docstring for the default).

    Owns: ``health`` (:class:`~radixkv.cache.remote_health.ShardHealth`, the shards' up/down
    state), which shares ``_lock`` and ``counters`` and clears ``_recent`` when a shard comes back.

    Thread safety: one engine thread calls the public methods; the writer thread touches
    ``_pending``, ``_recent``, the down set and the counters under ``_lock``.
    """

    def __init__(
        self,
        url: str | None,
        fingerprint: bytes,
        namespace: bytes = b"radixkv:",
        background: bool = True,
        max_pending: int = 1024,
        batch_pages: int = 32,
        timeout: float = 1.0,
        retry_min: float = 0.25,
        retry_max: float = 10.0,
        recent_ttl: float = 30.0,
        capacity_pages: int = 0,
        mac_key: bytes | None = None,
    ) -> None:
        if len(fingerprint) != 32:
            raise ValueError("fingerprint must be 32 bytes (a sha256 digest)")
        if batch_pages < 1:
            raise ValueError(f"batch_pages must be >= 1, got {batch_pages}")
        if mac_key is not None and len(mac_key) < MIN_KEY_BYTES:
            raise ValueError(f"mac_key must have at least {MIN_KEY_BYTES} bytes")
        self.url = None if url is None else parse_remote_url(url)
        self.fingerprint = fingerprint
        self.namespace = namespace
        self.batch_pages = batch_pages
        self.max_pending = max(1, max_pending)
        self.recent_ttl = recent_ttl
        self.max_recent = 1 << 16
        self._lock = threading.Lock()
        self._pending: set[bytes] = set()
        self._recent: OrderedDict[bytes, float] = OrderedDict()
        self._sim: OrderedDict[bytes, int] | None = None
        self.mac_key = b""  # set below when there is a server
        self.capacity_pages = capacity_pages
        self.counters: dict[str, int] = {
            "writes": 0,  # pages stored
            "write_bytes": 0,
            "writes_dropped": 0,  # queue full
            "writes_failed": 0,  # the server failed during the write
            "writes_skipped_down": 0,  # not attempted: the store (or the page's shard) was down
            "lookups": 0,  # get_prefix calls that asked the server
            "lookups_skipped_down": 0,
            "hits": 0,  # verified pages returned
            "read_bytes": 0,
            "misses": 0,  # lookups that ended on a missing key
            "misses_down": 0,  # ... of which on a key of a shard that is down
            "corrupt_values": 0,
            **{f"corrupt_{r}": 0 for r in _REASONS},
            "went_down": 0,  # a shard turned down
            "came_back": 0,  # a shard answered again
        }
        self.health = ShardHealth(
            self.url, retry_min, retry_max, self._lock, self.counters, self._recent.clear
        )
        self._shards: Shards | None = None
        self._queue: queue.Queue[tuple[bytes, Any] | None] | None = None
        self._thread: threading.Thread | None = None
        if self.url is None:
            if capacity_pages < 1:
                raise ValueError("a simulated remote store needs capacity_pages >= 1")
            self._sim = OrderedDict()
            return
        self.mac_key = mac_key or configured_mac_key() or process_mac_key()
        # the URL's own password wins over the environment's
        self._shards = open_shards(self.url, os.environ.get(PASSWORD_ENV) or None, timeout)
        self.health.shards = self._shards
        failed = getattr(self._shards, "connect_error", None)
        if failed is not None:  # a cluster none of whose nodes answered: down, probes retry
            self.health.went_down(self._shards.names()[0], failed)
        if background:
            self._queue = queue.Queue(maxsize=self.max_pending)
            self._thread = threading.Thread(
                target=self._writer, name="radixkv-remote-writer", daemon=True
            )
            self._thread.start()

    @property
    def retry_min(self) -> float:
        """The probes' first backoff (seconds) while a shard is down; set it on the store or
        on :attr:`health`, one value."""
        return self.health.retry_min

    @retry_min.setter
    def retry_min(self, value: float) -> None:
        self.health.retry_min = value

    @property
    def retry_max(self) -> float:
        """The probes' longest backoff (seconds) while a shard is down (one value with
        :attr:`health`'s)."""
        return self.health.retry_max

    @retry_max.setter
    def retry_max(self, value: float) -> None:
        self.health.retry_max = value

    @property
    def available(self) -> bool:
        """True while at least one shard is believed up (no network call)."""
        return self.health.available

    def probe(self, force: bool = False) -> bool:
        """:meth:`ShardHealth.probe <radixkv.cache.remote_health.ShardHealth.probe>`: ``PING``
        the down shards whose backoff has passed; returns :attr:`available`."""
        return self.health.probe(force)

    def skipped_down(self, n: int) -> None:
        """Count ``n`` pages not sent because the store is down."""
        with self._lock:
            self.counters["writes_skipped_down"] += n

    @property
    def _errors(self) -> tuple[type[BaseException], ...]:
        return self._shards.errors if self._shards is not None else (OSError,)

    # ------------------------------------------------------------------ values
    def _rkey(self, key: bytes) -> bytes:
        return self.namespace + key

    def _pack(self, key: bytes, data: bytes) -> bytes:
        return seal(REMOTE_MAGIC, self.fingerprint, key, data, self.mac_key) + data

    def _remember(self, keys: Sequence[bytes]) -> None:
        """Note ``keys`` as known to be on the server now (written or read): not sent again
        for ``recent_ttl`` seconds."""
        t = time.monotonic()
        with self._lock:
            for key in keys:
                self._recent[key] = t
                self._recent.move_to_end(key)
            while len(self._recent) > self.max_recent:
                self._recent.popitem(last=False)

    # ------------------------------------------------------------------ writes
    def wants(self, key: bytes) -> bool:
        """False when ``key`` is queued or was written (or read) in the last ``recent_ttl``
        seconds."""
        if key in self._pending:
            return False
        t = self._recent.get(key)
        return t is None or time.monotonic() - t > self.recent_ttl

    def known(self, key: bytes) -> bool:
        """Held without asking the server: in the simulated LRU, or not :meth:`wants` (lately)."""
        return key in self._sim if self._sim is not None else not self.wants(key)

    def to_send(self, keys: Sequence[bytes]) -> list[int]:
        """Indices of the ``keys`` worth snapshotting for :meth:`put`: wanted (:meth:`wants`),
        on a shard that is up (the others are counted in ``writes_skipped_down``), and no more
        than the writer queue has room for (the rest are counted in ``writes_dropped``), so a
        slow or absent Redis costs the caller no copy."""
        todo = [i for i, key in enumerate(keys) if self.wants(key)]
        if not todo or self._sim is not None or self._shards is None:
            return todo
        where = self._shards.locate([self._rkey(keys[i]) for i in todo])
        up = [i for i, shard in zip(todo, where, strict=True) if not self.health.is_down(shard)]
        room = len(up) if self._queue is None else self.max_pending - self._queue.qsize()
        with self._lock:
            self.counters["writes_skipped_down"] += len(todo) - len(up)
            self.counters["writes_dropped"] += max(0, len(up) - max(0, room))
        return up[: max(0, room)]

    def forget_recent(self) -> None:
        """Forget which keys were written lately: the next eviction or insert sends them again."""
        with self._lock:
            self._recent.clear()

    def put(self, key: bytes, payload: Any) -> bool:
        """Store ``payload`` (bytes, or a zero-argument callable returning bytes, evaluated by the
        writer) under ``key``. Returns True when accepted (queued or, in simulation, stored);
        False when skipped (recently written / queued), dropped (queue full) or the store is
        down."""
        if self._sim is not None:
            self._sim[key] = 1
            self._sim.move_to_end(key)
            while len(self._sim) > self.capacity_pages:
                self._sim.popitem(last=False)
            self.counters["writes"] += 1
            return True
        if not self.wants(key):
            return False
        if not self.available:
            with self._lock:
                self.counters["writes_skipped_down"] += 1
            return False
        if self._queue is None:
            self._write_batch([(key, payload)])
            return True
        with self._lock:
            self._pending.add(key)
        try:
            self._queue.put_nowait((key, payload))
        except queue.Full:
            with self._lock:
                self._pending.discard(key)
                self.counters["writes_dropped"] += 1
            return False
        return True

    def _write_batch(self, items: list[tuple[bytes, Any]]) -> None:
        """Serialize ``items`` and ``SET`` them, one pipeline per shard (a shard that is down is
        skipped; one that fails turns down and its pages are counted as failed)."""
        assert self._shards is not None
        values: list[tuple[bytes, bytes]] = []
        failed = 0
        for key, payload in items:
            try:
                data = payload() if callable(payload) else payload
            except Exception:  # a snapshot that cannot be serialized is simply not stored
                failed += 1
                continue
            values.append((key, self._pack(key, bytes(data))))
        groups: dict[str | None, list[tuple[bytes, bytes]]] = {}
        where = self._shards.locate([self._rkey(k) for k, _ in values])
        for item, shard in zip(values, where, strict=True):
            groups.setdefault(shard, []).append(item)
        done: list[tuple[bytes, bytes]] = []
        skipped = 0
        for shard, group in groups.items():
            if shard is None or self.health.is_down(shard):
                skipped += len(group)
                continue
            try:
                errs = self._shards.set(shard, [(self._rkey(k), v) for k, v in group])
            except self._errors as exc:
                failed += len(group)
                self.health.went_down(shard, exc)
                continue
            for item, err in zip(group, errs, strict=True):
                if err is None:
                    done.append(item)
                else:
                    failed += 1
        self._remember([key for key, _ in done])
        with self._lock:
            self.counters["writes_failed"] += failed
            self.counters["writes_skipped_down"] += skipped
            self.counters["writes"] += len(done)
            self.counters["write_bytes"] += sum(len(v) for _, v in done)

    def _writer(self) -> None:
        assert self._queue is not None
        while True:
            try:
                item = self._queue.get(timeout=self.retry_min)
            except queue.Empty:
                self.probe()
                continue
            items: list[tuple[bytes, Any]] = [] if item is None else [item]
            stop = item is None
            done = 1
            while not stop and len(items) < self.batch_pages:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                done += 1
                if nxt is None:
                    stop = True
                else:
                    items.append(nxt)
            try:
                if items:
                    self.probe()
                    self._write_batch(items)
            finally:
                with self._lock:
                    for key, _ in items:
                        self._pending.discard(key)
                for _ in range(done):
                    self._queue.task_done()
            if stop:
                return

    def sync(self) -> None:
        """Wait until every queued write is sent (or dropped)."""
        if self._queue is not None:
            self._queue.join()

    # ------------------------------------------------------------------ reads
    def get_prefix(self, keys: Sequence[bytes], expect_len: int | None = None) -> list[bytes]:
        """Verified payloads of the longest run ``keys[:n]`` the server holds, fetched in batches
        of ``batch_pages`` (one ``MGET``, or one pipeline per cluster master); stops at the first
        missing or bad value (a bad one is counted by reason and deleted) and at the first key
        of a shard that is down (``misses_down``). ``expect_len``: the payload length a page
        must have. Down: returns ``[]`` without touching the network. Pages returned count as
        written lately (:meth:`wants` is False for them)."""
        if not keys:
            return []
        if self._sim is not None:
            return self._sim_get(keys)
        if not self.available:
            self.counters["lookups_skipped_down"] += 1
            return []
        self.counters["lookups"] += 1
        out: list[bytes] = []
        try:
            for at in range(0, len(keys), self.batch_pages):
                chunk = list(keys[at : at + self.batch_pages])
                values = self._fetch([self._rkey(k) for k in chunk])
                for i, key in enumerate(chunk):
                    value = values[i] if i < len(values) else None
                    if value is None or isinstance(value, Exception):
                        self.counters["misses"] += 1
                        if i >= len(values):
                            self.counters["misses_down"] += 1
                        return out
                    fp, mac_key = self.fingerprint, self.mac_key
                    reason = verify(value, REMOTE_MAGIC, fp, key, mac_key, expect_len)
                    if reason is not None:
                        self.discard(key, reason)
                        return out
                    out.append(bytes(memoryview(value)[HEADER.size :]))
                    self.counters["hits"] += 1
                    self.counters["read_bytes"] += len(value)
            return out
        finally:
            self._remember(keys[: len(out)])

    def _fetch(self, rkeys: list[bytes]) -> list[Any]:
        """The replies for the leading keys of ``rkeys`` up to the first one whose shard is down
        (or fails now: it turns down), fetched one request per shard."""
        assert self._shards is not None
        where = self._shards.locate(rkeys)
        stop = next((i for i, s in enumerate(where) if self.health.is_down(s)), len(rkeys))
        groups: dict[str, list[int]] = {}
        for i in range(stop):
            groups.setdefault(where[i], []).append(i)  # type: ignore[arg-type]
        values: list[Any] = [None] * stop
        for shard, idx in groups.items():  # in order of each shard's first key
            if idx[0] >= stop:
                continue  # after a key that already misses
            try:
                got = self._shards.get(shard, [rkeys[i] for i in idx])
            except self._errors as exc:
                self.health.went_down(shard, exc)
                stop = idx[0]
                continue
            for i, value in zip(idx, got, strict=True):
                values[i] = value
        return values[:stop]

    def _sim_get(self, keys: Sequence[bytes]) -> list[bytes]:
        assert self._sim is not None
        out: list[bytes] = []
        for key in keys:
            if key not in self._sim:
                self.counters["misses"] += 1
                break
            self._sim.move_to_end(key)
            out.append(b"")
        self.counters["lookups"] += 1
        self.counters["hits"] += len(out)
        return out

    def discard(self, key: bytes, reason: str | None = None) -> None:
        """Delete ``key`` from the server (best effort); with a ``reason`` (one of
        :data:`~radixkv.cache.kv_mac.REASONS`) it is counted as a corrupt value."""
        if reason is not None:
            self.counters["corrupt_values"] += 1
            name = f"corrupt_{reason}"
            self.counters[name] = self.counters.get(name, 0) + 1
        with self._lock:
            self._recent.pop(key, None)
        if self._sim is not None:
            self._sim.pop(key, None)
            return
        assert self._shards is not None
        rkey = self._rkey(key)
        (shard,) = self._shards.locate([rkey])
        if shard is not None and not self.health.is_down(shard):
            try:
                self._shards.delete(shard, rkey)
            except self._errors as exc:
                self.health.went_down(shard, exc)

    def close(self) -> None:
        """Send queued writes, stop the writer thread and close the connections (idempotent)."""
        if self._queue is not None and self._thread is not None:
            self.sync()
            self._queue.put(None)
            self._thread.join(timeout=10)
            self._queue = None
            self._thread = None
        if self._shards is not None:
            self._shards.close()

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "url": redact_url(self.url) if self.url is not None else None,
            "available": self.available,
            "pending_writes": len(self._pending),
            "recent_keys": len(self._recent),
            **self.health.stats(),
        }
        if self._sim is not None:
            out["pages"] = len(self._sim)
        out.update(self.counters)
        return out

    def check_integrity(self) -> None:
        """The local bookkeeping: ``_recent`` bounded, every count non-negative, corrupt counts
        summing up, misses on down shards within the misses, the shards' up/down state
        (:meth:`ShardHealth.check_integrity
        <radixkv.cache.remote_health.ShardHealth.check_integrity>`), no write pending with the
        writer stopped, the simulated LRU within capacity. Raises :class:`IntegrityError`."""
        self.health.check_integrity()
        with self._lock:
            recent = len(self._recent)
            pending = set(self._pending)
            counters = dict(self.counters)
        if recent > self.max_recent:
            raise IntegrityError(f"remote: {recent} recent keys > bound {self.max_recent}")
        bad = [k for k, v in counters.items() if v < 0]
        if bad:
            raise IntegrityError(f"remote: negative counters {bad}")
        if sum(counters[f"corrupt_{r}"] for r in _REASONS) != counters["corrupt_values"]:
            raise IntegrityError("remote: corrupt counts by reason do not sum to the total")
        if counters["misses_down"] > counters["misses"]:
            raise IntegrityError("remote: more misses on down shards than misses")
        if pending and self._thread is None and self._sim is None:
            raise IntegrityError("remote: writes pending without a writer thread")
        if self._sim is not None and len(self._sim) > self.capacity_pages:
            raise IntegrityError("remote: simulated store over capacity")

    def __repr__(self) -> str:
        state = "up" if self.available else "down"
        if self.health.num_down:
            state += f", {self.health.num_down} shard(s) down"
        return f"RemoteStore(url={redact_url(self.url)!r}, {state}, pending={len(self._pending)})"
