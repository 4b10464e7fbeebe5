"""Plain torch oracles for the Triton kernels.

These are written to be obviously correct rather than fast: one Python loop per request (or per
token), the request's KV gathered slot by slot through the page table, softmax in float32.
The kernels in this package are tested against them, and they are tested against a naive
contiguous attention in ``tests/test_kernels.py``.

KV layout: ``k_cache, v_cache [num_pages, page_size, Hkv, D]``; token ``pos`` of request ``b``
lives in page ``page_table[b, pos // page_size]`` at offset ``pos % page_size``.
"""

from __future__ import annotations

import torch

__all__ = [
    "decode_attention_ref",
    "extend_attention_ref",
    "gather_kv_ref",
    "store_kvcache_ref",
]


def store_kvcache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,
) -> None:
    """Write ``k[t], v[t]`` ([T, Hkv, D]) to slot ``out_slots[t]`` of the caches, in place."""
    page_size = k_cache.shape[1]
    for t, slot in enumerate(out_slots.tolist()):
        page, offset = divmod(int(slot), page_size)
        k_cache[page, offset] = k[t].to(k_cache.dtype)
        v_cache[page, offset] = v[t].to(v_cache.dtype)


def gather_kv_ref(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_row: torch.Tensor,
    length: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the first ``length`` tokens of one request as contiguous float32 ``[length, Hkv, D]``.

    ``page_row`` is the request's row of the page table.
    """
    page_size = k_cache.shape[1]
    pages = page_row.tolist()
    ks = []
    vs = []
    for pos in range(length):
        page = int(pages[pos // page_size])
        offset = pos % page_size
        ks.append(k_cache[page, offset])
        vs.append(v_cache[page, offset])
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    if not ks:
        empty = torch.empty(0, hkv, d, dtype=torch.float32, device=k_cache.device)
        return empty, empty.clone()
    return torch.stack(ks).float(), torch.stack(vs).float()


def _attend_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """Float32 attention of ``q [M, Hq, D]`` over ``k, v [N, Hkv, D]`` where ``allowed [M, N]``."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # q head h reads kv head h // group
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q.float(), k) * sm_scale
    scores = scores.masked_fill(~allowed.unsqueeze(0), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hmn,nhd->mhd", probs, v)


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """Decode attention: one query per request over its ``seq_lens[b]`` cached tokens.

    ``q [B, Hq, D]`` -> ``o [B, Hq, D]`` (dtype of q).
    """
    out = torch.empty_like(q)
    for b, length in enumerate(seq_lens.tolist()):
        k, v = gather_kv_ref(k_cache, v_cache, page_table[b], int(length))
        allowed = torch.ones(1, int(length), dtype=torch.bool, device=q.device)
        out[b] = _attend_ref(q[b : b + 1], k, v, allowed, sm_scale)[0].to(q.dtype)
    return out


def extend_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_starts: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """Extend (prefill) attention over a cached prefix plus the new tokens (already in the cache).

    New token ``i`` of request ``b`` (row ``extend_starts[b] + i`` of ``q [T, Hq, D]``) sits at
    absolute position ``prefix_lens[b] + i`` and attends to positions ``0 ..= prefix_lens[b] + i``.
    Rows of ``q`` not covered by any request are returned as zeros.
    """
    out = torch.zeros_like(q)
    for b, (prefix, ext, start) in enumerate(
        zip(prefix_lens.tolist(), extend_lens.tolist(), extend_starts.tolist(), strict=True)
    ):
        prefix, ext, start = int(prefix), int(ext), int(start)
        if ext == 0:
            continue
        k, v = gather_kv_ref(k_cache, v_cache, page_table[b], prefix + ext)
        q_pos = torch.arange(prefix, prefix + ext, device=q.device)
        k_pos = torch.arange(prefix + ext, device=q.device)
        allowed = k_pos[None, :] <= q_pos[:, None]
        out[start : start + ext] = _attend_ref(q[start : start + ext], k, v, allowed, sm_scale).to(
            q.dtype
        )
    return out
