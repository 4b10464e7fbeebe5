"""KV capacity in tokens for a memory budget, per KV dtype, without torch (the simulator's).

``bytes per token = 2 (K and V) x layers x KV heads x row bytes``, a row being ``head_dim``
elements of the dtype, or for ``int8`` / ``fp8_e4m3`` ``head_dim`` one-byte codes plus a 2-byte
scale (:mod:`radixkv.model.kv_quant`; ``tests/test_kv_quant.py`` checks both agree with
``KVPool.bytes_per_page_for``).
"""

from __future__ import annotations

__all__ = ["ELEMENT_BYTES", "GEOMETRIES", "kv_bytes_per_token", "tokens_for_memory"]

#: Bytes of one element per KV dtype (quantized ones add a 2-byte scale per row).
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp8_e4m3": 1}
_SCALE_BYTES = 2

#: (layers, KV heads, head dim) of models people size for.
GEOMETRIES = {
    "smollm2": (30, 3, 64),  # SmolLM2-135M-Instruct, the default model
    "llama3-8b": (32, 8, 128),
}


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, kv_dtype: str) -> int:
    """Bytes of K and V one token takes over all layers (``ValueError`` for an unknown dtype)."""
    if kv_dtype not in ELEMENT_BYTES:
        raise ValueError(f"kv dtype {kv_dtype!r}: choose one of {', '.join(ELEMENT_BYTES)}")
    row = head_dim * ELEMENT_BYTES[kv_dtype]
    if kv_dtype in ("int8", "fp8_e4m3"):
        row += _SCALE_BYTES
    return 2 * layers * kv_heads * row


def tokens_for_memory(memory_gb: float, geometry: tuple[int, int, int], kv_dtype: str) -> int:
    """Tokens a pool of ``memory_gb`` GiB holds for ``geometry`` in ``kv_dtype``."""
    return int(memory_gb * 2**30) // kv_bytes_per_token(*geometry, kv_dtype)
