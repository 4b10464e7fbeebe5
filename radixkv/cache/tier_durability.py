"""The tiers' durability: flushing, persisting every cached page to disk, closing the writers.

:class:`TierDurability` is the ``durability`` part of :class:`~radixkv.cache.tiers.TieredCache`;
it writes through the write path (:meth:`~radixkv.cache.tier_writes.TierWrites.write_disk`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from radixkv.cache.disk_store import chain_hashes
from radixkv.cache.radix_tree import TreeNode
from radixkv.cache.tier_writes import TierWrites

if TYPE_CHECKING:
    from radixkv.cache.tier_stores import TierStores

logger = logging.getLogger("radixkv.cache.tiers")

__all__ = ["CLOSE_TIMEOUT_S", "TierDurability"]

#: Default bound (seconds) of :meth:`TieredCache.shutdown`: writing the cached pages not yet on
#: disk and draining the writer queue. What is not written by then is lost (and logged).
CLOSE_TIMEOUT_S = 60.0


class TierDurability:
    """Sync, flush, persist and shut down the disk and remote tiers (over the write path).

    Owns no state of its own: ``stores`` (:class:`~radixkv.cache.tier_stores.TierStores`, shared
    with the other parts) and the write path are given at construction and never reassigned. Pages it queues
    for the disk are counted by the write path (``disk_write_pages``).
    """

    def __init__(self, stores: TierStores, writes: TierWrites) -> None:
        self.writes = writes
        self.stores = stores

    # ------------------------------------------------------------------ administration
    def sync(self) -> None:
        """Wait for queued disk (and remote) writes."""
        if self.stores.disk is not None:
            self.stores.disk.sync()
        if self.stores.remote is not None:
            self.stores.remote.sync()

    def flush(self) -> None:
        """Called after ``tree.reset()`` (which already freed the host pages of every dropped
        node): finish queued disk writes. Disk files stay: they are the persistent tier
        (:meth:`clear_disk` removes them). The remote tier forgets which pages it sent lately,
        so pages computed again after a flush are sent again (Redis may have dropped them)."""
        self.sync()
        if self.stores.remote is not None:
            self.stores.remote.forget_recent()

    def clear_disk(self) -> None:
        """Remove every file of the disk tier."""
        if self.stores.disk is not None:
            self.stores.disk.clear()

    def close(self) -> None:
        """Finish disk writes and stop the writer thread."""
        if self.stores.disk is not None:
            self.stores.disk.close()
        if self.stores.remote is not None:
            self.stores.remote.close()

    def _nodes_by_depth(self) -> list[tuple[TreeNode, list[bytes]]]:
        """Every cached node with its disk keys, parents before children (breadth first). The
        chained hashes are carried down the walk, so the cost is one hash per page."""
        P = self.stores.page_size
        out: list[tuple[TreeNode, list[bytes]]] = []
        level: list[tuple[TreeNode, bytes | None]] = []
        for child in self.stores.tree.root.children.values():
            if child.is_namespace:
                level += [(c, None) for c in child.children.values()]
            else:
                level.append((child, None))
        while level:
            nxt: list[tuple[TreeNode, bytes | None]] = []
            for node, prev in level:
                keys = chain_hashes(self.stores.fingerprint, node.key, P, node.salt, prev=prev)
                if len(keys) * P != len(node.key):  # never: keys are page aligned
                    continue
                out.append((node, keys))
                nxt += [(c, keys[-1]) for c in node.children.values()]
            level = nxt
        return out

    def persist(self, deadline: float) -> dict[str, int]:
        """Queue every cached page (device or host) that is not on disk yet, waiting for room
        in the writer queue until ``deadline`` (``time.monotonic()``). Deepest nodes first, so
        that when the disk bound forces LRU evictions the shared prefixes (written last) stay.
        Returns ``{"pages": queued, "skipped": pages left out by the deadline}``."""
        disk = self.stores.disk
        if disk is None:
            return {"pages": 0, "skipped": 0}
        before = self.writes.counters["disk_write_pages"]
        skipped = 0
        for node, keys in reversed(self._nodes_by_depth()):
            if time.monotonic() >= deadline:
                skipped += sum(1 for k in keys if not disk.contains(k) and not disk.pending(k))
                continue
            if node.value is not None:
                pages, from_host = node.value, False
            elif node.host_value is not None:
                pages, from_host = node.host_value, True
            else:  # pragma: no cover - every node is resident somewhere
                continue
            self.writes.write_disk(node, pages, from_host, keys, wait=deadline - time.monotonic())
        return {"pages": self.writes.counters["disk_write_pages"] - before, "skipped": skipped}

    def shutdown(self, timeout: float | None = None) -> dict[str, Any]:
        """Make the disk tier durable and stop the writer threads: write every cached page not
        yet on disk (:meth:`persist`), drain the queue, stop. Bounded by ``timeout`` seconds
        (default :data:`CLOSE_TIMEOUT_S`); logs pages, bytes and seconds. Returns the same
        figures (``pages``, ``bytes``, ``seconds``, ``skipped``, ``drained``)."""
        t0 = time.monotonic()
        limit = CLOSE_TIMEOUT_S if timeout is None else timeout
        deadline = t0 + limit
        out: dict[str, Any] = {"pages": 0, "bytes": 0, "skipped": 0, "drained": True}
        disk = self.stores.disk
        if disk is not None:
            bytes0 = disk.counters["write_bytes"]
            out.update(self.persist(deadline))
            out["drained"] = disk.close(max(0.0, deadline - time.monotonic()))
            out["bytes"] = disk.counters["write_bytes"] - bytes0
        if self.stores.remote is not None:
            self.stores.remote.close()
        out["seconds"] = time.monotonic() - t0
        if disk is not None:
            log = logger.info if out["drained"] and not out["skipped"] else logger.warning
            log(
                "disk tier flushed: %d pages queued, %d bytes written in %.2f s%s (%s)",
                out["pages"],
                out["bytes"],
                out["seconds"],
                ""
                if out["drained"] and not out["skipped"]
                else f"; the {limit:.0f} s bound cut it short: {out['skipped']} pages not "
                "queued, queue drained: " + str(out["drained"]),
                disk.path,
            )
        return out
