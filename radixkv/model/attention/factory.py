"""Picks the attention backend for a device and dtype (kept apart from the backends so that
none of them imports another)."""

from __future__ import annotations

import os

import torch

from radixkv.model.attention.base import AttentionBackend


def _fp32_plain() -> bool:
    mode = os.environ.get("RADIXKV_FP32_ATTENTION", "cascade")
    if mode not in ("cascade", "plain"):
        raise ValueError(f"RADIXKV_FP32_ATTENTION={mode!r}: use 'cascade' or 'plain'")
    return mode == "plain"


def make_attention_backend(
    name: str | None,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    head_dim: int | None = None,
) -> AttentionBackend:
    """``"torch"``, ``"triton"`` or ``None`` (triton on CUDA, torch elsewhere).

    On the CPU (``"torch"``), bfloat16 pools get the native paged-attention kernel
    (:mod:`radixkv.model.attention.native_backend`, K/V read in place) when it builds and serves ``head_dim``,
    else the shared-prefix cascade backend (:mod:`radixkv.model.attention.cascade_backend`, ATen's fused
    kernels). float32 on the CPU (the default where the host has no native bf16) also gets the
    cascade backend, computing in float32 with exact log-sum-exp merges (logits within 1e-3 of
    transformers, tested), so a prefix shared by a batch is read once per step, not once per
    request; ``RADIXKV_FP32_ATTENTION=plain`` keeps the plain backend, whose arithmetic follows
    transformers' fp32 attention step for step.
    """
    dev = torch.device(device)
    if name is None:
        name = "triton" if dev.type == "cuda" else "torch"
    if name == "torch":
        if dtype == torch.float32 and (dev.type != "cpu" or _fp32_plain()):
            from radixkv.model.attention.torch_backend import TorchAttentionBackend

            return TorchAttentionBackend()
        from radixkv.model.attention.native_backend import (
            NativeAttentionBackend,
            native_attention_supported,
        )

        if dev.type == "cpu" and native_attention_supported(dtype, head_dim):
            return NativeAttentionBackend()
        from radixkv.model.attention.cascade_backend import CascadeTorchBackend

        return CascadeTorchBackend()
    if name == "triton":
        from radixkv.model.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention_backend {name!r}: use 'torch' or 'triton'")
