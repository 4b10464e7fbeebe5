"""The native CPU attention backends: one C++ call per layer, K/V read in place from the pages.

Both kernels (built by :mod:`radixkv.model.native` for the host's ISA) compute, for every new
token of a step, attention over its request's cached prefix and its own new tokens (causal),
walking the page table instead of gathering pages into a contiguous copy. They handle decodes,
extends after a cached prefix and fresh prompts in the same call, with flash-style online softmax
and float32 accumulation.

- :class:`NativeAttentionBackend` (``csrc/cpu_attention.cpp``): bfloat16 queries over bfloat16
  or quantized pools, AVX512-BF16 dot products; only on hosts with AVX512-BF16 and a fast head
  dim (64, 96, 128, 256).
- :class:`NativeCascadeBackend` (``csrc/cpu_attention_f32.cpp``): float32 math over float32,
  bfloat16, float16 or quantized pools (converted in registers), any head dim, built for
  AVX-512, AVX2+FMA or the portable baseline.

Quantized pools (int8 or fp8 e4m3 codes with a bfloat16 scale per token and KV head,
:mod:`radixkv.model.kv_quant`, rows of ``D + 2`` bytes) are read in place by both kernels,
which dequantize each row in registers (``code * scale``, exact in float32); the head dim is
q's last dim, never the pool's. The backends' store quantizes the new K/V on the way in.

Both take a sliding window (``window > 0``: the query at position ``p`` sees keys
``p - window + 1 .. p``, transformers' ``sliding_window`` mask) and read only the keys inside it:
a work item starts at the first key one of its rows sees, so a windowed decode reads ``window``
keys whatever its context, and every path masks each row's keys on both sides. Mistral's layers
and Gemma 3's local ones attend this way, in the same call as any other layer.

Both take the step's shared-prefix groups (:mod:`radixkv.model.attention.prefix_groups`): each
group's shared K/V is read once per KV head for the query rows of all its members stacked (a
GEMM-like tile), and each request then continues the same online softmax over its own keys,
which is the exact log-sum-exp merge. A burst of 64 requests on one system prompt reads the
prompt's KV once per step, not 64 times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from radixkv.model import native
from radixkv.model.attention.base import (
    AttentionBackend,
    ForwardBatch,
    rows_contiguous,
    split_qkv,
    torch_store_kvcache,
)
from radixkv.model.attention.prefix_groups import PrefixGroup, shared_prefix_groups

__all__ = [
    "NativeAttentionBackend",
    "NativeCascadeBackend",
    "native_attention_supported",
    "native_cascade_supported",
    "native_paged_attention",
    "native_paged_attention_f32",
]

#: Shared prefixes shorter than this are attended per request by the native kernels.
NATIVE_MIN_SHARED_TOKENS = 16
#: Requests with more new tokens than this are attended per request, not in a shared-prefix
#: group: their own rows already fill the kernels' tiles, and the group's split (the prefix's
#: state saved, then resumed over the request's own keys) costs more than one read of the
#: prefix saves. 16 members on 768 shared tokens, grouped / per request, Zen 4, hot caches
#: (a one-off sweep): bf16 kernel 0.69x at 1 new token, 0.77x at 4, 0.94x at 8, 1.03x at 16,
#: 1.05x at 32, 1.18x at 64; float32-math kernel 0.43x, 0.53x, 0.91x, 1.09x, 1.03x at 4-64.
NATIVE_MAX_GROUPED_EXTEND = 16


def native_attention_supported(dtype: torch.dtype, head_dim: int | None = None) -> bool:
    """Whether the native bf16 kernel's fast path serves a model of ``dtype`` (bfloat16), built,
    with a fast head dim (the pool may be bfloat16 or quantized)."""
    if dtype != torch.bfloat16:
        return False
    module = native.load()
    if module is None:
        return False
    return head_dim is None or bool(module.has_fast_path(head_dim))


def _module(module: Any | None) -> Any:
    """``module``, else the default native build; ``RuntimeError`` if there is none."""
    module = module if module is not None else native.load()
    if module is None:
        raise RuntimeError(f"native CPU kernels unavailable: {native.build_error()}")
    return module


def _group_lists(groups: list[PrefixGroup] | None) -> tuple[list[int], list[int], list[int]]:
    """``groups`` as the kernels take them: members, offsets (one per group plus one), shared."""
    members: list[int] = []
    offsets: list[int] = []
    shared: list[int] = []
    for group in groups or ():
        offsets.append(len(members))
        members.extend(group.members)
        shared.append(group.shared)
    if shared:
        offsets.append(len(members))
    return members, offsets, shared


def native_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    prefix_lens: list[int],
    extend_lens: list[int],
    extend_starts: list[int],
    sm_scale: float,
    module: Any | None = None,
    groups: list[PrefixGroup] | None = None,
    window: int | None = None,
    group_args: tuple[list[int], list[int], list[int]] | None = None,
) -> torch.Tensor:
    """``q [T, Hq, D] -> o [T, Hq, D]`` (bf16) over bfloat16 or quantized pages
    (``[pages, page_size, Hkv, D + 2]`` int8 / uint8, :mod:`radixkv.model.kv_quant`); new K/V
    must already be stored.

    Same contract as :func:`radixkv.model.attention.base.torch_extend_attention` (causal over each
    request's new tokens, full over its cached prefix), with plain lists for the lengths.
    ``groups`` (see :func:`radixkv.model.attention.prefix_groups.shared_prefix_groups`) name
    requests whose first ``shared`` tokens are the same pages, read once for all members; the
    kernel checks that members really share those page ids and raises ``RuntimeError``
    otherwise. ``module`` is the native build to call (default
    :func:`radixkv.model.native.load`). Raises ``RuntimeError`` if it is unavailable.
    ``window`` (None or 0: full attention): each query sees its last ``window`` keys, itself
    included. ``group_args``: ``groups`` already as the kernel takes them
    (:attr:`NativeAttnMeta.group_args`, made once a step), used instead of ``groups``.
    """
    module = _module(module)
    table = page_table if page_table.dtype == torch.int32 else page_table.to(torch.int32)
    q = q.to(torch.bfloat16)
    if not rows_contiguous(q):
        q = q.contiguous()  # the kernel takes each token's [Hq, D] row contiguous, rows strided
    return module.paged_attention(
        q,
        k_cache,
        v_cache,
        table.contiguous(),
        prefix_lens,
        extend_lens,
        extend_starts,
        float(sm_scale),
        *(group_args if group_args is not None else _group_lists(groups)),
        int(window or 0),
    )


@dataclass
class NativeAttnMeta:
    """Per-forward arguments of the native kernels (built once, used by every layer)."""

    out_slots: torch.Tensor
    page_table: torch.Tensor
    prefix_lens: list[int]
    extend_lens: list[int]
    extend_starts: list[int]
    groups: list[PrefixGroup]
    #: ``groups`` as the kernels take them (members, offsets, shared), made once per step
    group_args: tuple[list[int], list[int], list[int]] = field(init=False)

    def __post_init__(self) -> None:
        self.group_args = _group_lists(self.groups)


class NativeAttentionBackend(AttentionBackend):
    """CPU backend over the native paged-attention kernel (bfloat16 queries; bfloat16 or
    quantized pools).

    The native build is chosen once, at construction (``isa``, else the default level of
    :func:`radixkv.model.native.load`); :attr:`isa` names it. On hosts with AMX-BF16 the
    kernel runs items of 16 or more query rows per KV head (prefill and extend blocks, shared
    prefixes' stacked rows) on AMX through oneDNN's brgemm; ``RADIXKV_AMX_ATTENTION=0`` keeps
    them on the AVX512-BF16 vector path (read when :mod:`radixkv.model.native` first loads the
    build: a process-wide switch of it).
    """

    name = "torch"
    windows_in_kernel = True

    def __init__(self, isa: str | None = None) -> None:
        self.module = native.load(isa)
        if self.module is None:
            raise RuntimeError(f"native CPU kernels unavailable: {native.build_error()}")
        self.isa: str = self.module.kernel_isa()

    def prepare(self, batch: ForwardBatch, dtype: torch.dtype) -> NativeAttnMeta:
        if batch.page_size <= 0:
            raise ValueError("ForwardBatch.page_size must be set for the torch backend")
        slots = batch.out_slots if batch.out_slots.dtype == torch.long else batch.out_slots.long()
        table = batch.page_table.to(torch.int32).contiguous()
        prefix = [int(x) for x in batch.prefix_lens]
        ext = [int(x) for x in batch.extend_lens]
        P = batch.page_size
        lead = max((n // P for n in prefix), default=0)
        pages = table[:, :lead].tolist() if lead else [[] for _ in prefix]
        return NativeAttnMeta(
            out_slots=slots,
            page_table=table,
            prefix_lens=prefix,
            extend_lens=ext,
            extend_starts=batch.extend_starts,
            groups=shared_prefix_groups(
                pages, prefix, ext, P, NATIVE_MIN_SHARED_TOKENS, NATIVE_MAX_GROUPED_EXTEND
            ),
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
        window: int | None = None,
    ) -> torch.Tensor:
        torch_store_kvcache(k, v, k_cache, v_cache, meta.out_slots, self.module)
        return native_paged_attention(
            q,
            k_cache,
            v_cache,
            meta.page_table,
            meta.prefix_lens,
            meta.extend_lens,
            meta.extend_starts,
            sm_scale,
            self.module,
            meta.groups,
            window,
            meta.group_args,
        )


def native_cascade_supported(dtype: torch.dtype) -> bool:
    """Whether the float32-math kernel serves this pool dtype (and the kernels are built):
    float32, bfloat16, float16, or quantized (int8, or uint8 holding fp8 e4m3 bits)."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8):
        return False
    module = native.load()
    return module is not None and hasattr(module, "paged_attention_f32")


def native_paged_attention_f32(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    prefix_lens: list[int],
    extend_lens: list[int],
    extend_starts: list[int],
    sm_scale: float,
    groups: list[PrefixGroup] | None = None,
    module: Any | None = None,
    window: int | None = None,
    group_args: tuple[list[int], list[int], list[int]] | None = None,
) -> torch.Tensor:
    """``q [T, Hq, D] -> o [T, Hq, D]`` (float32) over float32/bf16/fp16 or quantized pages
    (``[pages, page_size, Hkv, D + 2]`` int8 / uint8, :mod:`radixkv.model.kv_quant`), in place.

    Same contract as :func:`native_paged_attention` (``window``, ``group_args`` included); ``groups`` (see
    :func:`radixkv.model.attention.prefix_groups.shared_prefix_groups`) name requests whose
    first ``shared`` tokens are the same pages, read once for all members. The kernel checks
    that members really share those page ids and raises ``RuntimeError`` otherwise.
    """
    module = _module(module)
    table = page_table if page_table.dtype == torch.int32 else page_table.to(torch.int32)
    return module.paged_attention_f32(
        q.to(torch.float32).contiguous(),
        k_cache,
        v_cache,
        table.contiguous(),
        prefix_lens,
        extend_lens,
        extend_starts,
        float(sm_scale),
        *(group_args if group_args is not None else _group_lists(groups)),
        int(window or 0),
    )


class NativeCascadeBackend(NativeAttentionBackend):
    """CPU backend over the float32-math kernel (any ISA), with the same shared-prefix groups."""

    f32_layers_native = True

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
        """:meth:`AttentionBackend.forward_qkv` with float32 rows over a float32 pool in three
        native calls (RoPE, the store, the kernel) and no Python between them: the per-layer
        wrappers' checks and conversions cost ~25 us a layer, as much as a 1-token decode's
        kernel (Zen 3). Other dtypes and quantized pools take the general path."""
        if qkv.dtype != torch.float32 or k_cache.dtype != torch.float32:
            return super().forward_qkv(
                ops, qkv, cos, sin, heads, k_cache, v_cache, meta, sm_scale, window
            )
        hq, hkv, d = heads
        module: Any = self.module  # never None: __init__ raises without a build
        ops.rope_(qkv, cos, sin, hq + hkv, d)
        q, k, v = split_qkv(qkv, heads)  # each token's k, v row contiguous (store_kv_'s rule)
        module.store_kv_(k, v, k_cache, v_cache, meta.out_slots)
        return module.paged_attention_f32(
            q.contiguous(),
            k_cache,
            v_cache,
            meta.page_table,
            meta.prefix_lens,
            meta.extend_lens,
            meta.extend_starts,
            float(sm_scale),
            *meta.group_args,
            int(window or 0),
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
        window: int | None = None,
    ) -> torch.Tensor:
        torch_store_kvcache(k, v, k_cache, v_cache, meta.out_slots, self.module)
        out = native_paged_attention_f32(
            q,
            k_cache,
            v_cache,
            meta.page_table,
            meta.prefix_lens,
            meta.extend_lens,
            meta.extend_starts,
            sm_scale,
            meta.groups,
            self.module,
            window,
            meta.group_args,
        )
        return out if out.dtype == q.dtype else out.to(q.dtype)
