"""Offload tiers under the device prefix cache: host RAM pages, then files on disk.

:class:`TieredCache` wires a :class:`~radixkv.cache.host_pool.HostPool` and a
:class:`~radixkv.cache.disk_store.DiskStore` to the engine's radix tree as its one observer
(``tree.observe(TreeEvents(...))``, in the constructor):

* device eviction (``tree.on_evict``): the node's KV is copied into host pages (the node stays in
  the tree, host-only) instead of being dropped (``write_back``); with no host tier, or no room
  in it, the pages go straight to disk when there is a disk tier;
* host eviction (``tree.on_host_evict``): the host pages of a node leaving the host tier are
  written to disk (skipped when the disk has them already);
* ``write_through``: every node the tree creates (``tree.on_insert``) is copied to the host (and
  the disk) at once, so later device evictions cost nothing (the disk and remote tiers have
  policies of their own, ``disk_write_policy`` and ``remote_write_policy``);
* admission (:meth:`TieredCache.load_prefix`, called by ``KVManager.admit``): a match that
  continues through host-only nodes and then through chained-hash files on disk is loaded back
  into device pages before the request is prefilled, and reported per tier; when running
  requests hold the device pool, the longest prefix that fits is loaded and the rest recomputed.
  Loads shorter than ``min_load_tokens`` are skipped (recomputing them is cheaper).

Ownership: every host page is free in ``host.allocator`` or held (one reference) by exactly one
tree node's ``host_value``; device pages keep the allocator / tree / sequence ownership of
``docs/design.md``. :meth:`TieredCache.check_integrity` verifies the host side.

Remote tier (:class:`~radixkv.cache.remote_store.RemoteStore`, ``remote_cache_url``): a Redis
(or Redis Cluster) shared by several replicas, below host and disk, keyed by the same chained
hashes. Its own policy, ``remote_write_policy``: ``write_through`` (the default) sends a node's
pages when the tree creates the node (``tree.on_insert``), so another replica finds a prompt as
soon as this one has computed it, and a device eviction sends nothing more; ``write_back`` sends
them when they leave the device. Either way the engine thread only snapshots the pages the store
wants (not queued, not sent or read lately, on a shard that is up, within the writer queue's
room: :meth:`~radixkv.cache.remote_store.RemoteStore.to_send`); the writer thread serializes and
sends them, so a slow Redis drops writes instead of stalling a step. Pages loaded from the remote
tier count as sent. Admission fetches the continuation after the disk's in pipelined batches and
loads it with the disk pages. Redis may drop any page at any time: a missing or bad value ends
the continuation there.

Disk keys are chained page hashes (:func:`~radixkv.cache.disk_store.chain_hashes`) rooted in a
fingerprint of the model (name, config, a digest of every weight byte), the KV dtype, the page size and
the KV layout (``radixkv.engine.assembly.engine_fingerprint``, which also builds the tiers), so a restarted engine on the same directory finds its own prefixes and never uses
another model's.

Without tensors (``kv_pool=None``) the same code does pure bookkeeping: the simulator uses it to
count hits per tier.

Where the pieces live: :class:`TieredCache` wires three parts, each the one owner of its state:
``loads`` (:class:`~radixkv.cache.tier_loads.TierLoads`: admission as plan -> evict -> copy, the
load counters, ``min_load_tokens``), ``writes`` (:class:`~radixkv.cache.tier_writes.TierWrites`:
the tree's hooks and the copies out of the device, the write counters) and ``durability``
(:class:`~radixkv.cache.tier_durability.TierDurability`: sync, flush, persist, shutdown). The
device KV pool is reached through :class:`~radixkv.cache.page_pool.PagePool`, a protocol the
model's ``KVPool`` implements, so this layer never imports the model.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from radixkv.cache.allocator import BlockAllocator, IntegrityError
from radixkv.cache.disk_store import DiskStore
from radixkv.cache.kv_mac import REASONS
from radixkv.cache.radix_tree import MatchResult, RadixTree, TreeEvents
from radixkv.cache.tier_durability import CLOSE_TIMEOUT_S, TierDurability
from radixkv.cache.tier_loads import LoadResult, TierLoads
from radixkv.cache.tier_stores import TierStores
from radixkv.cache.tier_writes import TierWrites

if TYPE_CHECKING:
    from radixkv.cache.host_pool import HostPool
    from radixkv.cache.page_pool import PagePool
    from radixkv.cache.remote_store import RemoteStore

__all__ = ["CLOSE_TIMEOUT_S", "LoadResult", "TieredCache"]

TIERS = ("device", "host", "disk", "remote")

#: Every counter of :meth:`TieredCache.stats`, in its order (each kept by ``loads`` or ``writes``).
COUNTERS = (
    "host_writes",
    "host_loads",
    "host_load_pages",
    "disk_loads",
    "disk_load_pages",
    "disk_write_pages",
    "loads_skipped",
    "dropped_pages",
    "remote_loads",
    "remote_load_pages",
    "remote_write_pages",
    "partial_loads",
    "loads_waiting",
    "partial_pages_recomputed",
)

logger = logging.getLogger(__name__)


class TieredCache:
    """Host and disk tiers under a :class:`RadixTree`; see the module docstring.

    Args:
        tree: the device prefix cache; the tiers become its observer (``tree.observe``).
        allocator: the device page allocator.
        kv_pool: the device KV pages (a :class:`~radixkv.cache.page_pool.PagePool`, the model's
            ``KVPool``), or ``None`` for bookkeeping only (simulation).
        host: the host page pool, or ``None`` (no host tier).
        disk: the disk store, or ``None`` (no disk tier).
        write_policy: ``"write_back"`` (copy to the host on device eviction) or
            ``"write_through"`` (copy on insert).
        fingerprint: root of the disk hash chains (32 bytes).
        min_load_tokens: loads of fewer tokens are skipped (recomputed instead).
        remote: the shared remote store, or ``None`` (no remote tier).
        disk_write_policy: ``"write_back"`` (pages reach the disk when they leave the device
            or the host, and at :meth:`shutdown`) or ``"write_through"`` (every node the tree
            creates is queued for the disk at once).
        remote_write_policy: ``"write_through"`` (every node the tree creates is queued for the
            remote store; eviction sends nothing more) or ``"write_back"`` (pages are sent when
            they leave the device).

    The arguments stay as read-only attributes of the same names (``min_load_tokens`` may be
    set: it is the load path's). State lives in the parts ``loads``, ``writes`` and
    ``durability`` (module docstring); :attr:`counters` is the union of theirs.
    """

    def __init__(
        self,
        tree: RadixTree,
        allocator: BlockAllocator | None,
        kv_pool: PagePool | None,
        host: HostPool | None,
        disk: DiskStore | None,
        write_policy: str = "write_back",
        fingerprint: bytes = b"\0" * 32,
        min_load_tokens: int | None = None,
        remote: RemoteStore | None = None,
        disk_write_policy: str = "write_back",
        remote_write_policy: str = "write_through",
    ) -> None:
        if write_policy not in ("write_back", "write_through"):
            raise ValueError(f"unknown host write policy {write_policy!r}")
        if disk_write_policy not in ("write_back", "write_through"):
            raise ValueError(f"unknown disk write policy {disk_write_policy!r}")
        if remote_write_policy not in ("write_back", "write_through"):
            raise ValueError(f"unknown remote write policy {remote_write_policy!r}")
        #: the stores, one value shared by the parts (also read as the attributes below)
        self.stores = TierStores(tree, allocator, kv_pool, host, disk, remote, fingerprint)
        self.tree = tree
        self.allocator = allocator
        self.kv_pool = kv_pool
        self.host = host
        self.disk = disk
        self.remote = remote
        self.page_size = tree.page_size
        self.write_policy = write_policy
        self.disk_write_policy = disk_write_policy
        self.remote_write_policy = remote_write_policy
        self.fingerprint = fingerprint
        min_load = 2 * self.page_size if min_load_tokens is None else min_load_tokens
        self.writes = TierWrites(self.stores, write_policy, disk_write_policy, remote_write_policy)
        self.loads = TierLoads(self.stores, min_load)
        self.durability = TierDurability(self.stores, self.writes)
        through = (
            write_policy == "write_through"
            or (disk is not None and disk_write_policy == "write_through")
            or (remote is not None and remote_write_policy == "write_through")
        )
        tree.observe(
            TreeEvents(
                on_evict=self.writes.on_evict,
                host_allocator=host.allocator if host is not None else None,
                on_host_evict=self.writes.on_host_evict if disk is not None else None,
                on_insert=self.writes.on_insert if through else None,
            )
        )

    # ------------------------------------------------------------------ views
    @property
    def min_load_tokens(self) -> int:
        """Loads of fewer tokens are skipped (the load path's threshold; settable)."""
        return self.loads.min_load_tokens

    @min_load_tokens.setter
    def min_load_tokens(self, tokens: int) -> None:
        self.loads.min_load_tokens = tokens

    @property
    def counters(self) -> dict[str, int]:
        """Every load and write counter (a snapshot, in :data:`COUNTERS` order)."""
        loads, writes = self.loads.counters, self.writes.counters
        return {k: loads[k] if k in loads else writes[k] for k in COUNTERS}

    @property
    def has_data(self) -> bool:
        """False for bookkeeping only (no device KV pool)."""
        return self.stores.has_data

    # ------------------------------------------------------------------ admission
    def load_prefix(
        self,
        tokens: list[int],
        salt: Hashable,
        res: MatchResult,
        reserve_pages: int = 0,
        partial: bool = True,
    ) -> LoadResult:
        """Extend the device match ``res`` of ``tokens`` (locked by the caller) with what the host,
        disk and remote tiers hold, loaded into device pages and inserted into the tree; the
        lock moves to the returned node. Partial load-back, ``reserve_pages`` and
        ``partial``: :meth:`TierLoads.load_prefix <radixkv.cache.tier_loads.TierLoads.load_prefix>`."""
        return self.loads.load_prefix(tokens, salt, res, reserve_pages, partial)

    # ------------------------------------------------------------------ durability
    def sync(self) -> None:
        """Wait for queued disk (and remote) writes."""
        self.durability.sync()

    def flush(self) -> None:
        """Called after ``tree.reset()``: finish queued disk writes; the remote tier forgets
        which pages it sent lately (:meth:`TierDurability.flush
        <radixkv.cache.tier_durability.TierDurability.flush>`)."""
        self.durability.flush()

    def clear_disk(self) -> None:
        """Remove every file of the disk tier."""
        self.durability.clear_disk()

    def close(self) -> None:
        """Finish disk writes and stop the writer thread."""
        self.durability.close()

    def persist(self, deadline: float) -> dict[str, int]:
        """Queue every cached page not on disk yet, until ``deadline`` (:meth:`TierDurability.persist
        <radixkv.cache.tier_durability.TierDurability.persist>`)."""
        return self.durability.persist(deadline)

    def shutdown(self, timeout: float | None = None) -> dict[str, Any]:
        """Make the disk tier durable and stop the writer threads, within ``timeout`` seconds
        (default :data:`CLOSE_TIMEOUT_S`; :meth:`TierDurability.shutdown
        <radixkv.cache.tier_durability.TierDurability.shutdown>`)."""
        return self.durability.shutdown(timeout)

    def stats(self) -> dict[str, Any]:
        """Host pages used/free, disk files/bytes, loads, writes, corrupt files, skips."""
        out: dict[str, Any] = dict(self.counters)
        out["write_policy"] = self.write_policy
        if self.remote is not None:
            out["remote_write_policy"] = self.remote_write_policy
        out["min_load_tokens"] = self.loads.min_load_tokens
        if self.host is not None:
            out["host_pages_total"] = self.host.num_pages
            out["host_pages_used"] = self.host.num_used
            out["host_pages_free"] = self.host.num_free
            out["host_cached_tokens"] = self.tree.host_size
        if self.disk is not None:
            d = self.disk.stats()
            out["disk_files"] = d["files"]
            out["disk_bytes"] = d["bytes"]
            out["disk_capacity_bytes"] = d["capacity_bytes"]
            out["disk_writes"] = d["writes"]
            out["disk_writes_dropped"] = d["writes_dropped"]
            out["disk_pending_writes"] = d["pending_writes"]
            out["disk_evicted_files"] = d["evicted_files"]
            out["corrupt_files"] = d["corrupt_files"]
            out["corrupt_by_reason"] = {r: d[f"corrupt_{r}"] for r in (*REASONS, "oversize")}
        if self.remote is not None:
            out["remote"] = self.remote.stats()
        return out

    def check_integrity(self) -> None:
        """Host side: every used host page is held by exactly one tree node (refcount 1) and
        every tree host page is in use; the pool and the disk store pass their own checks.
        Raises :class:`IntegrityError`."""
        if self.host is not None:
            self.host.check_integrity()
            halloc = self.host.allocator
            pages = self.tree.all_host_pages()
            if len(pages) != len(set(pages)):
                raise IntegrityError("a host page is held by two tree nodes")
            held = set(pages)
            if any(not 0 <= p < halloc.pages_touched for p in held):
                raise IntegrityError("the tree holds a host page that was never allocated")
            for p in range(halloc.pages_touched):
                rc = halloc.refcount(p)
                want = 1 if p in held else 0
                if rc != want:
                    raise IntegrityError(f"host page {p}: refcount {rc}, tree holds it {want}x")
        elif self.tree.host_size:
            raise IntegrityError("tree holds host pages but there is no host tier")
        if self.disk is not None:
            self.disk.check_integrity()
        if self.remote is not None:
            self.remote.check_integrity()

    def __repr__(self) -> str:
        return f"TieredCache(host={self.host!r}, disk={self.disk!r}, {self.write_policy})"
