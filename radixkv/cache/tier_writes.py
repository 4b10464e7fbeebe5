"""The tiers' write path: device pages copied to host pages, disk files and the remote store, from
the radix tree's eviction and insert events (the policies are in :mod:`radixkv.cache.tiers`).

:class:`TierWrites` is the ``writes`` part of :class:`~radixkv.cache.tiers.TieredCache`: its
``on_evict`` / ``on_host_evict`` / ``on_insert`` are the tree's observer hooks.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from radixkv.cache.disk_store import chain_hashes
from radixkv.cache.radix_tree import TreeNode

if TYPE_CHECKING:
    from radixkv.cache.tier_stores import TierStores

logger = logging.getLogger("radixkv.cache.tiers")

__all__ = ["WRITE_COUNTERS", "TierWrites"]

#: The counters the write path keeps (pages), in :meth:`TieredCache.stats`.
WRITE_COUNTERS = (
    "host_writes",  # pages copied device -> host
    "disk_write_pages",  # pages handed to the disk writer
    "dropped_pages",  # device pages evicted with nowhere to go
    "remote_write_pages",  # pages handed to the remote writer
)


class TierWrites:
    """Copies out of the device tier, and the tree hooks that trigger them.

    Owns: ``counters`` (:data:`WRITE_COUNTERS`; they only grow). What it reads is given at
    construction and never reassigned: ``stores`` (:class:`~radixkv.cache.tier_stores.TierStores`:
    the tree, the device pool, the host pool, disk and remote stores, the disk-key fingerprint),
    shared with the other parts, and the three write policies. A node gets host pages only through
    ``tree.residency.set_host_value``, after its KV was copied into them.
    """

    def __init__(
        self,
        stores: TierStores,
        write_policy: str,
        disk_write_policy: str,
        remote_write_policy: str,
    ) -> None:
        self.stores = stores
        self.write_policy = write_policy
        self.disk_write_policy = disk_write_policy
        self.remote_write_policy = remote_write_policy
        self.counters: dict[str, int] = dict.fromkeys(WRITE_COUNTERS, 0)

    # ------------------------------------------------------------------ helpers
    def _prefix_tokens(self, node: TreeNode) -> list[int]:
        """Tokens of the path from the namespace root down to (and including) ``node``."""
        keys: list[list[int]] = []
        x: TreeNode | None = node
        while x is not None and x.parent is not None and not x.is_namespace:
            keys.append(x.key)
            x = x.parent
        out: list[int] = []
        for k in reversed(keys):
            out += k
        return out

    def _node_hashes(self, node: TreeNode) -> list[bytes]:
        """Disk keys of ``node``'s pages (the last ``len(node.key) // P`` chained hashes)."""
        tokens = self._prefix_tokens(node)
        hashes = chain_hashes(self.stores.fingerprint, tokens, self.stores.page_size, node.salt)
        return hashes[len(hashes) - len(node.key) // self.stores.page_size :]

    def _host_alloc(self, n: int) -> list[int] | None:
        """``n`` host pages, evicting host-only leaves when short; None when impossible."""
        assert self.stores.host is not None
        halloc = self.stores.host.allocator
        if n > halloc.num_pages:
            return None
        short = n - halloc.num_free
        if short > 0:
            self.stores.tree.evict_host(short * self.stores.page_size)
        if halloc.num_free < n:
            return None
        return halloc.allocate(n)

    def _copy_to_host(self, node: TreeNode, pages: list[int]) -> bool:
        """Give ``node`` host pages holding the KV of device ``pages``; False when no room."""
        hp = self._host_alloc(len(pages))
        if hp is None:
            return False
        if self.stores.host is not None and self.stores.kv_pool is not None:
            self.stores.host.save(self.stores.kv_pool, pages, hp)
        self.stores.tree.residency.set_host_value(node, hp)
        self.counters["host_writes"] += len(pages)
        return True

    def write_disk(
        self,
        node: TreeNode,
        pages: list[int],
        from_host: bool,
        keys: list[bytes] | None = None,
        wait: float | None = None,
    ) -> None:
        """Hand ``node``'s pages (device or host ids) to the disk writer; pages already on disk
        are only refreshed. The KV is snapshotted now, serialized by the writer thread.
        ``keys``: the node's disk keys when the caller has them; ``wait``: seconds to wait for
        room in the writer queue (``None``: a full queue drops the write)."""
        disk = self.stores.disk
        assert disk is not None
        if keys is None:
            keys = self._node_hashes(node)
        todo: list[int] = []
        for i, key in enumerate(keys):
            if disk.contains(key):
                disk.touch(key)
            elif not disk.pending(key):
                todo.append(i)
        if not todo:
            return
        if not self.stores.has_data:
            for i in todo:
                if disk.put(keys[i], self.stores.page_size):
                    self.counters["disk_write_pages"] += 1
            return
        from radixkv.cache.host_pool import pages_to_payloads

        deadline = None if wait is None else time.monotonic() + wait
        sel = [pages[i] for i in todo]
        if from_host:
            assert self.stores.host is not None
            k, v = self.stores.host.read(sel)
        else:
            assert self.stores.kv_pool is not None
            k, v = self.stores.kv_pool.read_pages(sel)
            k, v = k.to("cpu"), v.to("cpu")
        for j, i in enumerate(todo):
            kj, vj = k[:, j : j + 1], v[:, j : j + 1]
            left = None if deadline is None else deadline - time.monotonic()
            if disk.put(keys[i], lambda kj=kj, vj=vj: pages_to_payloads(kj, vj)[0], wait=left):
                self.counters["disk_write_pages"] += 1

    def _write_remote(self, node: TreeNode, pages: list[int]) -> None:
        """Hand ``node``'s device ``pages`` to the remote writer: only those the store wants
        (:meth:`~radixkv.cache.remote_store.RemoteStore.to_send`: not queued, not sent or read
        lately, on a shard that is up, within the queue's room) are snapshotted now; the writer
        thread serializes and sends them."""
        remote = self.stores.remote
        assert remote is not None
        if not remote.available:
            remote.skipped_down(len(pages))
            return
        keys = self._node_hashes(node)
        todo = remote.to_send(keys)
        if not todo:
            return
        if not self.stores.has_data:
            for i in todo:
                if remote.put(keys[i], b""):
                    self.counters["remote_write_pages"] += 1
            return
        from radixkv.cache.host_pool import pages_to_payloads

        assert self.stores.kv_pool is not None
        k, v = self.stores.kv_pool.read_pages([pages[i] for i in todo])
        k, v = k.to("cpu"), v.to("cpu")
        for j, i in enumerate(todo):
            kj, vj = k[:, j : j + 1], v[:, j : j + 1]
            if remote.put(keys[i], lambda kj=kj, vj=vj: pages_to_payloads(kj, vj)[0]):
                self.counters["remote_write_pages"] += 1

    # ------------------------------------------------------------------ tree hooks
    def on_evict(self, node: TreeNode, pages: list[int]) -> None:
        """Device eviction of ``node``: keep its KV on the host (or the disk), and share it."""
        if self.stores.remote is not None and self.remote_write_policy == "write_back":
            self._write_remote(node, pages)  # write-through sent them when they were cached
        if node.host_value is not None:
            return  # already on the host (write-through or loaded back): nothing to copy
        if self.stores.host is not None and self._copy_to_host(node, pages):
            return
        if self.stores.disk is not None:
            self.write_disk(node, pages, from_host=False)
        elif self.stores.remote is None:
            self.counters["dropped_pages"] += len(pages)

    def on_host_evict(self, node: TreeNode, host_pages: list[int]) -> None:
        """``node`` leaves the host tier: its pages go to disk."""
        if self.stores.disk is not None and host_pages:
            self.write_disk(node, host_pages, from_host=True)

    def on_insert(self, node: TreeNode) -> None:
        """Write-through, as soon as ``node`` is cached: host write-through copies it to the
        host and queues it for the disk; disk write-through queues it for the disk; remote
        write-through queues it for the remote store."""
        pages = node.value
        if pages is None:
            return
        host_through = self.write_policy == "write_through"
        if host_through and self.stores.host is not None and node.host_value is None:
            self._copy_to_host(node, pages)
        if self.stores.disk is not None and (
            host_through or self.disk_write_policy == "write_through"
        ):
            self.write_disk(node, pages, from_host=False)
        if self.stores.remote is not None and self.remote_write_policy == "write_through":
            self._write_remote(node, pages)
