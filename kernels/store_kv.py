"""Triton kernel that writes new tokens' K/V into their slots of the paged KV cache.

Also holds the layout checks shared by the attention kernels of this package.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = [
    "SUPPORTED_DTYPES",
    "check_head_dim",
    "check_kv_cache",
    "dot_config",
    "store_kvcache",
    "tile_dot",
]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _interpreting() -> bool:
    """Whether Triton runs kernels under its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_config(dtype: torch.dtype) -> tuple[str, bool]:
    """``(DOT_PRECISION, DOT_UPCAST)`` constexprs for :func:`tile_dot` on ``dtype`` tiles.

    float32 uses exact IEEE products (no TF32). The interpreter's ``tl.dot`` gives garbage on
    bfloat16 operands (seen with triton 3.9), so there the operands are upcast to float32 first
    (after any rounding to bfloat16, so the result matches what the GPU computes).
    """
    precision = "ieee" if dtype == torch.float32 else "tf32"
    return precision, _interpreting() and dtype == torch.bfloat16


@triton.jit
def tile_dot(a, b, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """``a @ b`` with a float32 result; see :func:`dot_config` for the two constexprs."""
    if DOT_UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)


def check_query(q: torch.Tensor, k_cache: torch.Tensor, rows: str) -> tuple[int, int]:
    """Check ``q [rows, Hq, D]`` against the cache (head dim, GQA ratio, dtype, layout).
    Returns ``(rows, Hq)``."""
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    assert q.dim() == 3, f"q must be [{rows}, Hq, D], got {tuple(q.shape)}"
    n, hq, qd = q.shape
    check_head_dim(qd)
    assert qd == d, f"q head_dim {qd} != cache head_dim {d}"
    assert hq % hkv == 0, f"Hq={hq} must be a multiple of Hkv={hkv}"
    assert q.dtype == k_cache.dtype, f"q dtype {q.dtype} != cache dtype {k_cache.dtype}"
    assert q.stride(2) == 1, "q must be contiguous in head_dim"
    return n, hq


def check_head_dim(head_dim: int) -> None:
    """Assert that ``head_dim`` is a power of two of at least 16 (what the kernels' tiles need)."""
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, (
        f"head_dim must be a power of two >= 16 (e.g. 64 or 128), got {head_dim}"
    )


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate a per-layer cache pair and return ``(num_pages, page_size, Hkv, D)``.

    The kernels address a token by ``slot = page * page_size + offset`` with the slot stride
    ``stride(1)``, so a page's stride must be ``page_size * stride(1)`` and ``D`` contiguous.
    """
    assert k_cache.dim() == 4, (
        f"k_cache must be [num_pages, page_size, Hkv, D], got {k_cache.shape}"
    )
    assert v_cache.shape == k_cache.shape, (
        f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}"
    )
    assert k_cache.dtype == v_cache.dtype, (
        f"k/v cache dtypes differ: {k_cache.dtype}, {v_cache.dtype}"
    )
    assert k_cache.dtype in SUPPORTED_DTYPES, f"unsupported cache dtype {k_cache.dtype}"
    num_pages, page_size, hkv, d = k_cache.shape
    check_head_dim(d)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        assert c.stride(3) == 1, f"{name} must be contiguous in head_dim"
        assert c.stride(0) == page_size * c.stride(1), (
            f"{name} pages must be laid out back to back (stride(0) == page_size * stride(1))"
        )
    return num_pages, page_size, hkv, d


@triton.jit
def _store_kvcache_kernel(
    K,
    V,
    KCache,
    VCache,
    Slots,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_s,
    stride_kc_h,
    stride_vc_s,
    stride_vc_h,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """One program per new token: copy its ``[Hkv, D]`` K and V rows to its slot."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < NUM_HEADS)[:, None]
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    kc_ptr = KCache + slot * stride_kc_s + offs_h[:, None] * stride_kc_h + offs_d[None, :]
    vc_ptr = VCache + slot * stride_vc_s + offs_h[:, None] * stride_vc_h + offs_d[None, :]
    tl.store(kc_ptr, k.to(KCache.dtype.element_ty), mask=mask)
    tl.store(vc_ptr, v.to(VCache.dtype.element_ty), mask=mask)


def store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,
) -> None:
    """Write ``k[t], v[t]`` (``[T, Hkv, D]``) into slot ``out_slots[t]`` of ``k_cache, v_cache``.

    ``k_cache, v_cache`` are ``[num_pages, page_size, Hkv, D]``; slot ``s`` is page
    ``s // page_size``, offset ``s % page_size``. ``out_slots`` is int64 (int32 accepted).
    Values are cast to the cache dtype. Slots must be distinct and in range (not checked on device).
    """
    _, _, hkv, d = check_kv_cache(k_cache, v_cache)
    assert k.dim() == 3 and k.shape[1:] == (hkv, d), (
        f"k must be [T, {hkv}, {d}] to match the cache, got {tuple(k.shape)}"
    )
    assert v.shape == k.shape, f"v shape {tuple(v.shape)} != k shape {tuple(k.shape)}"
    assert k.stride(2) == 1 and v.stride(2) == 1, "k and v must be contiguous in head_dim"
    assert out_slots.dim() == 1 and out_slots.shape[0] == k.shape[0], (
        f"out_slots must be [T={k.shape[0]}], got {tuple(out_slots.shape)}"
    )
    assert out_slots.dtype in (torch.int64, torch.int32), f"out_slots dtype {out_slots.dtype}"
    assert k.device == k_cache.device == out_slots.device, "all tensors must be on one device"
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        out_slots,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_HEADS=hkv,
        BLOCK_H=triton.next_power_of_2(hkv),
        HEAD_DIM=d,
        num_warps=4 if hkv * d >= 1024 else 1,
    )
