"""Quantized KV pages: int8 or fp8 (e4m3) codes with one scale per token and KV head.

Layout (the contract every reader and writer of a quantized pool keeps): a quantized layer's
cache is a byte tensor ``[num_pages, page_size, Hkv, D + 2]`` (``torch.int8`` for int8 codes,
``torch.uint8`` holding ``float8_e4m3fn`` bits for fp8). Each ``(token, head)`` row is ``D`` codes
followed by its scale, a little-endian bfloat16 in the last two bytes; the value of element ``i``
is ``code[i] * scale``. The page therefore carries its own scales: copying, offloading,
checksumming and restoring pages moves the bytes as they are, and ``bytes_per_page`` counts them.

Why per token and head: a decode step appends one token to a page, and a scale of its own
needs no re-quantization of the tokens already there (a per-page scale would grow with its
largest token and re-round the rest); K's outliers sit in a few channels of some heads and
tokens, so a row's own absolute maximum keeps the others' resolution. The cost is 2 bytes per
row: at ``D = 64`` a row takes 66 bytes instead of bfloat16's 128 (1.94x the tokens; 1.97x at
``D = 128``) and float32's 256 (3.88x). Measured against one scale per page and head (~1.99x),
simulated exactly (``python -m bench.bench_kv_quant --scale-ablation --dtype float32``,
2026-11-27): per-page int8 nearly doubles the mean logprob error against the float64 oracle
(0.046 vs 0.025) and keeps 34.5% of 200 greedy continuations identical to unquantized KV
against 56.0% (docs/kv-quant.md).

Rotation (every quantized pool, :func:`is_rotated`): K and V are stored rotated by a Hadamard
transform of the head dim (:func:`hadamard`, entries +-1, block-diagonal with the largest
power-of-two block dividing ``D``): ``k' = k H``, ``v' = v H``. Queries are rotated the same way
and the attention output rotated back (``o = o' H^T / b``, ``b`` the block size, with the
softmax scale divided by ``b``): ``q' . k' = b (q . k)``, so attention is unchanged, while a
head's outlier channels (RoPE makes a few of K's channels far larger than the rest) are spread
over all of its channels, and int8's uniform grid, whose step is the row's absolute maximum /
127, loses less resolution. Measured (``python -m bench.bench_kv_quant --rotation-ablation
--dtype float32``, SmolLM2, 2026-11-26): int8 with / without the rotation, mean |logprob -
float64 oracle| 0.025 / 0.048, greedy continuations identical to unquantized KV 59% / 46.5% of
200. e4m3 is a float whose relative step is the same at every magnitude, and on those two
figures the rotation made no consistent difference to it (0.113 / 0.106, 10% / 13.5%; with a
bf16 model the other way), so fp8 rows were first stored unrotated; the perplexity of a
7,658-token text then separated them (``--rotation-ablation --perplexity-only``, 2026-11-27):
fp8 +0.95% rotated against +1.87% unrotated with a float32 model, +0.92% against +1.86% with
a bf16 one, so fp8 rows are rotated too (docs/kv-quant.md). :class:`~radixkv.model.attention.rotated_kv.RotatedKVBackend` applies it
around any backend, so the kernels only dequantize (``code * scale``) what they read.

Quantizing: ``scale = absmax / qmax`` rounded up to bfloat16 (``qmax`` 127 for int8, 448 for
e4m3), ``code = round(x / scale)`` with the stored scale, so ``|x - code * scale| <= scale / 2``
for int8 (e4m3: its own rounding, relative 2^-4). An all-zero row has scale 0 and codes 0.
"""

from __future__ import annotations

import torch

__all__ = [
    "KV_CACHE_DTYPES",
    "SCALE_BYTES",
    "dequantize",
    "hadamard",
    "is_quantized",
    "is_rotated",
    "kv_storage_dtype",
    "quantize",
    "row_dim",
]

#: ``kv_cache_dtype`` values: ``auto`` stores pages in the model's dtype.
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")

#: Bytes of a row's scale (bfloat16), after its ``D`` codes.
SCALE_BYTES = 2

_QMAX = {torch.int8: 127.0, torch.uint8: 448.0}


def is_rotated(storage_dtype: torch.dtype) -> bool:
    """Whether a pool of ``storage_dtype`` holds Hadamard-rotated rows (every quantized pool:
    module docstring); unquantized pools hold K/V as they are."""
    return is_quantized(storage_dtype)


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for ``kv_cache_dtype`` (``ValueError`` naming the choices)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "int8":
        return torch.int8
    if kv_cache_dtype == "fp8_e4m3":
        return torch.uint8
    raise ValueError(
        f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
    )


def is_quantized(cache_or_dtype: torch.Tensor | torch.dtype) -> bool:
    """Whether a cache tensor (or its dtype) holds quantized rows (codes + scale)."""
    dtype = cache_or_dtype if isinstance(cache_or_dtype, torch.dtype) else cache_or_dtype.dtype
    return dtype in _QMAX


def row_dim(head_dim: int, storage_dtype: torch.dtype) -> int:
    """Elements of one ``(token, head)`` row in the pool: ``D``, or ``D + 2`` when quantized."""
    return head_dim + SCALE_BYTES if is_quantized(storage_dtype) else head_dim


def quantize(x: torch.Tensor, storage_dtype: torch.dtype) -> torch.Tensor:
    """Rows ``x [..., D]`` as quantized rows ``[..., D + 2]`` of ``storage_dtype`` (module
    docstring); ``x`` in any float dtype."""
    qmax = _QMAX[storage_dtype]
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # a bfloat16 rounds to nearest within 2^-9: widening by 2^-8 first makes the stored scale
    # at least absmax / qmax, so no code overflows
    scale = (amax * ((1.0 + 2.0**-8) / qmax)).to(torch.bfloat16)
    values = code_values(xf, scale.float(), storage_dtype)
    if storage_dtype == torch.int8:
        codes = values.to(torch.int8)
    else:  # e4m3 values already: the cast is exact
        codes = values.to(torch.float8_e4m3fn).view(torch.uint8)
    out = torch.empty(
        (*x.shape[:-1], x.shape[-1] + SCALE_BYTES), dtype=storage_dtype, device=x.device
    )
    out[..., : x.shape[-1]] = codes
    out[..., x.shape[-1] :] = scale.view(storage_dtype)
    return out


def code_values(x: torch.Tensor, scale: torch.Tensor, storage_dtype: torch.dtype) -> torch.Tensor:
    """The codes of float32 rows ``x [..., D]`` on the grid of ``scale`` (float32, broadcast
    against ``x``; 0 gives codes 0), as float32 values: ``x / scale`` clamped to +-qmax, then
    rounded half to even (int8) or to the nearest e4m3 value (ties to even). :func:`quantize`'s
    rounding step, for a scale it chose; the scale-granularity ablation
    (``bench/kv_scale_ablation.py``) rounds to scales of its own with it."""
    qmax = _QMAX[storage_dtype]
    inv = torch.where(scale > 0, 1.0 / scale.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    y = (x * inv).clamp_(-qmax, qmax)
    if storage_dtype == torch.int8:
        return y.round_()
    return y.to(torch.float8_e4m3fn).float()


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Quantized rows ``[..., D + 2]`` back to values ``[..., D]`` in ``dtype``."""
    d = rows.shape[-1] - SCALE_BYTES
    codes = rows[..., :d]
    scale = rows[..., d:].contiguous().view(torch.bfloat16).float()
    if rows.dtype == torch.int8:
        values = codes.float()
    else:
        values = codes.contiguous().view(torch.float8_e4m3fn).float()
    return (values * scale).to(dtype)


def hadamard(d: int) -> torch.Tensor:
    """The rotation of quantized rows (module docstring): a ``[d, d]`` float32 matrix of +-1
    entries, block-diagonal with Sylvester Hadamard blocks of the largest power of two ``b``
    dividing ``d``, so ``H H^T = b I``; ``b`` is ``hadamard(d)[0].abs().sum()``."""
    b = d & -d  # the largest power of two dividing d
    h = torch.ones(1, 1)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.block_diag(*([h] * (d // b)))
