"""Host-memory KV pages: the second tier under the device pool (a
:class:`~radixkv.cache.page_pool.PagePool`, the model's ``KVPool``).

A :class:`HostPool` holds ``num_pages`` pages laid out like the device pool but with the layer as
the leading dimension: ``k, v [num_layers, num_pages, page_size, num_kv_heads, head_dim]``, in
pinned memory when the device is a GPU (so device <-> host copies can be asynchronous DMA).
Page ids ``0..num_pages-1`` are handed out by :attr:`HostPool.allocator`, a
:class:`~radixkv.cache.allocator.BlockAllocator`; the radix tree owns one reference per page stored in
a node's ``host_value``.

Copies are batched: one gather over all layers per direction (``save``: device -> host,
``load``: host -> device), never a Python loop over pages.

``HostPool(num_layers=0, ...)`` is a *bookkeeping-only* pool (no tensors, and torch is never
imported): the simulator uses it to count host hits without any KV data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from radixkv.cache.allocator import BlockAllocator, IntegrityError

if TYPE_CHECKING:
    import torch

    from radixkv.cache.page_pool import PagePool

__all__ = ["HostPool", "pages_to_payloads", "payloads_to_pages"]


class HostPool:
    """Pages of KV in host RAM, addressed by integer ids from :attr:`allocator`.

    Invariants (:meth:`check_integrity`): the allocator is consistent; the tensors (when present)
    have shape ``[num_layers, num_pages, page_size, num_kv_heads, head_dim]``. Which pages are in
    use and by whom is the radix tree's business (``RadixTree.check_integrity`` checks that every
    page in a node's ``host_value`` is held here).
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int = 0,
        num_kv_heads: int = 0,
        head_dim: int = 0,
        dtype: torch.dtype | None = None,
        pin_memory: bool = False,
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"a host pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.allocator = BlockAllocator(num_pages, page_size)
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.pinned = False
        if num_layers > 0:
            import torch

            if dtype is None:
                self.dtype = dtype = torch.float32
            shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
            pin = bool(pin_memory and torch.cuda.is_available())
            self.k = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            self.v = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            self.pinned = pin

    @classmethod
    def like(cls, kv_pool: PagePool, num_pages: int) -> HostPool:
        """A host pool with ``kv_pool``'s page layout (pinned when the device is CUDA); a
        quantized pool's rows are kept as they are, codes and scale (``head_dim`` is then the
        row's ``D + 2``, :mod:`radixkv.model.kv_quant`)."""
        return cls(
            num_pages,
            kv_pool.page_size,
            kv_pool.num_layers,
            kv_pool.num_kv_heads,
            kv_pool.row_dim,
            kv_pool.dtype,
            pin_memory=kv_pool.device.type == "cuda",
        )

    # ------------------------------------------------------------------ properties
    @property
    def has_data(self) -> bool:
        """False for a bookkeeping-only pool."""
        return self.k is not None

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page across all layers, K and V."""
        if self.k is None:
            return 0
        itemsize = self.k.element_size()
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * itemsize

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_used(self) -> int:
        return self.allocator.num_used

    # ------------------------------------------------------------------ copies
    def save(self, kv_pool: PagePool, dev_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        """Copy device pages ``dev_pages[i]`` of ``kv_pool`` into host pages ``host_pages[i]``."""
        if len(dev_pages) != len(host_pages):
            raise ValueError(f"save: {len(dev_pages)} device pages but {len(host_pages)} host")
        if self.k is None or self.v is None or not dev_pages:
            return
        import torch

        k, v = kv_pool.read_pages(list(dev_pages))  # [L, n, P, H, D] on the device
        hidx = torch.as_tensor(list(host_pages), dtype=torch.long)
        self.k.index_copy_(1, hidx, k.to("cpu", self.dtype))
        self.v.index_copy_(1, hidx, v.to("cpu", self.dtype))

    def load(self, kv_pool: PagePool, host_pages: Sequence[int], dev_pages: Sequence[int]) -> None:
        """Copy host pages ``host_pages[i]`` into device pages ``dev_pages[i]`` of ``kv_pool``."""
        if len(dev_pages) != len(host_pages):
            raise ValueError(f"load: {len(host_pages)} host pages but {len(dev_pages)} device")
        if self.k is None or self.v is None or not dev_pages:
            return
        k, v = self.read(host_pages)
        if kv_pool.device.type != "cpu":
            k = k.pin_memory().to(kv_pool.device, non_blocking=True) if self.pinned else k
            v = v.pin_memory().to(kv_pool.device, non_blocking=True) if self.pinned else v
        kv_pool.write_pages(list(dev_pages), k, v)

    def read(self, host_pages: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``k, v [num_layers, n, page_size, Hkv, D]`` copies of the listed host pages."""
        import torch

        assert self.k is not None and self.v is not None
        hidx = torch.as_tensor(list(host_pages), dtype=torch.long)
        return self.k.index_select(1, hidx), self.v.index_select(1, hidx)

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        """Allocator invariants and tensor shapes; raises :class:`IntegrityError`."""
        self.allocator.check_integrity()
        if self.allocator.num_pages != self.num_pages:
            raise IntegrityError("host allocator size differs from the pool")
        if self.k is not None and self.v is not None:
            shape = (self.num_layers, self.num_pages, self.page_size, self.num_kv_heads)
            shape += (self.head_dim,)
            if tuple(self.k.shape) != shape or tuple(self.v.shape) != shape:
                raise IntegrityError(f"host tensors have shape {tuple(self.k.shape)} != {shape}")

    def __repr__(self) -> str:
        return (
            f"HostPool(pages={self.num_pages}, page_size={self.page_size}, "
            f"free={self.num_free}, {self.bytes_per_page * self.num_pages / 2**20:.1f} MiB, "
            f"pinned={self.pinned})"
        )


def pages_to_payloads(k: torch.Tensor, v: torch.Tensor) -> list[bytes]:
    """Serialize ``k, v [L, n, P, H, D]`` into ``n`` per-page payloads (K bytes then V bytes)."""
    import torch

    out: list[bytes] = []
    k = k.detach().to("cpu")
    v = v.detach().to("cpu")
    for i in range(k.shape[1]):
        kb = k[:, i].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        vb = v[:, i].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        out.append(kb + vb)
    return out


def payloads_to_pages(
    payloads: Sequence[bytes | bytearray | memoryview],
    num_layers: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pages_to_payloads`: ``k, v [L, n, P, H, D]`` (CPU tensors).

    Raises ``ValueError`` when a payload does not have the expected length.
    """
    import torch

    n = len(payloads)
    shape = (num_layers, page_size, num_kv_heads, head_dim)
    itemsize = torch.empty((), dtype=dtype).element_size()
    half = num_layers * page_size * num_kv_heads * head_dim * itemsize
    buf = bytearray(2 * half * n)
    mv = memoryview(buf)
    for i, p in enumerate(payloads):
        if len(p) != 2 * half:
            raise ValueError(f"payload {i} has {len(p)} bytes, expected {2 * half}")
        mv[i * 2 * half : (i + 1) * 2 * half] = p
    flat = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(n, 2, *shape)
    k = flat[:, 0].permute(1, 0, 2, 3, 4)
    v = flat[:, 1].permute(1, 0, 2, 3, 4)
    return k, v
