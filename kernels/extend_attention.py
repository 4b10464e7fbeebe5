"""Paged extend (prefill) attention: new tokens over a cached prefix plus themselves, causally.

The new tokens' K/V are already stored in the cache, so every key, prefix or new, is read the same
way through the page table (``slot = page_table[b, pos // P] * P + pos % P``; any page size).

Grid ``(B, Hq, cdiv(max_extend_len, BLOCK_M))``: a program owns ``BLOCK_M`` new tokens of one
request for one query head. Keys are visited in two phases with an online softmax (float32):
1. positions ``[0, prefix + start_m)``: every query row of the block sees all of them (no mask
   beyond the bound);
2. positions ``[prefix + start_m, min(prefix + start_m + BLOCK_M, seq_len))``: the diagonal block,
   with the causal mask ``key_pos <= query_pos``.

Under a sliding window ``W`` (transformers' ``sliding_window``: ``key_pos > query_pos - W``) phase
1 starts at the block's first row's first visible key, ``prefix + start_m - W + 1``, so the keys
(and pages) before it are never read, and both phases mask ``key_pos > query_pos - W`` too. A head
dim that is not a power of two (80, 96) runs in tiles of the next power of two, the extra columns
masked (:func:`.store_kv.block_d`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .store_kv import (
    block_d,
    check_kv_cache,
    check_query,
    dot_config,
    kv_read_config,
    load_kv_tile,
    tile_dot,
)

__all__ = ["extend_attention"]

_LOG2E = 1.4426950408889634


@triton.jit
def _extend_inner(
    acc,
    l_i,
    m_i,
    q,
    q_pos,
    pt_row,
    k_head,
    v_head,
    stride_ks,
    stride_vs,
    lo,
    hi,
    sm_scale_log2,
    window,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOWED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    KV_QUANT: tl.constexpr,
    KV_FP8: tl.constexpr,
    KV_ROUND_BF16: tl.constexpr,
    KV_ALIGN: tl.constexpr,
):
    """Online-softmax pass over key positions ``[lo, hi)`` of one request (under a window, a row
    may see none of a block: its max stays -inf, and it gets P = 0, alpha 0, not NaN)."""
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        page = tl.load(pt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        slot = page * PAGE_SIZE + offs_n % PAGE_SIZE
        k_t = load_kv_tile(
            k_head,
            slot,
            stride_ks,
            mask_n,
            q,
            HEAD_DIM,
            BLOCK_D,
            True,
            KV_QUANT,
            KV_FP8,
            KV_ROUND_BF16,
            KV_ALIGN,
        )
        qk = tile_dot(q, k_t, DOT_PRECISION, DOT_UPCAST) * sm_scale_log2
        if CAUSAL:
            allowed = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        else:
            allowed = mask_n[None, :]
        if WINDOWED:
            allowed = allowed & (offs_n[None, :] > q_pos[:, None] - window)
        qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        if WINDOWED:  # a row that has seen no key yet: exponents against 0, not -inf - -inf
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(qk - m_use[:, None])
        else:
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_kv_tile(
            v_head,
            slot,
            stride_vs,
            mask_n,
            q,
            HEAD_DIM,
            BLOCK_D,
            False,
            KV_QUANT,
            KV_FP8,
            KV_ROUND_BF16,
            KV_ALIGN,
        )
        acc = acc * alpha[:, None] + tile_dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    Out,
    PageTable,
    PrefixLens,
    ExtendLens,
    ExtendStarts,
    sm_scale_log2,
    window,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_pt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOWED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    KV_QUANT: tl.constexpr,
    KV_FP8: tl.constexpr,
    KV_ROUND_BF16: tl.constexpr,
    KV_ALIGN: tl.constexpr,
):
    b = tl.program_id(0)
    hq = tl.program_id(1)
    start_m = tl.program_id(2) * BLOCK_M
    ext_len = tl.load(ExtendLens + b).to(tl.int32)
    if start_m >= ext_len:
        return
    prefix = tl.load(PrefixLens + b).to(tl.int32)
    row0 = tl.load(ExtendStarts + b).to(tl.int64)
    kvh = hq // GROUP

    offs_m = start_m + tl.arange(0, BLOCK_M)
    mask_m = offs_m < ext_len
    offs_d = tl.arange(0, BLOCK_D)
    mask_md = mask_m[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = row0 + offs_m
    q = tl.load(
        Q + rows[:, None] * stride_qt + hq.to(tl.int64) * stride_qh + offs_d[None, :],
        mask=mask_md,
        other=0.0,
    )
    q_pos = prefix + offs_m

    pt_row = PageTable + b.to(tl.int64) * stride_pt
    k_head = K + kvh.to(tl.int64) * stride_kh
    v_head = V + kvh.to(tl.int64) * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    full_end = prefix + start_m
    first = 0  # the first key a row of the block sees (its first row's window start)
    if WINDOWED:
        first = tl.maximum(full_end - window + 1, 0)
    acc, l_i, m_i = _extend_inner(
        acc,
        l_i,
        m_i,
        q,
        q_pos,
        pt_row,
        k_head,
        v_head,
        stride_ks,
        stride_vs,
        first,
        full_end,
        sm_scale_log2,
        window,
        HEAD_DIM,
        BLOCK_D,
        PAGE_SIZE,
        BLOCK_N,
        False,
        WINDOWED,
        DOT_PRECISION,
        DOT_UPCAST,
        KV_QUANT,
        KV_FP8,
        KV_ROUND_BF16,
        KV_ALIGN,
    )
    diag_end = tl.minimum(full_end + BLOCK_M, prefix + ext_len)
    acc, l_i, m_i = _extend_inner(
        acc,
        l_i,
        m_i,
        q,
        q_pos,
        pt_row,
        k_head,
        v_head,
        stride_ks,
        stride_vs,
        full_end,
        diag_end,
        sm_scale_log2,
        window,
        HEAD_DIM,
        BLOCK_D,
        PAGE_SIZE,
        BLOCK_N,
        True,
        WINDOWED,
        DOT_PRECISION,
        DOT_UPCAST,
        KV_QUANT,
        KV_FP8,
        KV_ROUND_BF16,
        KV_ALIGN,
    )

    # every row sees itself at least (rows past the request's tokens are never stored)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptr = Out + rows[:, None] * stride_ot + hq.to(tl.int64) * stride_oh + offs_d[None, :]
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=mask_md)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_starts: torch.Tensor,
    sm_scale: float,
    *,
    out: torch.Tensor | None = None,
    max_extend_len: int | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Paged extend attention, causal over the new tokens and full over the cached prefix.

    Args:
        q: ``[T, Hq, D]`` queries of every request's new tokens, request after request
            (fp32, bf16 or fp16).
        k_cache, v_cache: ``[num_pages, page_size, Hkv, D]``, same dtype as ``q`` (or quantized
            rows ``[..., D + 2]``, int8 / uint8 e4m3, :mod:`.store_kv`, attended as
            ``code * scale`` in ``q``'s dtype), already holding the new tokens' K/V at positions
            ``prefix_lens[b] .. prefix_lens[b]+extend_lens[b]-1``.
        page_table: ``[B, max_pages]`` int32 page ids, padded (padding is never read).
        prefix_lens: ``[B]`` int32, cached tokens before the new ones.
        extend_lens: ``[B]`` int32, new tokens per request (0 allowed).
        extend_starts: ``[B]`` int32, row of ``q`` holding each request's first new token.
        sm_scale: softmax scale, usually ``D ** -0.5``.
        out: optional ``[T, Hq, D]`` output of ``q``'s dtype; the rows of every request's new
            tokens are written (rows belonging to no request are left as they are).
        max_extend_len: ``max(extend_lens)`` if the caller knows it (avoids a device sync).
        window: a sliding window (None or 0: full attention): the new token at position ``p``
            sees keys ``p - window + 1 .. p`` (transformers' ``sliding_window``); the keys before
            a block's windows are not read.

    Returns:
        ``o [T, Hq, D]`` in ``q``'s dtype (accumulated in float32).
    """
    _, page_size, hkv, d = check_kv_cache(k_cache, v_cache)
    _, hq = check_query(q, k_cache, "T")
    batch = page_table.shape[0]
    assert page_table.dim() == 2 and page_table.stride(1) == 1, (
        "page_table must be [B, max_pages] with contiguous rows"
    )
    for name, t in (
        ("prefix_lens", prefix_lens),
        ("extend_lens", extend_lens),
        ("extend_starts", extend_starts),
    ):
        assert t.shape == (batch,), f"{name} must be [B={batch}], got {tuple(t.shape)}"
        assert t.device == q.device, f"{name} must be on {q.device}"
    assert q.device == k_cache.device == page_table.device, "all tensors must be on one device"
    if out is None:
        out = torch.empty_like(q)
    else:
        assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, (
            f"out must be a [T, Hq, D] {q.dtype} tensor contiguous in D"
        )
    if batch == 0 or q.shape[0] == 0:
        return out
    if max_extend_len is None:
        max_extend_len = int(extend_lens.max().item())
    if max_extend_len == 0:
        return out

    window = int(window or 0)
    assert window >= 0, f"window must be >= 0 (0: full attention), got {window}"
    bd = block_d(d)
    if q.device.type == "cuda":
        # fp32 tiles are twice the shared memory: halve the key block past D=64
        block_m = 64
        block_n = 64 if bd * q.element_size() <= 256 else 32
    else:  # interpreter: bigger tiles are cheaper, but keep padding small for short tests
        block_m, block_n = 32, 64
    dot_precision, dot_upcast = dot_config(q.dtype)
    grid = (batch, hq, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        page_table,
        prefix_lens,
        extend_lens,
        extend_starts,
        sm_scale * _LOG2E,
        window,
        q.stride(0),
        q.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        page_table.stride(0),
        GROUP=hq // hkv,
        HEAD_DIM=d,
        BLOCK_D=bd,
        PAGE_SIZE=page_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        WINDOWED=window > 0,
        DOT_PRECISION=dot_precision,
        DOT_UPCAST=dot_upcast,
        **kv_read_config(k_cache, q.dtype, v_cache),
        num_warps=4 if bd <= 64 else 8,
        num_stages=2,
    )
    return out
