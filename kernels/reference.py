"""Plain torch oracles for the Triton kernels.

These are written to be obviously correct rather than fast: one Python loop per request (or per
token), the request's KV gathered slot by slot through the page table, softmax in float32.
The kernels in this package are tested against them, and they are tested against a naive
contiguous attention in ``tests/test_kernels.py``.

KV layout: ``k_cache, v_cache [num_pages, page_size, Hkv, D]``; token ``pos`` of request ``b``
lives in page ``page_table[b, pos // page_size]`` at offset ``pos % page_size``.

Quantized caches (``torch.int8`` codes, or ``torch.uint8`` holding float8 e4m3 bits) are
``[num_pages, page_size, Hkv, D + 2]``: each ``(token, head)`` row is ``D`` codes and then its
scale as a little-endian bfloat16, value ``code * scale``. That contract is
``radixkv.model.kv_quant``'s (which this package may not import: it sits below ``radixkv.model``);
:func:`quantize_rows_ref` and :func:`dequantize_rows_ref` restate it in plain torch, and the tests
hold them to ``kv_quant``'s bytes.
"""

from __future__ import annotations

import torch

__all__ = [
    "KV_QMAX",
    "KV_SCALE_BYTES",
    "decode_attention_ref",
    "dequantize_rows_ref",
    "extend_attention_ref",
    "gather_kv_ref",
    "is_quantized_cache",
    "quantize_rows_ref",
    "store_kvcache_ref",
]

#: Bytes of a quantized row's scale (a bfloat16), after its ``D`` codes.
KV_SCALE_BYTES = 2
#: Quantized cache dtypes -> the largest code: int8 codes, or float8 e4m3 bits in ``uint8``.
KV_QMAX = {torch.int8: 127.0, torch.uint8: 448.0}


def is_quantized_cache(cache: torch.Tensor) -> bool:
    """Whether ``cache`` holds quantized rows (codes + a bf16 scale) rather than values."""
    return cache.dtype in KV_QMAX


def quantize_rows_ref(x: torch.Tensor, storage_dtype: torch.dtype) -> torch.Tensor:
    """Rows ``x [..., D]`` (any float dtype) as quantized rows ``[..., D + 2]``: the scale is
    ``absmax / qmax`` widened by ``2^-8`` and rounded to bfloat16, the codes ``x * (1 / scale)``
    rounded (int8: half to even, clamped to +-127; e4m3: clamped to +-448, then rounded)."""
    qmax = KV_QMAX[storage_dtype]
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) * ((1.0 + 2.0**-8) / qmax)).to(torch.bfloat16)
    sf = scale.float()
    inv = torch.where(sf > 0, 1.0 / sf.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    y = xf * inv
    if storage_dtype == torch.int8:
        codes = y.round().clamp(-qmax, qmax).to(torch.int8)
    else:
        codes = y.clamp(-qmax, qmax).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([codes, scale.view(storage_dtype)], dim=-1)


def dequantize_rows_ref(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Quantized rows ``[..., D + 2]`` back to values ``[..., D]`` in ``dtype``."""
    d = rows.shape[-1] - KV_SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.bfloat16).float()
    codes = rows[..., :d]
    if rows.dtype == torch.uint8:
        codes = codes.contiguous().view(torch.float8_e4m3fn)
    return (codes.float() * scale).to(dtype)


def store_kvcache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,
) -> None:
    """Write ``k[t], v[t]`` ([T, Hkv, D]) to slot ``out_slots[t]`` of the caches, in place
    (quantized by :func:`quantize_rows_ref` into a quantized cache)."""
    page_size = k_cache.shape[1]
    if is_quantized_cache(k_cache):
        k, v = quantize_rows_ref(k, k_cache.dtype), quantize_rows_ref(v, v_cache.dtype)
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
    """Return the first ``length`` tokens of one request as contiguous float32 ``[length, Hkv, D]``
    (dequantized from a quantized cache).

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
    quantized = is_quantized_cache(k_cache)
    hkv, d = k_cache.shape[2], k_cache.shape[3] - (KV_SCALE_BYTES if quantized else 0)
    if not ks:
        empty = torch.empty(0, hkv, d, dtype=torch.float32, device=k_cache.device)
        return empty, empty.clone()
    if quantized:
        return dequantize_rows_ref(torch.stack(ks)), dequantize_rows_ref(torch.stack(vs))
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
    window: int | None = None,
) -> torch.Tensor:
    """Decode attention: one query per request over its ``seq_lens[b]`` cached tokens (its last
    ``window`` of them with a sliding window).

    ``q [B, Hq, D]`` -> ``o [B, Hq, D]`` (dtype of q).
    """
    out = torch.empty_like(q)
    for b, length in enumerate(seq_lens.tolist()):
        k, v = gather_kv_ref(k_cache, v_cache, page_table[b], int(length))
        allowed = torch.ones(1, int(length), dtype=torch.bool, device=q.device)
        if window:
            allowed[:, : max(0, int(length) - window)] = False
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
    window: int | None = None,
) -> torch.Tensor:
    """Extend (prefill) attention over a cached prefix plus the new tokens (already in the cache).

    New token ``i`` of request ``b`` (row ``extend_starts[b] + i`` of ``q [T, Hq, D]``) sits at
    absolute position ``prefix_lens[b] + i`` and attends to positions ``0 ..= prefix_lens[b] + i``
    (with a sliding ``window``: the positions above ``prefix_lens[b] + i - window``, as
    transformers' ``sliding_window`` mask). Rows of ``q`` not covered by any request are returned
    as zeros.
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
        if window:
            allowed &= k_pos[None, :] > q_pos[:, None] - window
        out[start : start + ext] = _attend_ref(q[start : start + ext], k, v, allowed, sm_scale).to(
            q.dtype
        )
    return out
