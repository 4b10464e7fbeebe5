"""Admission from the offload tiers: a device match extended with what the host, disk and remote
tiers hold, loaded back into device pages (:meth:`TierLoads.load_prefix`, called through
``TieredCache.load_prefix`` by ``KVManager.admit`` and the simulator).

A load is three steps, one method each:

1. **plan** (:meth:`TierLoads._plan`): what the tiers hold after the device match: the host-only
   nodes continuing it, then the pages on disk and in the remote store under the chained hashes,
   read and verified before any device page is taken (a :class:`LoadPlan`); nothing when it is
   shorter than ``min_load_tokens``;
2. **evict** (:meth:`TierLoads._evict`): room on the device for the plan and ``reserve_pages``,
   by device eviction (the matched path is locked, the host path protected from host eviction);
   when it does not all fit, the plan is cut to its longest prefix that does (partial
   load-back), or, with ``partial=False``, dropped; then the device pages are allocated;
3. **copy** (:meth:`TierLoads._copy_host`, :meth:`TierLoads._copy_payloads`): host pages into
   device pages (the host-only nodes become device resident), then the disk and remote payloads
   (inserted into the tree); the caller's lock moves to the node ending the loaded prefix.

:class:`TierLoads` is the ``loads`` part of :class:`~radixkv.cache.tiers.TieredCache`.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixkv.cache.disk_store import chain_hashes
from radixkv.cache.radix_tree import MatchResult, TreeNode

if TYPE_CHECKING:
    from radixkv.cache.tier_stores import TierStores

__all__ = ["LOAD_COUNTERS", "LoadPlan", "LoadResult", "TierLoads"]

#: The counters the load path keeps, in :meth:`TieredCache.stats`.
LOAD_COUNTERS = (
    "host_loads",  # admissions that loaded host pages
    "host_load_pages",
    "disk_loads",  # admissions that loaded disk pages
    "disk_load_pages",
    "loads_skipped",  # continuations below min_load_tokens or without room
    "remote_loads",  # admissions that loaded remote pages
    "remote_load_pages",
    "partial_loads",  # loads cut short by the device pages free (rest recomputed)
    "loads_waiting",  # loads put off until running requests free device pages
    "partial_pages_recomputed",  # cached pages those loads left to recompute
)


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


@dataclass
class LoadPlan:
    """A load, read and verified before any device page is taken: ``num_host`` pages in the
    host-only nodes ``host_nodes`` (in path order), then ``payloads``, one per page, the first
    ``num_disk`` read from disk and the rest from the remote store. :meth:`TierLoads._evict`
    may cut it to what fits, counting the pages left out in ``unloaded``."""

    host_nodes: list[TreeNode]
    num_host: int
    payloads: list[bytes]
    num_disk: int
    unloaded: int = 0

    @property
    def num_pages(self) -> int:
        """Device pages the load takes."""
        return self.num_host + len(self.payloads)


class TierLoads:
    """The load path of the tiers: plan, evict, copy (module docstring).

    Owns: ``counters`` (:data:`LOAD_COUNTERS`; they only grow) and ``min_load_tokens`` (loads of
    fewer tokens are skipped: recomputing them is cheaper). What it reads, the tree, the device
    allocator and pool, the host pool, the disk and remote stores and the disk-key fingerprint,
    is ``stores`` (:class:`~radixkv.cache.tier_stores.TierStores`), shared with the other parts.

    Invariants of a load: eviction never takes what it needs (the caller's matched path is
    locked, the host path is protected, payloads are read first); on return exactly one of
    ``res.node`` and the returned node holds the caller's lock; device pages taken are either in
    the tree or freed.
    """

    def __init__(self, stores: TierStores, min_load_tokens: int) -> None:
        self.stores = stores
        self.min_load_tokens = min_load_tokens
        self.counters: dict[str, int] = dict.fromkeys(LOAD_COUNTERS, 0)

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
        by_tier = {"device": res.num_tokens, "host": 0, "disk": 0}
        if self.stores.remote is not None:
            by_tier["remote"] = 0
        keep = LoadResult(list(res.pages), res.num_tokens, res.node, by_tier)
        plan = self._plan(tokens, salt, res)
        if plan is None:
            return keep
        residency = self.stores.tree.residency
        protected = plan.host_nodes[-1] if plan.host_nodes else None
        if protected is not None:
            residency.protect(protected)
        try:
            dev_pages = self._evict(plan, reserve_pages, partial, keep)
            if dev_pages is None:
                return keep
            self._copy_host(plan, dev_pages)
        finally:
            if protected is not None:
                residency.unprotect(protected)
        return self._copy_payloads(tokens, salt, res, plan, dev_pages, by_tier)

    # ------------------------------------------------------------------ 1. plan
    def _plan(self, tokens: list[int], salt: Hashable, res: MatchResult) -> LoadPlan | None:
        """What the tiers hold after the device match ``res``, read and verified; ``None`` when
        nothing is there or it is shorter than ``min_load_tokens`` (``loads_skipped``)."""
        P = self.stores.page_size
        host_nodes = res.host_nodes if self.stores.host is not None else []
        host_tok = res.host_tokens if host_nodes else 0
        max_pages = len(tokens) // P
        start = (res.num_tokens + host_tok) // P
        disk = self.stores.disk
        disk_keys: list[bytes] = []
        if disk is not None and start < max_pages and disk.num_files:
            hashes = chain_hashes(self.stores.fingerprint, tokens, P, salt, max_pages)
            for i in range(start, max_pages):
                if not disk.contains(hashes[i]):
                    break
                disk_keys.append(hashes[i])
        remote = self.stores.remote
        remote = remote if remote is not None and remote.available else None
        if host_tok + len(disk_keys) * P == 0 and remote is None:
            return None
        if host_tok + len(disk_keys) * P < self.min_load_tokens and remote is None:
            self.counters["loads_skipped"] += 1
            return None
        payloads: list[bytes] = []
        page_bytes = self.stores.kv_pool.bytes_per_page if self.stores.kv_pool is not None else None
        for key in disk_keys:  # read (and verify) before taking any device page
            data = disk.get(key, page_bytes) if disk is not None else None
            if data is None:
                break
            if page_bytes is not None and len(data) != page_bytes:
                assert disk is not None
                disk.discard(key, "truncated")
                break
            payloads.append(data)
        n_disk = len(payloads)
        at = start + n_disk
        if remote is not None and n_disk == len(disk_keys) and at < max_pages:
            # the continuation after host and disk, fetched in pipelined batches and verified
            hashes = chain_hashes(self.stores.fingerprint, tokens, P, salt, max_pages)
            payloads += remote.get_prefix(hashes[at:max_pages], page_bytes)
        plan = LoadPlan(host_nodes, host_tok // P, payloads, n_disk)
        if plan.num_pages == 0:
            return None
        if plan.num_pages * P < self.min_load_tokens:
            self.counters["loads_skipped"] += 1
            return None
        return plan

    # ------------------------------------------------------------------ 2. evict
    def _evict(
        self, plan: LoadPlan, reserve_pages: int, partial: bool, keep: LoadResult
    ) -> list[int] | None:
        """Device pages for ``plan`` (cut to what fits), after evicting for it and for
        ``reserve_pages``; ``None`` when nothing is loaded (too little fits: ``loads_skipped``;
        or ``partial=False`` and it does not all fit: ``loads_waiting``, and
        ``keep.unloaded_pages`` is the plan's size)."""
        P = self.stores.page_size
        need = plan.num_pages
        alloc = self.stores.allocator
        if alloc is None:  # simulation without an allocator: fake page ids
            return list(range(-1, -need - 1, -1))
        tree = self.stores.tree
        if not partial and alloc.num_free + tree.evictable_size // P < need + reserve_pages:
            # the caller waits for room rather than load part: evict nothing for it now
            self.counters["loads_waiting"] += 1
            keep.unloaded_pages = need
            return None
        short = need + reserve_pages - alloc.num_free
        if short > 0:
            tree.evict(short * P)
        fit = min(need, alloc.num_free - reserve_pages)
        if fit < need:  # partial load-back: the longest prefix that fits
            if fit <= 0 or fit * P < self.min_load_tokens:
                self.counters["loads_skipped"] += 1
                return None
            self.counters["partial_loads"] += 1
            self.counters["partial_pages_recomputed"] += need - fit
            plan.unloaded = need - fit
            if fit < plan.num_host:
                plan.host_nodes = self._cut_host_path(plan.host_nodes, fit)
                plan.num_host = fit
            plan.payloads = plan.payloads[: fit - plan.num_host]
            plan.num_disk = min(plan.num_disk, len(plan.payloads))
        return alloc.allocate(plan.num_pages)

    def _cut_host_path(self, host_nodes: list[TreeNode], num_pages: int) -> list[TreeNode]:
        """The leading host-only nodes holding exactly the first ``num_pages`` pages of the host
        path ``host_nodes`` (the node the cut falls in is split there; both halves stay
        host-only, so the tree's contents do not change)."""
        P = self.stores.page_size
        out: list[TreeNode] = []
        left = num_pages
        for hn in host_nodes:
            k = len(hn.key) // P
            if k > left:
                out.append(self.stores.tree.split(hn, left * P))
                break
            out.append(hn)
            left -= k
            if left == 0:
                break
        return out

    # ------------------------------------------------------------------ 3. copy
    def _copy_host(self, plan: LoadPlan, dev_pages: list[int]) -> None:
        """Host pages of the plan into the first ``plan.num_host`` of ``dev_pages``; the host-only
        nodes become device resident (still protected from host eviction)."""
        nh = plan.num_host
        if not nh:
            return
        hp: list[int] = []
        for hn in plan.host_nodes:
            hp += hn.host_value or []
        if self.stores.host is not None and self.stores.kv_pool is not None:
            self.stores.host.load(self.stores.kv_pool, hp, dev_pages[:nh])
        at = 0
        P = self.stores.page_size
        for hn in plan.host_nodes:
            k = len(hn.key) // P
            self.stores.tree.residency.set_device_value(hn, dev_pages[at : at + k])
            at += k
        self.counters["host_loads"] += 1
        self.counters["host_load_pages"] += nh

    def _copy_payloads(
        self,
        tokens: list[int],
        salt: Hashable,
        res: MatchResult,
        plan: LoadPlan,
        dev_pages: list[int],
        by_tier: dict[str, int],
    ) -> LoadResult:
        """The disk and remote payloads of the plan into the rest of ``dev_pages``, inserted into
        the tree; the caller's lock moves from ``res.node`` to the end of the loaded prefix."""
        P = self.stores.page_size
        tree = self.stores.tree
        dev = res.num_tokens
        nh, payloads, n_disk = plan.num_host, plan.payloads, plan.num_disk
        total = dev + nh * P
        if payloads:  # disk -> device, then into the tree
            disk_pages = dev_pages[nh:]
            if self.stores.kv_pool is not None:
                from radixkv.cache.host_pool import payloads_to_pages

                pool = self.stores.kv_pool
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
        if self.stores.remote is not None:
            by_tier["remote"] = total - dev - nh * P - by_tier["disk"]
        return LoadResult(m.pages, total, m.node, by_tier, plan.unloaded)
