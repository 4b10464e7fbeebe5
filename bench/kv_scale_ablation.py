"""Scale granularity of quantized KV pages, measured by simulation: one scale per (token, head)
row, as the engine stores them, against one scale per (page, head), as a layout of ~2x bfloat16's
capacity would (``kv_quant``'s module docstring says why the engine chose per-token scales; this
is the measurement behind that choice).

:class:`FakeQuantBackend` wraps the backend of an *unquantized float32* pool and rounds every K/V
row it stores to the values a quantized pool would hold, then lets the wrapped backend store and
attend over those values (``code * scale`` is exact in float32, so the pool holds exactly what a
quantized pool would dequantize to). With a float32 model nothing else rounds, so the difference
between two granularities is the quantization alone.

Per page and head, a page's scale follows its tokens as a real store would have to: a page's
first write sets ``scale = absmax / qmax`` over the rows written; a later write whose rows exceed
``scale * qmax`` grows the scale to fit them and re-rounds the rows already in the page to the new
grid (the cost a per-page scale pays on every decode append that sets a new maximum). Scales are
rounded up to bfloat16 as ``kv_quant.quantize`` rounds them and follow page copies
(copy-on-write of a shared partial page). Tier reloads are not simulated: the runs this serves
keep every page in the pool.
"""

from __future__ import annotations

from typing import Any

import torch

from radixkv.model.attention.base import AttentionBackend, ForwardBatch
from radixkv.model.kv_quant import code_values, dequantize, quantize

__all__ = ["FakeQuantBackend", "install"]

_QMAX = {torch.int8: 127.0, torch.uint8: 448.0}


def _bf16_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """``absmax / qmax`` rounded up to a bfloat16, as ``kv_quant.quantize`` does."""
    return (amax * ((1.0 + 2.0**-8) / qmax)).to(torch.bfloat16).float()


def _round_to(x: torch.Tensor, scale: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """``x [..., D]`` rounded to the grid of ``scale [...]`` (int8 codes or e4m3 values)."""
    s = scale.unsqueeze(-1)
    return code_values(x, s, storage) * s


class FakeQuantBackend(AttentionBackend):
    """``inner`` over a float32 pool whose rows hold quantized values (module docstring).

    Args:
        inner: the backend of the float32 pool.
        pool: that pool (``KVPool``): its layers identify the caches ``forward`` is given.
        storage: ``torch.int8`` or ``torch.uint8`` (e4m3), the quantized pool simulated.
        per_page: one scale per (page, head) when True, else per (token, head) row.
    """

    def __init__(self, inner: AttentionBackend, pool: Any, storage: torch.dtype, per_page: bool):
        if pool.dtype != torch.float32:
            raise ValueError("FakeQuantBackend simulates over a float32 pool (exact code * scale)")
        self.inner, self.storage, self.per_page = inner, storage, per_page
        self.name = inner.name
        self.module = getattr(inner, "module", None)
        self.page_size = pool.page_size
        self.scales = {
            c.data_ptr(): torch.zeros(pool.num_pages, pool.num_kv_heads) for c in (*pool.k, *pool.v)
        }
        self._slots: torch.Tensor | None = None
        self.regrown = 0  # (page, head) scales grown over rows already stored, re-rounding them

    def copy_scales(self, src: list[int], dst: list[int]) -> None:
        """Page copies carry their scales (called beside ``KVPool.copy_pages``)."""
        for s in self.scales.values():
            s[torch.as_tensor(dst, dtype=torch.long)] = s[torch.as_tensor(src, dtype=torch.long)]

    def prepare(self, batch: ForwardBatch, dtype: torch.dtype) -> Any:
        self._slots = batch.out_slots.long()
        return self.inner.prepare(batch, dtype)

    def _store_values(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """The values a quantized pool would hold for the new rows ``x [T, Hkv, D]``; with
        per-page scales the rows already in touched pages are re-rounded in ``cache`` too."""
        x = x.float()
        if not self.per_page:
            return dequantize(quantize(x, self.storage), torch.float32)
        assert self._slots is not None
        qmax, p = _QMAX[self.storage], self.page_size
        pages, offs = self._slots // p, self._slots % p
        uniq, inv = torch.unique(pages, return_inverse=True)
        u, hkv = uniq.numel(), x.shape[1]
        row_amax = x.abs().amax(-1)
        amax = torch.zeros(u, hkv).scatter_reduce_(
            0, inv[:, None].expand_as(row_amax), row_amax, "amax"
        )
        first = torch.full((u,), p, dtype=torch.long).scatter_reduce_(0, inv, offs, "amin")
        scales = self.scales[cache.data_ptr()]
        old = torch.where((first > 0).unsqueeze(1), scales[uniq], 0.0)
        new = torch.maximum(old, _bf16_scale(amax, qmax))
        grown = ((new > old) & (old > 0)).any(1).nonzero().flatten()
        if grown.numel():  # re-round the rows already in the page to the grown scale
            g = uniq[grown]
            rows = cache[g]  # [G, P, Hkv, D]
            keep = torch.arange(p).unsqueeze(0) < first[grown].unsqueeze(1)  # [G, P]
            requant = _round_to(rows, new[grown].unsqueeze(1).expand(-1, p, -1), self.storage)
            rows = torch.where(keep[:, :, None, None], requant, rows)
            cache.index_copy_(0, g, rows)
            self.regrown += int(((new > old) & (old > 0))[grown].sum())
        scales[uniq] = new
        return _round_to(x, new[inv], self.storage)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: Any,
        sm_scale: float,
    ) -> torch.Tensor:
        k = self._store_values(k, k_cache).to(k.dtype).contiguous()
        v = self._store_values(v, v_cache).to(v.dtype).contiguous()
        return self.inner.forward(q, k, v, k_cache, v_cache, meta, sm_scale)


def install(engine: Any, storage: torch.dtype, per_page: bool, rotated: bool) -> None:
    """Wrap ``engine``'s backend (an unquantized float32 engine) in :class:`FakeQuantBackend`,
    inside the Hadamard rotation when ``rotated`` (as the engine runs int8), and let its page
    copies carry the simulated scales."""
    from radixkv.model.attention.rotated_kv import RotatedKVBackend

    runner = engine.runner
    fake = FakeQuantBackend(runner.backend, runner.pool, storage, per_page)
    runner.backend = RotatedKVBackend(fake, runner.pool.head_dim) if rotated else fake
    copy_pages = engine.kv.copy_pages

    def copy_with_scales(src: list[int], dst: list[int]) -> None:
        copy_pages(src, dst)
        fake.copy_scales(list(src), list(dst))

    engine.kv.copy_pages = copy_with_scales
