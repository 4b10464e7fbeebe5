"""The rotation of quantized KV pages (:mod:`radixkv.model.kv_quant`) around any backend.

:class:`RotatedKVBackend` wraps the backend of a quantized pool (``kv_quant.is_rotated``): per layer
it rotates ``q``, ``k`` and ``v`` by the ±1 Hadamard matrix ``H`` (``H H^T = b I``), lets the
wrapped backend store ``k H``, ``v H`` (quantized) and attend with the softmax scale divided by
``b`` (``qH . kH = b q . k``), and rotates the output back (``o H^T / b``). Attention is unchanged
up to rounding; what is stored has a head's outlier channels spread over all of its channels,
which is what makes one int8 scale per row cheap in accuracy. Every reader of the pages (native,
torch, Triton) sees rotated rows and rotated queries and never needs to know.
"""

from __future__ import annotations

from typing import Any

import torch

from radixkv.model.attention.base import (
    AttentionBackend,
    ForwardBatch,
    native_module_for,
    split_qkv,
)
from radixkv.model.kv_quant import hadamard

__all__ = ["RotatedKVBackend"]


class RotatedKVBackend(AttentionBackend):
    """``inner`` over rotated K/V (module docstring); ``head_dim`` sizes the rotation."""

    def __init__(self, inner: AttentionBackend, head_dim: int) -> None:
        self.inner = inner
        self.name = inner.name
        self.module = getattr(inner, "module", None)  # the fused ops follow the inner build
        self.windows_in_kernel = inner.windows_in_kernel
        self.rotation = hadamard(head_dim)
        self.block = float(self.rotation[0].abs().sum())
        self._by_dtype: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def _h(self, like: torch.Tensor) -> torch.Tensor:
        key = (like.dtype, like.device)
        h = self._by_dtype.get(key)
        if h is None:  # +-1 entries: exact in every float dtype
            h = self._by_dtype[key] = self.rotation.to(device=like.device, dtype=like.dtype)
        return h

    def prepare(self, batch: ForwardBatch, dtype: torch.dtype) -> Any:
        return self.inner.prepare(batch, dtype)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: Any,
        sm_scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        scale = sm_scale / self.block
        extra = (window,) if window else ()  # only a backend that takes windows is given one
        module = native_module_for(q)
        if module is not None:  # butterflies in one pass each (csrc/cpu_kv_store.cpp)
            qkv = _fused_rows(q, k, v)
            if qkv is not None:  # q, k, v are heads of one buffer: one pass, no copies
                qkv = module.hadamard_rows(qkv, 1.0)
                hq, hkv = q.shape[1], k.shape[1]
                q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
            else:
                q, k, v = (module.hadamard_rows(x.contiguous(), 1.0) for x in (q, k, v))
            out = self.inner.forward(q, k, v, k_cache, v_cache, meta, scale, *extra)
            return self._rotate_back(module, out)
        h = self._h(q)
        out = self.inner.forward(q @ h, k @ h, v @ h, k_cache, v_cache, meta, scale, *extra)
        return (out @ self._h(out).T).mul_(1.0 / self.block)

    def forward_qkv(
        self,
        ops: Any,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        heads: tuple[int, int, int],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: Any,
        sm_scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """RoPE and the rotation of q, k and v in one in-place pass over the fused QKV rows
        (``ops.rope_hadamard_``: the bits of ``rope_`` then the rotation, without the copies
        and the second pass), the inner backend, then the output rotated back in place."""
        if qkv.dtype != torch.bfloat16:  # float32 rows: RoPE, then forward's rotation pass
            return super().forward_qkv(
                ops, qkv, cos, sin, heads, k_cache, v_cache, meta, sm_scale, window
            )
        hq, hkv, d = heads
        ops.rope_hadamard_(qkv, cos, sin, hq + hkv, hq + 2 * hkv, d)
        q, k, v = split_qkv(qkv, heads)
        extra = (window,) if window else ()
        out = self.inner.forward(q, k, v, k_cache, v_cache, meta, sm_scale / self.block, *extra)
        return self._rotate_back(ops, out)

    def _rotate_back(self, module: Any, out: torch.Tensor) -> torch.Tensor:
        """``out H^T / b`` by the native butterflies (H is symmetric: Sylvester blocks), in
        place when ``out`` is contiguous (the backends' fresh output)."""
        if not out.is_contiguous():
            return module.hadamard_rows(out.contiguous(), 1.0 / self.block)
        module.hadamard_rows_(out, 1.0 / self.block)
        return out


def _fused_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """``[T, Hq + 2 Hkv, D]`` over the same memory when ``q [T, Hq, D]``, ``k, v [T, Hkv, D]``
    are consecutive heads of one row-major buffer (the fused QKV projection's output), so
    that one contiguous pass rotates all three; else None."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    row = (hq + 2 * hkv) * d
    es = q.element_size()
    if not (
        k.dtype == q.dtype == v.dtype
        and k.shape == v.shape == (t, hkv, d)
        and q.stride() == k.stride() == v.stride() == (row, d, 1)
        and k.data_ptr() == q.data_ptr() + hq * d * es
        and v.data_ptr() == k.data_ptr() + hkv * d * es
    ):
        return None
    return q.as_strided((t, hq + 2 * hkv, d), (row, d, 1))
