"""Paged KV cache storage: per-layer K and V tensors ``[num_pages, page_size, Hkv, D]``.

A token of a request lives at *slot* ``page * page_size + offset``. Writers use the flat views
``[num_pages * page_size, Hkv, D]`` (:meth:`KVPool.k_flat`, :meth:`KVPool.v_flat`).

A pool of ``torch.int8`` or ``torch.uint8`` holds quantized rows (:mod:`radixkv.model.kv_quant`):
its tensors are ``[num_pages, page_size, Hkv, D + 2]``, each row's scale inside it, so page
copies, reads and writes move the rows as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixkv.model.hugepages import huge_zeros
from radixkv.model.kv_quant import is_quantized, row_dim


class KVPool:
    """Device memory for the KV cache of every layer, addressed by integer page ids.

    Args:
        num_layers: transformer layers.
        num_pages: pages in the pool; page ids are ``0..num_pages-1``.
        page_size: tokens per page.
        num_kv_heads: KV heads per layer.
        head_dim: size of one head.
        dtype: element type of the cache: a float dtype, or ``torch.int8`` / ``torch.uint8``
            for int8 / fp8 (e4m3) rows with their scales (:mod:`radixkv.model.kv_quant`).
        device: where the cache lives.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_layers < 1 or num_pages < 1 or page_size < 1:
            raise ValueError(
                f"num_layers, num_pages and page_size must be >= 1, got "
                f"{num_layers}, {num_pages}, {page_size}"
            )
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.row_dim = row_dim(head_dim, dtype)
        self.device = torch.device(device)
        shape = (num_pages, page_size, num_kv_heads, self.row_dim)
        # zeros (not empty) so that padding pages never hold NaNs that a masked read could leak;
        # on the CPU lazily (an anonymous mapping: no start-up fill) and in huge pages, since a
        # decode step reads pages scattered over the pool.
        self.k: list[torch.Tensor] = [
            huge_zeros(shape, dtype, self.device) for _ in range(num_layers)
        ]
        self.v: list[torch.Tensor] = [
            huge_zeros(shape, dtype, self.device) for _ in range(num_layers)
        ]

    @staticmethod
    def bytes_per_page_for(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one page takes across all layers (K and V), scales included."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * row_dim(head_dim, dtype) * itemsize

    @classmethod
    def from_memory_budget(
        cls,
        budget_bytes: int,
        num_layers: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> KVPool:
        """Build the largest pool that fits in ``budget_bytes``."""
        per_page = cls.bytes_per_page_for(num_layers, page_size, num_kv_heads, head_dim, dtype)
        num_pages = budget_bytes // per_page
        if num_pages < 1:
            raise ValueError(
                f"a KV budget of {budget_bytes} bytes is below one page ({per_page} bytes)"
            )
        return cls(num_layers, int(num_pages), page_size, num_kv_heads, head_dim, dtype, device)

    @property
    def bytes_per_page(self) -> int:
        """Bytes one page takes across all layers (K and V)."""
        return self.bytes_per_page_for(
            self.num_layers, self.page_size, self.num_kv_heads, self.head_dim, self.dtype
        )

    @property
    def quantized(self) -> bool:
        """Rows are int8 / fp8 codes with a scale each (:mod:`radixkv.model.kv_quant`)."""
        return is_quantized(self.dtype)

    @property
    def num_slots(self) -> int:
        """Token capacity of the pool."""
        return self.num_pages * self.page_size

    @property
    def total_bytes(self) -> int:
        """Bytes held by the whole pool."""
        return self.bytes_per_page * self.num_pages

    def k_flat(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K cache as ``[num_slots, Hkv, row_dim]`` (a view)."""
        return self.k[layer].view(-1, self.num_kv_heads, self.row_dim)

    def v_flat(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s V cache as ``[num_slots, Hkv, row_dim]`` (a view)."""
        return self.v[layer].view(-1, self.num_kv_heads, self.row_dim)

    def copy_pages(
        self, src: Sequence[int] | torch.Tensor, dst: Sequence[int] | torch.Tensor
    ) -> None:
        """Copy whole pages ``src[i] -> dst[i]`` in every layer (copy-on-write, tier loads); on
        the CPU in one native call (a warm burst of 64 copies a partial page per admission: 60
        layer caches each, two torch ops apiece, were ~40 ms of its first step)."""
        src_t = torch.as_tensor(src, dtype=torch.long, device=self.device).flatten()
        dst_t = torch.as_tensor(dst, dtype=torch.long, device=self.device).flatten()
        if src_t.numel() != dst_t.numel():
            raise ValueError(f"copy_pages: {src_t.numel()} sources but {dst_t.numel()} targets")
        if src_t.numel() == 0:
            return
        if self.device.type == "cpu":  # one native call for every layer's K and V
            from radixkv.model import native

            module = native.load()
            if module is not None:
                module.copy_pages_([*self.k, *self.v], src_t.contiguous(), dst_t.contiguous())
                return
        for layer in range(self.num_layers):
            for cache in (self.k[layer], self.v[layer]):
                cache.index_copy_(0, dst_t, cache.index_select(0, src_t))

    def read_pages(self, pages: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stack pages of every layer: ``k, v [num_layers, n, page_size, Hkv, row_dim]``
        (copies)."""
        idx = torch.as_tensor(pages, dtype=torch.long, device=self.device).flatten()
        k = torch.stack([c.index_select(0, idx) for c in self.k])
        v = torch.stack([c.index_select(0, idx) for c in self.v])
        return k, v

    def write_pages(
        self, pages: Sequence[int] | torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Inverse of :meth:`read_pages`: write ``k, v [num_layers, n, ...]`` into ``pages``
        (rows of a quantized pool as stored: codes and scales, never converted)."""
        idx = torch.as_tensor(pages, dtype=torch.long, device=self.device).flatten()
        if self.quantized and (k.dtype != self.dtype or v.dtype != self.dtype):
            raise ValueError(
                f"write_pages: a {self.dtype} pool takes {self.dtype} rows, got {k.dtype}"
            )
        for layer in range(self.num_layers):
            self.k[layer].index_copy_(0, idx, k[layer].to(self.device, self.dtype))
            self.v[layer].index_copy_(0, idx, v[layer].to(self.device, self.dtype))

    def __repr__(self) -> str:
        return (
            f"KVPool(layers={self.num_layers}, pages={self.num_pages}, page_size={self.page_size}, "
            f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, "
            f"device={self.device}, {self.total_bytes / 2**20:.1f} MiB)"
        )
