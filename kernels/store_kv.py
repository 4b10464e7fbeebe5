"""Triton kernel that writes new tokens' K/V into their slots of the paged KV cache.

Also holds the layout checks and the quantized-row helpers shared by the attention kernels of
this package.

Quantized caches (:mod:`.reference` states the format: ``D`` int8 or float8 e4m3 codes and a
bfloat16 scale per ``(token, head)`` row, ``[num_pages, page_size, Hkv, D + 2]`` bytes): the store
quantizes each row as ``radixkv.model.kv_quant.quantize`` does, to the same bytes, with integer
bit arithmetic rather than Triton's float conversions (the interpreter truncates fp32 -> bf16 and
rounds fp32 -> e4m3 otherwise than torch does, and Triton has e4m3 on GPUs from sm89 on only):

- scale: ``absmax * ((1 + 2^-8) / qmax)`` in float32, rounded to bfloat16 to nearest even on
  its bits; ``1 / scale`` with IEEE division (``div_rn``, as torch's reciprocal), then
  ``code = x * (1 / scale)``;
- int8: rounded half to even by adding and subtracting ``1.5 * 2^23`` (as ``torch.round``),
  clamped to +-127; e4m3: clamped to +-448, rounded to nearest even on the float32 bits (as
  torch's conversion);
- the kernel runs with ``enable_fp_fusion=False`` so the multiply and the rounding add are not
  contracted into one fma (which would round once where torch rounds twice).

The attention kernels read a row's codes (e4m3 bits widened through float16's bit layout), the
scale's two bytes as an int16, and attend over ``code * scale`` (exact in float32) rounded once to
the query's dtype, the values torch's ``dequantize(rows, dtype)`` gives (:func:`load_kv_tile`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .reference import KV_QMAX, KV_SCALE_BYTES, is_quantized_cache

__all__ = [
    "QUANTIZED_DTYPES",
    "SUPPORTED_DTYPES",
    "block_d",
    "check_head_dim",
    "check_kv_cache",
    "code_to_float",
    "dot_config",
    "kv_read_config",
    "load_kv_tile",
    "store_kvcache",
    "tile_dot",
]

#: Compute dtypes (queries, outputs, unquantized caches).
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Quantized cache dtypes: int8 codes, or float8 e4m3 bits in ``uint8`` (rows of ``D + 2``).
QUANTIZED_DTYPES = tuple(KV_QMAX)


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
    """Check ``q [rows, Hq, D]`` against the cache (head dim, GQA ratio, dtype, layout): a float
    cache's dtype is the query's, a quantized one's rows are ``D + 2``. Returns ``(rows, Hq)``."""
    quantized = is_quantized_cache(k_cache)
    hkv, d = k_cache.shape[2], k_cache.shape[3] - (KV_SCALE_BYTES if quantized else 0)
    assert q.dim() == 3, f"q must be [{rows}, Hq, D], got {tuple(q.shape)}"
    n, hq, qd = q.shape
    check_head_dim(qd)
    assert qd == d, f"q head_dim {qd} != cache head_dim {d}"
    assert hq % hkv == 0, f"Hq={hq} must be a multiple of Hkv={hkv}"
    if quantized:
        assert q.dtype in SUPPORTED_DTYPES, f"unsupported q dtype {q.dtype}"
    else:
        assert q.dtype == k_cache.dtype, f"q dtype {q.dtype} != cache dtype {k_cache.dtype}"
    assert q.stride(2) == 1, "q must be contiguous in head_dim"
    return n, hq


def check_head_dim(head_dim: int) -> None:
    """Assert that ``head_dim`` is at least 16 (what ``tl.dot``'s tiles need). A head dim that
    is not a power of two (80, 96) runs in tiles of :func:`block_d` columns, the columns past it
    masked: loaded as 0 (adding nothing to a dot product), never stored."""
    assert head_dim >= 16, f"head_dim must be at least 16, got {head_dim}"


def block_d(head_dim: int) -> int:
    """The head-dim width of the kernels' tiles: ``head_dim`` rounded up to a power of two
    (``tl.arange`` takes powers of two)."""
    return triton.next_power_of_2(head_dim)


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate a per-layer cache pair and return ``(num_pages, page_size, Hkv, D)``.

    The kernels address a token by ``slot = page * page_size + offset`` with the slot stride
    ``stride(1)``, so a page's stride must be ``page_size * stride(1)`` and ``D`` contiguous.
    A quantized cache (``QUANTIZED_DTYPES``) is ``[num_pages, page_size, Hkv, D + 2]``; its ``D``
    is returned.
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
    assert k_cache.dtype in SUPPORTED_DTYPES + QUANTIZED_DTYPES, (
        f"unsupported cache dtype {k_cache.dtype}"
    )
    num_pages, page_size, hkv, d = k_cache.shape
    if is_quantized_cache(k_cache):
        d -= KV_SCALE_BYTES  # D codes, then the bf16 scale
    check_head_dim(d)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        assert c.stride(3) == 1, f"{name} must be contiguous in head_dim"
        assert c.stride(0) == page_size * c.stride(1), (
            f"{name} pages must be laid out back to back (stride(0) == page_size * stride(1))"
        )
        if is_quantized_cache(c):  # the scale is read and written as one int16
            assert c.data_ptr() % 2 == 0 and c.stride(1) % 2 == 0 and c.stride(2) % 2 == 0, (
                f"{name}: quantized rows must start at even byte offsets"
            )
    return num_pages, page_size, hkv, d


def kv_read_config(
    cache: torch.Tensor, q_dtype: torch.dtype, other: torch.Tensor | None = None
) -> dict[str, bool | int]:
    """The constexprs of :func:`load_kv_tile` for a cache read by queries of ``q_dtype``:
    ``KV_QUANT`` (quantized rows), ``KV_FP8`` (e4m3 codes) and ``KV_ROUND_BF16``: under the
    interpreter, which truncates float32 -> bfloat16 where the GPU (and torch's ``dequantize``)
    rounds to nearest even, the dequantized values are rounded on their bits instead."""
    quantized = is_quantized_cache(cache)
    return {
        "KV_QUANT": quantized,
        "KV_FP8": cache.dtype == torch.uint8,
        "KV_ROUND_BF16": quantized and _interpreting() and q_dtype == torch.bfloat16,
        "KV_ALIGN": min(row_alignment(c) for c in (cache, other) if c is not None)
        if quantized
        else 1,
    }


def row_alignment(cache: torch.Tensor) -> int:
    """The largest power of two (at most 16) dividing the byte address of every row of a
    quantized ``cache``: its base address and its token and head strides (even for the pool's
    ``D + 2``-byte rows; :func:`check_kv_cache` asserts that)."""
    align = 16
    for x in (cache.data_ptr(), cache.stride(1), cache.stride(2)):
        while x % align:
            align //= 2
    return align


@triton.jit
def code_to_float(codes, KV_FP8: tl.constexpr):
    """Codes loaded from a quantized cache as float32 (exact): int8 as they are; e4m3 bits moved
    into float16's layout (sign to bit 15, exponent and mantissa up by 7 bits, so that float16's
    value is the e4m3 value times 2^-8, subnormals included) and scaled back by 2^8. Needs no fp8
    support (pre-sm89 GPUs, the interpreter); the NaN code 0x7f is never stored."""
    if KV_FP8:
        b = codes.to(tl.int32) & 0xFF
        h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
        return h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    else:
        return codes.to(tl.float32)


@triton.jit
def row_scale(row_ptr, mask, HEAD_DIM: tl.constexpr):
    """The float32 scale of the quantized rows starting at byte pointers ``row_ptr``: the
    bfloat16 after their ``HEAD_DIM`` codes, read as one int16 and widened on its bits."""
    bits = tl.load((row_ptr + HEAD_DIM).to(tl.pointer_type(tl.int16)), mask=mask, other=0)
    return ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def load_kv_tile(
    head_ptr,
    slot,
    stride_s,
    mask_n,
    like,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TRANSPOSED: tl.constexpr,
    KV_QUANT: tl.constexpr,
    KV_FP8: tl.constexpr,
    KV_ROUND_BF16: tl.constexpr,
    KV_ALIGN: tl.constexpr,
):
    """K or V of the tokens at ``slot [N]`` (masked by ``mask_n``) of one KV head, as a
    ``[BLOCK_D, N]`` tile (``TRANSPOSED``) or ``[N, BLOCK_D]``; masked tokens, and the columns
    past ``HEAD_DIM`` (:func:`block_d`), read as 0. A quantized cache's rows are dequantized,
    ``code * scale``, into ``like``'s dtype (the query's); the constexprs are
    :func:`kv_read_config`'s (``KV_ALIGN``: bytes that divide every quantized row's address)."""
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    if TRANSPOSED:
        ptrs = head_ptr + slot[None, :] * stride_s + offs_d[:, None]
        mask = mask_n[None, :] & mask_d[:, None]
    else:
        ptrs = head_ptr + slot[:, None] * stride_s + offs_d[None, :]
        mask = mask_n[:, None] & mask_d[None, :]
    if KV_QUANT:
        # rows of D + 2 bytes leave Triton's analysis one byte of alignment: it then loads
        # byte by byte and, on an H100, spilled to local memory (50-70x slower than aligned
        # rows); the alignment the strides really have lets it load 2 (or more) bytes at once
        ptrs = tl.multiple_of(ptrs, [KV_ALIGN, KV_ALIGN])
        values = code_to_float(tl.load(ptrs, mask=mask, other=0), KV_FP8)
        scale = row_scale(head_ptr + slot * stride_s, mask_n, HEAD_DIM)
        values = values * (scale[None, :] if TRANSPOSED else scale[:, None])
        if KV_ROUND_BF16:  # to bfloat16, nearest even, on the bits (see kv_read_config)
            bits = values.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            return values.to(like.dtype)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


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
    BLOCK_D: tl.constexpr,
):
    """One program per new token: copy its ``[Hkv, D]`` K and V rows to its slot."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    kc_ptr = KCache + slot * stride_kc_s + offs_h[:, None] * stride_kc_h + offs_d[None, :]
    vc_ptr = VCache + slot * stride_vc_s + offs_h[:, None] * stride_vc_h + offs_d[None, :]
    tl.store(kc_ptr, k.to(KCache.dtype.element_ty), mask=mask)
    tl.store(vc_ptr, v.to(VCache.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_store(
    x,
    row_ptr,
    mask_h,
    scale_mul,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QMAX: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Quantize rows ``x [BLOCK_H, BLOCK_D]`` (columns past ``HEAD_DIM`` zero) and store codes
    and scale at byte pointers ``row_ptr [BLOCK_H]`` (see the module docstring for how each step
    matches torch)."""
    x = x.to(tl.float32)
    bits = (tl.max(tl.abs(x), axis=1) * scale_mul).to(tl.int32, bitcast=True)
    scale_bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # to bfloat16, nearest even
    scale = (scale_bits << 16).to(tl.float32, bitcast=True)
    inv = tl.where(scale > 0.0, tl.math.div_rn(1.0, tl.maximum(scale, 1.1754943508222875e-38)), 0.0)
    y = x * inv[:, None]
    if KV_FP8:
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        a = tl.abs(y)
        a_bits = a.to(tl.int32, bitcast=True)
        # normal (|y| >= 2^-6): keep 3 mantissa bits, nearest even; rebias exponent 127 -> 7
        normal = ((a_bits + 0x7FFFF + ((a_bits >> 20) & 1)) >> 20) - (120 << 3)
        # subnormal: multiples of 2^-9, rounded by adding 2^14 (whose ulp is 2^-9)
        sub = (a + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
        code = tl.where(a < 0.015625, sub, normal) | ((y.to(tl.int32, bitcast=True) >> 24) & 0x80)
        codes = code.to(tl.uint8)
    else:
        rounded = (y + 12582912.0) - 12582912.0  # 1.5 * 2^23: half to even, as torch.round
        codes = tl.minimum(tl.maximum(rounded, -QMAX), QMAX).to(tl.int8)
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(
        row_ptr[:, None] + offs_d[None, :],
        codes,
        mask=mask_h[:, None] & (offs_d < HEAD_DIM)[None, :],
    )
    scale_ptr = (row_ptr + HEAD_DIM).to(tl.pointer_type(tl.int16))
    tl.store(scale_ptr, scale_bits.to(tl.int16), mask=mask_h)


@triton.jit
def _store_kvcache_quant_kernel(
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
    scale_mul,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QMAX: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """One program per new token: quantize its ``[Hkv, D]`` K and V rows into its slot."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < NUM_HEADS
    mask = mask_h[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(
        K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask, other=0.0
    )
    v = tl.load(
        V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask, other=0.0
    )
    k_rows = KCache + slot * stride_kc_s + offs_h * stride_kc_h
    v_rows = VCache + slot * stride_vc_s + offs_h * stride_vc_h
    _quantize_store(k, k_rows, mask_h, scale_mul, HEAD_DIM, BLOCK_D, QMAX, KV_FP8)
    _quantize_store(v, v_rows, mask_h, scale_mul, HEAD_DIM, BLOCK_D, QMAX, KV_FP8)


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
    Values are cast to the cache dtype; into a quantized cache (``[..., D + 2]`` of int8 / uint8,
    module docstring) each row is quantized from ``k, v`` in any float dtype. Slots must be
    distinct and in range (not checked on device).
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
    if is_quantized_cache(k_cache):
        assert k.dtype in SUPPORTED_DTYPES and v.dtype in SUPPORTED_DTYPES, (
            f"k, v must be float ({k.dtype}, {v.dtype}) to be quantized"
        )
        qmax = KV_QMAX[k_cache.dtype]
        _store_kvcache_quant_kernel[(num_tokens,)](
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
            (1.0 + 2.0**-8) / qmax,
            NUM_HEADS=hkv,
            BLOCK_H=triton.next_power_of_2(hkv),
            HEAD_DIM=d,
            BLOCK_D=block_d(d),
            QMAX=qmax,
            KV_FP8=k_cache.dtype == torch.uint8,
            num_warps=4 if hkv * d >= 1024 else 1,
            enable_fp_fusion=False,  # x * inv and the rounding add must round apart, as torch's
        )
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
        BLOCK_D=block_d(d),
        num_warps=4 if hkv * d >= 1024 else 1,
    )
