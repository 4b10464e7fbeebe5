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
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixkv.cache.allocator import BlockAllocator, IntegrityError
from radixkv.cache.disk_store import DiskStore, chain_hashes
from radixkv.cache.kv_mac import REASONS
from radixkv.cache.radix_tree import MatchResult, RadixTree, TreeEvents, TreeNode
from radixkv.cache.tier_durability import CLOSE_TIMEOUT_S, TierDurability

if TYPE_CHECKING:
    from radixkv.cache.host_pool import HostPool
    from radixkv.cache.page_pool import PagePool
    from radixkv.cache.remote_store import RemoteStore

__all__ = ["CLOSE_TIMEOUT_S", "LoadResult", "TieredCache"]

TIERS = ("device", "host", "disk", "remote")

logger = logging.getLogger(__name__)


@dataclass
class LoadResult:
    """What :meth:`TieredCache.load_prefix` hands back: the device pages of the whole usable
    prefix (``num_tokens`` tokens), the locked node holding it, and the tokens per tier."""

    pages: list[int]
    num_tokens: int
    node: TreeNode | None
    by_tier: dict[str, int] = field(default_factory=dict)
    #: Pages of the cached continuation left on the host / disk for lack of device room.
    unloaded_pages: int = 0


class TieredCache(TierDurability):
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
        self.min_load_tokens = 2 * self.page_size if min_load_tokens is None else min_load_tokens
        self.counters: dict[str, int] = {
            "host_writes": 0,  # pages copied device -> host
            "host_loads": 0,  # admissions that loaded host pages
            "host_load_pages": 0,
            "disk_loads": 0,  # admissions that loaded disk pages
            "disk_load_pages": 0,
            "disk_write_pages": 0,  # pages handed to the disk writer
            "loads_skipped": 0,  # continuations below min_load_tokens or without room
            "dropped_pages": 0,  # device pages evicted with nowhere to go
            "remote_loads": 0,  # admissions that loaded remote pages
            "remote_load_pages": 0,
            "remote_write_pages": 0,  # pages handed to the remote writer
            "partial_loads": 0,  # loads cut short by the device pages free (rest recomputed)
            "loads_waiting": 0,  # loads put off until running requests free device pages
            "partial_pages_recomputed": 0,  # cached pages those loads left to recompute
        }
        through = (
            write_policy == "write_through"
            or (disk is not None and disk_write_policy == "write_through")
            or (remote is not None and remote_write_policy == "write_through")
        )
        tree.observe(
            TreeEvents(
                on_evict=self._on_evict,
                host_allocator=host.allocator if host is not None else None,
                on_host_evict=self._on_host_evict if disk is not None else None,
                on_insert=self._on_insert if through else None,
            )
        )

    # ------------------------------------------------------------------ admission
    def _cut_host_path(self, host_nodes: list[TreeNode], num_pages: int) -> list[TreeNode]:
        """The leading host-only nodes holding exactly the first ``num_pages`` pages of the host
        path ``host_nodes`` (the node the cut falls in is split there; both halves stay
        host-only, so the tree's contents do not change)."""
        P = self.page_size
        out: list[TreeNode] = []
        left = num_pages
        for hn in host_nodes:
            k = len(hn.key) // P
            if k > left:
                out.append(self.tree.split(hn, left * P))
                break
            out.append(hn)
            left -= k
            if left == 0:
                break
        return out

    def load_prefix(
        self,
        tokens: list[int],
        salt: Hashable,
        res: MatchResult,
        reserve_pages: int = 0,
        partial: bool = True,
    ) -> LoadResult:
        """Extend the device match ``res`` of ``tokens`` with what the host, disk and remote tiers
        hold, loading it into device pages and inserting it into the tree.

        Precondition: ``res.node`` is locked by the caller. Postcondition: the returned node is
        locked instead (``res.node`` unlocked when they differ) and ``pages`` are the tree's
        device pages of the first ``num_tokens`` tokens. Nothing is loaded when the
        continuation is shorter than ``min_load_tokens``.

        Partial load-back: when the whole continuation does not fit in the device pages that are
        free or evictable (running requests hold the rest), its longest prefix that fits is
        loaded and the rest is left to be recomputed (``partial_loads``,
        ``partial_pages_recomputed``). ``reserve_pages`` pages are left free for that
        computation. With ``partial=False`` such a load is not done at all (the caller waits
        for room instead): nothing is loaded and ``unloaded_pages`` says how many pages did not
        fit. Eviction never takes what the load needs: the matched device path is
        locked, the host path is protected from host eviction, disk and remote payloads are
        read before any page is taken.
        """
        P = self.page_size
        tree = self.tree
        dev = res.num_tokens
        by_tier = {"device": dev, "host": 0, "disk": 0}
        if self.remote is not None:
            by_tier["remote"] = 0
        keep = LoadResult(list(res.pages), dev, res.node, by_tier)
        host_nodes = res.host_nodes if self.host is not None else []
        host_tok = res.host_tokens if host_nodes else 0
        max_pages = len(tokens) // P
        start = (dev + host_tok) // P
        disk = self.disk
        disk_keys: list[bytes] = []
        if disk is not None and start < max_pages and disk.num_files:
            hashes = chain_hashes(self.fingerprint, tokens, P, salt, max_pages)
            for i in range(start, max_pages):
                if not disk.contains(hashes[i]):
                    break
                disk_keys.append(hashes[i])
        remote = self.remote if self.remote is not None and self.remote.available else None
        if host_tok + len(disk_keys) * P == 0 and remote is None:
            return keep
        if host_tok + len(disk_keys) * P < self.min_load_tokens and remote is None:
            self.counters["loads_skipped"] += 1
            return keep
        payloads: list[bytes] = []
        page_bytes = self.kv_pool.bytes_per_page if self.kv_pool is not None else None
        for key in disk_keys:  # read (and verify) before taking any device page
            data = disk.get(key, page_bytes) if disk is not None else None
            if data is None:
                break
            if self.has_data and len(data) != self.kv_pool.bytes_per_page:  # type: ignore[union-attr]
                assert disk is not None
                disk.discard(key, "truncated")
                break
            payloads.append(data)
        n_disk = len(payloads)
        at = start + n_disk
        if remote is not None and n_disk == len(disk_keys) and at < max_pages:
            # the continuation after host and disk, fetched in pipelined batches and verified
            hashes = chain_hashes(self.fingerprint, tokens, P, salt, max_pages)
            payloads += remote.get_prefix(hashes[at:max_pages], page_bytes)
        nh = host_tok // P
        need = nh + len(payloads)
        if need == 0:
            return keep
        if need * P < self.min_load_tokens:
            self.counters["loads_skipped"] += 1
            return keep
        alloc = self.allocator
        protected = host_nodes[-1] if host_nodes else None
        unloaded = 0
        if protected is not None:
            tree.residency.protect(protected)
        try:
            if alloc is not None:
                if not partial and alloc.num_free + tree.evictable_size // P < need + reserve_pages:
                    # the caller waits for room rather than load part: evict nothing for it now
                    self.counters["loads_waiting"] += 1
                    keep.unloaded_pages = need
                    return keep
                short = need + reserve_pages - alloc.num_free
                if short > 0:
                    tree.evict(short * P)
                fit = min(need, alloc.num_free - reserve_pages)
                if fit < need:  # partial load-back: the longest prefix that fits
                    if fit <= 0 or fit * P < self.min_load_tokens:
                        self.counters["loads_skipped"] += 1
                        return keep
                    self.counters["partial_loads"] += 1
                    self.counters["partial_pages_recomputed"] += need - fit
                    unloaded = need - fit
                    if fit < nh:
                        host_nodes = self._cut_host_path(host_nodes, fit)
                        nh = fit
                    payloads = payloads[: fit - nh]
                    n_disk = min(n_disk, len(payloads))
                    need = fit
                dev_pages = alloc.allocate(need)
            else:  # simulation without an allocator: fake page ids
                dev_pages = list(range(-1, -need - 1, -1))
            # host -> device
            if nh:
                hp: list[int] = []
                for hn in host_nodes:
                    hp += hn.host_value or []
                if self.host is not None and self.kv_pool is not None:
                    self.host.load(self.kv_pool, hp, dev_pages[:nh])
                at = 0
                for hn in host_nodes:
                    k = len(hn.key) // P
                    tree.residency.set_device_value(hn, dev_pages[at : at + k])
                    at += k
                self.counters["host_loads"] += 1
                self.counters["host_load_pages"] += nh
        finally:
            if protected is not None:
                tree.residency.unprotect(protected)
        total = dev + nh * P
        if payloads:  # disk -> device, then into the tree
            disk_pages = dev_pages[nh:]
            if self.kv_pool is not None:
                from radixkv.cache.host_pool import payloads_to_pages

                pool = self.kv_pool
                k, v = payloads_to_pages(
                    payloads,
                    pool.num_layers,
                    P,
                    pool.num_kv_heads,
                    pool.row_dim,  # quantized: codes + scale
                    pool.dtype,
                )
                pool.write_pages(disk_pages, k, v)
            end = total + len(payloads) * P
            prefix = list(res.pages) + dev_pages
            ret = tree.insert(tokens[:end], prefix, salt)
            # the tree's path ended at `total` (eviction only removes): it took every disk page
            assert ret == total, (ret, total)
            total = end
            if n_disk:
                self.counters["disk_loads"] += 1
                self.counters["disk_load_pages"] += n_disk
            if len(payloads) > n_disk:
                self.counters["remote_loads"] += 1
                self.counters["remote_load_pages"] += len(payloads) - n_disk
        m = tree.match_prefix(tokens[:total], salt)
        assert m.num_tokens == total, (m.num_tokens, total)
        tree.lock(m.node)
        tree.unlock(res.node)
        by_tier["host"] = nh * P
        by_tier["disk"] = min(n_disk * P, total - dev - nh * P)
        if self.remote is not None:
            by_tier["remote"] = total - dev - nh * P - by_tier["disk"]
        return LoadResult(m.pages, total, m.node, by_tier, unloaded)

    def stats(self) -> dict[str, Any]:
        """Host pages used/free, disk files/bytes, loads, writes, corrupt files, skips."""
        out: dict[str, Any] = dict(self.counters)
        out["write_policy"] = self.write_policy
        if self.remote is not None:
            out["remote_write_policy"] = self.remote_write_policy
        out["min_load_tokens"] = self.min_load_tokens
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
