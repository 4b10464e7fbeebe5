"""Triton kernels for paged KV attention, and their torch reference oracles.

Shipped as ``radixkv.kernels``. KV layout (per layer): ``k_cache, v_cache [num_pages, page_size,
Hkv, D]``; a token lives at slot ``page * page_size + offset``. See ``docs/design.md`` ("Kernels").

- :func:`store_kvcache` writes new tokens' K/V into their slots;
- :func:`decode_attention` one query token per request, split-K over the sequence;
- :func:`extend_attention` new tokens over a cached prefix plus themselves (causal);
- ``*_ref``: plain torch implementations, the oracles the kernels are tested against.
"""

from __future__ import annotations

from .decode_attention import choose_num_kv_splits, decode_attention
from .extend_attention import extend_attention
from .reference import decode_attention_ref, extend_attention_ref, store_kvcache_ref
from .store_kv import store_kvcache

__all__ = [
    "choose_num_kv_splits",
    "decode_attention",
    "decode_attention_ref",
    "extend_attention",
    "extend_attention_ref",
    "store_kvcache",
    "store_kvcache_ref",
]
