"""The device KV page pool as the cache layer sees it: a :class:`typing.Protocol`.

The offload tiers copy whole pages between the device pool and host pages, disk files and the
remote store; that is all they need of it. ``radixkv.model.kv_pool.KVPool`` (and its subclass
``VirtualKVPool``) implements :class:`PagePool` structurally, so the cache layer never imports
the model layer (``radixkv/cache/__init__.py``); ``tests/test_tiers.py`` checks that the model's
pool satisfies it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

__all__ = ["PagePool"]


@runtime_checkable
class PagePool(Protocol):
    """Device KV pages, all layers' K and V of a page addressed by one integer page id.

    A page's rows are ``row_dim`` wide: ``head_dim`` for a float pool, the codes and the scale
    for a quantized one (a host copy keeps the rows as they are).
    """

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    row_dim: int

    @property
    def dtype(self) -> torch.dtype:
        """Element type of the stored rows."""
        ...

    @property
    def device(self) -> torch.device:
        """Where the pages live."""
        ...

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page across all layers, K and V (a disk or remote payload's size)."""
        ...

    def read_pages(self, pages: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of ``pages``: ``k, v [num_layers, n, page_size, num_kv_heads, row_dim]``."""
        ...

    def write_pages(self, pages: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k, v`` (as :meth:`read_pages` returns them) into ``pages``."""
        ...
