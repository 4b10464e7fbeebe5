"""The native CPU attention backend: one C++ call per layer, K/V read in place from the pages.

``radixkv/model/csrc/cpu_attention.cpp`` (built by :mod:`radixkv.model.native`) computes, for every new token
of a step, attention over its request's cached prefix and its own new tokens (causal), walking
the page table instead of gathering pages into a contiguous copy. It handles decodes, extends
after a cached prefix and fresh prompts in the same call, with flash-style online softmax,
AVX512-BF16 dot products and float32 accumulation. It serves bfloat16 pools; float32 (the accuracy
mode) keeps the plain torch backend.

Requests that share tree pages read the same memory, so a shared system prompt stays hot in the
CPU caches across the requests of a step without an explicit cascade split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from radixkv.model import native
from radixkv.model.attention.base import AttentionBackend, ForwardBatch, torch_store_kvcache

__all__ = ["NativeAttentionBackend", "native_attention_supported", "native_paged_attention"]


def native_attention_supported(dtype: torch.dtype, head_dim: int | None = None) -> bool:
    """Whether the native kernel serves this pool: bfloat16, built, and a fast head dim."""
    if dtype != torch.bfloat16:
        return False
    module = native.load()
    if module is None:
        return False
    return head_dim is None or bool(module.has_fast_path(head_dim))


def native_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    prefix_lens: list[int],
    extend_lens: list[int],
    extend_starts: list[int],
    sm_scale: float,
) -> torch.Tensor:
    """``q [T, Hq, D] -> o [T, Hq, D]`` (bf16) over the pages; new K/V must already be stored.

    Same contract as :func:`radixkv.model.attention.base.torch_extend_attention` (causal over each
    request's new tokens, full over its cached prefix), with plain lists for the lengths.
    Raises ``RuntimeError`` if the native module is unavailable.
    """
    module = native.load()
    if module is None:
        raise RuntimeError(f"native CPU kernels unavailable: {native.build_error()}")
    table = page_table if page_table.dtype == torch.int32 else page_table.to(torch.int32)
    return module.paged_attention(
        q.to(torch.bfloat16).contiguous(),
        k_cache,
        v_cache,
        table.contiguous(),
        prefix_lens,
        extend_lens,
        extend_starts,
        float(sm_scale),
    )


@dataclass
class NativeAttnMeta:
    """Per-forward arguments of the native kernel (built once, used by every layer)."""

    out_slots: torch.Tensor
    page_table: torch.Tensor
    prefix_lens: list[int]
    extend_lens: list[int]
    extend_starts: list[int]


class NativeAttentionBackend(AttentionBackend):
    """CPU backend over the native paged-attention kernel (bfloat16 pools)."""

    name = "torch"

    def __init__(self) -> None:
        self.module = native.load()
        if self.module is None:
            raise RuntimeError(f"native CPU kernels unavailable: {native.build_error()}")

    def prepare(self, batch: ForwardBatch, dtype: torch.dtype) -> NativeAttnMeta:
        if batch.page_size <= 0:
            raise ValueError("ForwardBatch.page_size must be set for the torch backend")
        slots = batch.out_slots if batch.out_slots.dtype == torch.long else batch.out_slots.long()
        return NativeAttnMeta(
            out_slots=slots,
            page_table=batch.page_table.to(torch.int32).contiguous(),
            prefix_lens=[int(x) for x in batch.prefix_lens],
            extend_lens=[int(x) for x in batch.extend_lens],
            extend_starts=batch.extend_starts,
        )

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
        torch_store_kvcache(k, v, k_cache, v_cache, meta.out_slots)
        return native_paged_attention(
            q,
            k_cache,
            v_cache,
            meta.page_table,
            meta.prefix_lens,
            meta.extend_lens,
            meta.extend_starts,
            sm_scale,
        )
