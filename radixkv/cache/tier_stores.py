"""The stores the offload tiers work on, as one value: :class:`TierStores`.

:class:`~radixkv.cache.tiers.TieredCache` builds it once and hands the same value to each of its
parts (``loads``, ``writes``, ``durability``), so they name the tree, the device pool and the
host, disk and remote stores one way, and none of them can swap a store under the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixkv.cache.allocator import BlockAllocator
    from radixkv.cache.disk_store import DiskStore
    from radixkv.cache.host_pool import HostPool
    from radixkv.cache.page_pool import PagePool
    from radixkv.cache.radix_tree import RadixTree
    from radixkv.cache.remote_store import RemoteStore

__all__ = ["TierStores"]


@dataclass(frozen=True)
class TierStores:
    """The tiers' stores; frozen: never reassigned once the tiers are built.

    Attributes:
        tree: the device prefix cache the tiers observe.
        allocator: the device page allocator (``None``: simulation, fake page ids).
        kv_pool: the device KV pages (``None``: bookkeeping only, no payloads).
        host: the host page pool (``None``: no host tier).
        disk: the disk store (``None``: no disk tier).
        remote: the shared remote store (``None``: no remote tier).
        fingerprint: root of the chained page hashes keying the disk and remote tiers (32 bytes).
    """

    tree: RadixTree
    allocator: BlockAllocator | None
    kv_pool: PagePool | None
    host: HostPool | None
    disk: DiskStore | None
    remote: RemoteStore | None
    fingerprint: bytes

    @property
    def page_size(self) -> int:
        """Tokens per page (the tree's)."""
        return self.tree.page_size

    @property
    def has_data(self) -> bool:
        """False for bookkeeping only (no device KV pool)."""
        return self.kv_pool is not None
