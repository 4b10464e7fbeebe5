"""Attention over contiguous per-sequence K/V views (``kv_layout="virtual"``), no page table.

New K/V are stored through the pool's paged view (the same memfd pages the views map), then each
request attends with ``F.scaled_dot_product_attention`` over ``[seq_len, Hkv, D]`` views of its
virtual ranges (:class:`~radixkv.model.virtual_kv.VirtualKV`): causal over its new tokens, full
over its cached prefix. A request with no cached prefix attends to its fresh K/V directly, as the
paged torch backend does, so float32 outputs match it.

The engine names each request's range in ``batch.virtual_keys``; a batch without it
(the mapping budget ran out, see :class:`~radixkv.model.virtual_kv.MapLimitError`) runs on the
paged torch backend over the same memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from radixkv.model.attention.base import AttentionBackend, ForwardBatch, torch_store_kvcache
from radixkv.model.attention.torch_backend import TorchAttentionBackend
from radixkv.model.virtual_kv import VirtualKV

__all__ = ["VirtualAttentionBackend"]


@dataclass
class _Req:
    start: int
    n: int
    prefix: int
    views: list[torch.Tensor]  # per tensor (2 * layer + K|V): [max_tokens, Hkv, D]
    mask: torch.Tensor | None  # [n, prefix + n] bool when prefix > 0 and n > 1


@dataclass
class VirtualAttnMeta:
    out_slots: torch.Tensor
    reqs: list[_Req]


class VirtualAttentionBackend(AttentionBackend):
    """SDPA over each request's contiguous virtual K/V ranges (CPU, any dtype)."""

    name = "virtual"

    def __init__(self, virtual: VirtualKV) -> None:
        self.virtual = virtual
        self.paged = TorchAttentionBackend()
        pool = virtual.pool
        self._layer_of = {pool.k[i].data_ptr(): i for i in range(pool.num_layers)}

    def prepare(self, batch: ForwardBatch, dtype: torch.dtype) -> Any:
        keys = batch.virtual_keys
        if keys is None:
            return ("paged", self.paged.prepare(batch, dtype))
        reqs = []
        page_size = self.virtual.pool.page_size
        for key, p, n, s in zip(keys, batch.prefix_lens, batch.extend_lens, batch.extend_starts):
            rng = self.virtual.ranges[key]
            need = -(-(p + n) // page_size)
            if need > len(rng.slots) or any(x < 0 for x in rng.slots[:need]):
                raise RuntimeError(f"sequence {key}: {p + n} tokens but mapped {rng.slots}")
            mask = None
            if p > 0 and n > 1:
                q_pos = torch.arange(p, p + n).unsqueeze(1)
                mask = torch.arange(p + n).unsqueeze(0) <= q_pos
            reqs.append(_Req(s, n, p, rng.views, mask))
        slots = batch.out_slots if batch.out_slots.dtype == torch.long else batch.out_slots.long()
        return VirtualAttnMeta(slots, reqs)

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
        if isinstance(meta, tuple):
            return self.paged.forward(q, k, v, k_cache, v_cache, meta[1], sm_scale)
        torch_store_kvcache(k, v, k_cache, v_cache, meta.out_slots)
        layer = self._layer_of[k_cache.data_ptr()]
        hq, hkv = q.shape[1], k_cache.shape[2]
        dtype = k_cache.dtype
        one = len(meta.reqs) == 1
        out = None if one else torch.empty(q.shape, dtype=dtype, device=q.device)
        for r in meta.reqs:
            rows = slice(r.start, r.start + r.n)
            if r.prefix == 0:
                keys, values, causal = k[rows].to(dtype), v[rows].to(dtype), r.n > 1
            else:
                total = r.prefix + r.n
                keys = r.views[2 * layer][:total]
                values = r.views[2 * layer + 1][:total]
                causal = False
            o = F.scaled_dot_product_attention(
                q[rows].to(dtype).transpose(0, 1).unsqueeze(0),
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=r.mask,
                is_causal=causal,
                scale=sm_scale,
                enable_gqa=hq != hkv,
            )
            o = o.squeeze(0).transpose(0, 1)
            if one:
                return o
            assert out is not None
            out[rows] = o
        assert out is not None
        return out
