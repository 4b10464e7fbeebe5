"""Paged decode attention (one query token per request) with GQA and split-K (flash-decoding).

Stage 1: grid ``(B, Hkv, num_splits)``. A program takes every query head of one KV group (so the
group's K/V is read once) and one contiguous chunk of the request's keys (its last ``window`` of
them under a sliding window: the pages before are never read), reads K/V block by block through
the page table (``slot = page_table[b, pos // P] * P + pos % P``, so any page size
works) and runs an online softmax. With one split it writes the normalised output directly;
otherwise it writes the chunk's normalised partial output and its log-sum-exp (base 2).
Stage 2: grid ``(B, Hq)``, merges the splits' partial outputs weighted by their log-sum-exp.
All accumulation is float32. A head dim that is not a power of two (80, 96) runs in tiles of the
next power of two, the extra columns masked (:func:`.store_kv.block_d`).
"""

from __future__ import annotations

import functools

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

__all__ = ["choose_num_kv_splits", "decode_attention"]

_LOG2E = 1.4426950408889634
# A split below this many tokens costs more in the reduction than it gains in parallelism.
MIN_TOKENS_PER_SPLIT = 256
MAX_KV_SPLITS = 32


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a small stand-in when not on a GPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def choose_num_kv_splits(
    max_seq_len: int, batch_size: int, num_kv_heads: int, device: torch.device
) -> int:
    """Number of sequence splits for stage 1.

    Enough splits that ``batch * Hkv * splits`` fills the device about twice over, but no split
    shorter than ``MIN_TOKENS_PER_SPLIT`` tokens and at most ``MAX_KV_SPLITS``.
    """
    if max_seq_len <= MIN_TOKENS_PER_SPLIT:
        return 1
    by_length = triton.cdiv(max_seq_len, MIN_TOKENS_PER_SPLIT)
    by_occupancy = triton.cdiv(2 * _num_sms(device), max(1, batch_size * num_kv_heads))
    return max(1, min(by_length, by_occupancy, MAX_KV_SPLITS))


@triton.jit
def _decode_stage1_kernel(
    Q,
    K,
    V,
    PageTable,
    SeqLens,
    MidO,
    MidLse,
    Out,
    sm_scale_log2,
    window,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_pt,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    KV_QUANT: tl.constexpr,
    KV_FP8: tl.constexpr,
    KV_ROUND_BF16: tl.constexpr,
    KV_ALIGN: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(SeqLens + b).to(tl.int32)
    # the query (position seq_len - 1) sees keys first .. seq_len - 1
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    per_split = tl.cdiv(seq_len - first, NUM_SPLITS)
    start = first + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GROUP
    heads = kvh * GROUP + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    mask_hd = mask_h[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_hd,
        other=0.0,
    )
    pt_row = PageTable + b.to(tl.int64) * stride_pt
    k_head = K + kvh.to(tl.int64) * stride_kh
    v_head = V + kvh.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
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
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
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

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        o_ptr = Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=mask_hd)
    else:
        mo_ptr = (
            MidO
            + b.to(tl.int64) * stride_mob
            + heads[:, None] * stride_moh
            + split * stride_mos
            + offs_d[None, :]
        )
        tl.store(mo_ptr, out, mask=mask_hd)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        ml_ptr = MidLse + b.to(tl.int64) * stride_mlb + heads * stride_mlh + split
        tl.store(ml_ptr, lse, mask=mask_h)


@triton.jit
def _decode_stage2_kernel(
    MidO,
    MidLse,
    Out,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(
        MidLse + b * stride_mlb + h * stride_mlh + offs_s, mask=mask_s, other=float("-inf")
    )
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # only for an empty sequence: output 0, not NaN
    w = tl.exp2(lse - m)
    part = tl.load(
        MidO + b * stride_mob + h * stride_moh + offs_s[:, None] * stride_mos + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    denom = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(
        Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    *,
    out: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
    max_seq_len: int | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Paged decode attention: ``o[b] = softmax(q[b] K_b^T * sm_scale) V_b``.

    Args:
        q: ``[B, Hq, D]`` query of each request's one new token (fp32, bf16 or fp16).
        k_cache, v_cache: ``[num_pages, page_size, Hkv, D]``, same dtype as ``q``, or quantized
            rows ``[num_pages, page_size, Hkv, D + 2]`` (int8 / uint8 e4m3, :mod:`.store_kv`),
            attended as ``code * scale`` in ``q``'s dtype; ``Hq = Hkv * group`` (query head
            ``h`` reads KV head ``h // group``).
        page_table: ``[B, max_pages]`` int32 page ids, padded (padding is never read).
        seq_lens: ``[B]`` int32, tokens of each request in the cache (the new one included), >= 1.
        sm_scale: softmax scale, usually ``D ** -0.5``.
        out: optional ``[B, Hq, D]`` output buffer of ``q``'s dtype (every element is written).
        num_kv_splits: force the number of sequence splits (default: ``choose_num_kv_splits``).
        max_seq_len: ``max(seq_lens)`` if the caller knows it (avoids a device sync); only
            used to choose the number of splits.
        window: a sliding window (None or 0: full attention): each query sees its request's
            last ``window`` keys (itself included, transformers' ``sliding_window``), and only
            those are read.

    Returns:
        ``o [B, Hq, D]`` in ``q``'s dtype (accumulated in float32).
    """
    _, page_size, hkv, d = check_kv_cache(k_cache, v_cache)
    batch, hq = check_query(q, k_cache, "B")
    assert page_table.dim() == 2 and page_table.shape[0] == batch, (
        f"page_table must be [B={batch}, max_pages], got {tuple(page_table.shape)}"
    )
    assert page_table.stride(1) == 1, "page_table rows must be contiguous"
    assert seq_lens.shape == (batch,), f"seq_lens must be [B={batch}], got {tuple(seq_lens.shape)}"
    assert q.device == k_cache.device == page_table.device == seq_lens.device, (
        "all tensors must be on one device"
    )
    group = hq // hkv
    if out is None:
        out = torch.empty_like(q)
    else:
        assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, (
            f"out must be a [B, Hq, D] {q.dtype} tensor contiguous in D"
        )
    if batch == 0:
        return out

    window = int(window or 0)
    assert window >= 0, f"window must be >= 0 (0: full attention), got {window}"
    if num_kv_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max().item())
        keys = min(max_seq_len, window) if window else max_seq_len  # the most keys one reads
        num_kv_splits = choose_num_kv_splits(keys, batch, hkv, q.device)
    assert num_kv_splits >= 1, f"num_kv_splits must be >= 1, got {num_kv_splits}"

    if num_kv_splits > 1:
        mid_o = torch.empty(batch, hq, num_kv_splits, d, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(batch, hq, num_kv_splits, dtype=torch.float32, device=q.device)
    else:  # stage 1 writes ``out`` directly; these are never touched
        mid_o = out
        mid_lse = out

    block_n = 64 if block_d(d) <= 128 else 32
    dot_precision, dot_upcast = dot_config(q.dtype)
    _decode_stage1_kernel[(batch, hkv, num_kv_splits)](
        q,
        k_cache,
        v_cache,
        page_table,
        seq_lens,
        mid_o,
        mid_lse,
        out,
        sm_scale * _LOG2E,
        window,
        q.stride(0),
        q.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(1),
        v_cache.stride(2),
        page_table.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d,
        BLOCK_D=block_d(d),
        PAGE_SIZE=page_size,
        BLOCK_N=block_n,
        NUM_SPLITS=num_kv_splits,
        DOT_PRECISION=dot_precision,
        DOT_UPCAST=dot_upcast,
        **kv_read_config(k_cache, q.dtype, v_cache),
        num_warps=4,
        num_stages=2,
    )
    if num_kv_splits > 1:
        _decode_stage2_kernel[(batch, hq)](
            mid_o,
            mid_lse,
            out,
            mid_o.stride(0),
            mid_o.stride(1),
            mid_o.stride(2),
            mid_lse.stride(0),
            mid_lse.stride(1),
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=num_kv_splits,
            BLOCK_S=triton.next_power_of_2(num_kv_splits),
            HEAD_DIM=d,
            BLOCK_D=block_d(d),
            num_warps=4 if d >= 128 else 2,
        )
    return out
