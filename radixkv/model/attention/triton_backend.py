"""The Triton paged attention backend (``"triton"``, the CUDA default): calls
``radixkv.kernels`` (store_kvcache, decode_attention, extend_attention).

Over a quantized pool (int8 / fp8 pages, :mod:`radixkv.model.kv_quant`) the kernels quantize the
new rows as they store them and dequantize the rows they read, attending in the queries' dtype.
Sliding-window layers pass their window to both kernels, which read only the keys inside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixkv.model.attention.base import AttentionBackend, ForwardBatch
from radixkv.model.kv_quant import is_quantized


@dataclass
class TritonAttnMeta:
    """Per-forward int32 index tensors for the Triton kernels."""

    out_slots: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    extend_starts: torch.Tensor
    all_decode: bool


class TritonAttentionBackend(AttentionBackend):
    """Calls ``radixkv.kernels`` (store_kvcache, decode_attention, extend_attention)."""

    name = "triton"
    windows_in_kernel = True

    def __init__(self) -> None:
        from radixkv import kernels

        missing = [
            f
            for f in ("store_kvcache", "decode_attention", "extend_attention")
            if not hasattr(kernels, f)
        ]
        if missing:
            raise ImportError(f"radixkv.kernels lacks {missing}: the triton backend needs them")
        self.kernels = kernels

    def prepare(self, batch: ForwardBatch, dtype: torch.dtype) -> TritonAttnMeta:
        dev = batch.input_ids.device

        def i32(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int32, device=dev)

        return TritonAttnMeta(
            out_slots=batch.out_slots.long(),
            page_table=batch.page_table.to(torch.int32).contiguous(),
            seq_lens=i32(batch.seq_lens),
            prefix_lens=i32(batch.prefix_lens),
            extend_lens=i32(batch.extend_lens),
            extend_starts=i32(batch.extend_starts),
            all_decode=all(n == 1 for n in batch.extend_lens),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TritonAttnMeta,
        sm_scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        kern = self.kernels
        if not is_quantized(k_cache):  # a quantized cache takes the rows as they are
            k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
        kern.store_kvcache(k.contiguous(), v.contiguous(), k_cache, v_cache, meta.out_slots)
        qc = q.contiguous()
        if meta.all_decode:
            return kern.decode_attention(
                qc, k_cache, v_cache, meta.page_table, meta.seq_lens, sm_scale, window=window
            )
        return kern.extend_attention(
            qc,
            k_cache,
            v_cache,
            meta.page_table,
            meta.prefix_lens,
            meta.extend_lens,
            meta.extend_starts,
            sm_scale,
            window=window,
        )
