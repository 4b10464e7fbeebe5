"""Triton kernels for paged KV attention, and their torch reference oracles.

Shipped as ``radixkv.kernels``. KV layout (per layer): ``k_cache, v_cache [num_pages, page_size,
Hkv, D]``; a token lives at slot ``page * page_size + offset``. See ``docs/design.md`` ("Kernels").

- :func:`store_kvcache` writes new tokens' K/V into their slots;
- :func:`decode_attention` one query token per request, split-K over the sequence;
- :func:`extend_attention` new tokens over a cached prefix plus themselves (causal);
- ``*_ref``: plain torch implementations, the oracles the kernels are tested against.

Triton is imported on first use of a kernel, not with the package (PEP 562 ``__getattr__``): a
CPU host never loads it for radixkv, even when something imports this package without using it
(the Triton kernels import triton at module level).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from radixkv.package_folders import package_path

#: This module is the package ``radixkv.kernels``; its modules live in ``kernels/`` (see
#: :mod:`radixkv.package_folders`).
__path__ = package_path(__file__, "kernels")

from radixkv.kernels.reference import (  # noqa: E402 (after __path__)
    decode_attention_ref,
    extend_attention_ref,
    store_kvcache_ref,
)

if TYPE_CHECKING:
    from radixkv.kernels.decode_attention import choose_num_kv_splits, decode_attention
    from radixkv.kernels.extend_attention import extend_attention
    from radixkv.kernels.store_kv import store_kvcache

#: The Triton kernels: exported name -> submodule.
_TRITON = {
    "choose_num_kv_splits": "decode_attention",
    "decode_attention": "decode_attention",
    "extend_attention": "extend_attention",
    "store_kvcache": "store_kv",
}


def __getattr__(name: str) -> Any:
    """Import the Triton kernels on first use and bind every one of them (a submodule named
    like its kernel, ``decode_attention``, is replaced by the kernel as an eager import did)."""
    if name not in _TRITON:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    for export, module in _TRITON.items():
        globals()[export] = getattr(importlib.import_module(f".{module}", __name__), export)
    return globals()[name]


__all__ = [
    "choose_num_kv_splits",
    "decode_attention",
    "decode_attention_ref",
    "extend_attention",
    "extend_attention_ref",
    "store_kvcache",
    "store_kvcache_ref",
]
