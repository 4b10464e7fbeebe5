"""Picks the attention backend for a device and dtype (kept apart from the backends so that
none of them imports another)."""

from __future__ import annotations

import os

import torch

from radixkv.model.attention.base import AttentionBackend

FP32_MODES = ("native", "cascade", "plain")


def _fp32_mode() -> str:
    mode = os.environ.get("RADIXKV_FP32_ATTENTION", "native")
    if mode not in FP32_MODES:
        raise ValueError(f"RADIXKV_FP32_ATTENTION={mode!r}: use one of {', '.join(FP32_MODES)}")
    return mode


def make_attention_backend(
    name: str | None,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    head_dim: int | None = None,
    kv_dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """``"torch"``, ``"triton"`` or ``None`` (triton on CUDA, torch elsewhere).

    On the CPU (``"torch"``) the pick follows what the host runs fastest, falling back when the
    native kernels did not build (:func:`radixkv.model.native.build_error`):

    - bfloat16 with AVX512-BF16 and a fast head dim: the bf16 native kernel
      (:class:`~radixkv.model.attention.native_backend.NativeAttentionBackend`);
    - every other dtype and host (float32, the default without native bf16; bf16 or fp16 on an
      AVX2 host): the float32-math native kernel with in-kernel shared-prefix groups
      (:class:`~radixkv.model.attention.native_backend.NativeCascadeBackend`, built for the
      host's ISA), else the torch cascade backend (:mod:`radixkv.model.attention.cascade_backend`).

    ``RADIXKV_FP32_ATTENTION`` picks float32's backend: ``native`` (default), ``cascade`` (the
    torch cascade) or ``plain`` (the plain backend, whose arithmetic follows transformers' fp32
    attention step for step). Off the CPU, every dtype takes the plain backend (the native
    kernels and the cascade's fused flash op are CPU code).

    A quantized pool (``kv_dtype`` int8 / uint8, :mod:`radixkv.model.kv_quant`) takes the same
    pick: the native kernels dequantize its rows in registers, the torch paths as they gather
    them, the Triton kernels as they read them (and quantize as they store).
    """
    dev = torch.device(device)
    if name is None:
        name = "triton" if dev.type == "cuda" else "torch"
    if name == "torch":
        mode = _fp32_mode() if dtype == torch.float32 else "native"
        if dev.type != "cpu" or (dtype == torch.float32 and mode == "plain"):
            from radixkv.model.attention.torch_backend import TorchAttentionBackend

            return TorchAttentionBackend()
        from radixkv.model.attention.native_backend import (
            NativeAttentionBackend,
            NativeCascadeBackend,
            native_attention_supported,
            native_cascade_supported,
        )

        if dev.type == "cpu" and native_attention_supported(dtype, head_dim):
            return NativeAttentionBackend()
        pool_dtype = dtype if kv_dtype is None else kv_dtype
        if dev.type == "cpu" and mode == "native" and native_cascade_supported(pool_dtype):
            return NativeCascadeBackend()
        from radixkv.model.attention.cascade_backend import CascadeTorchBackend

        return CascadeTorchBackend()
    if name == "triton":
        from radixkv.model.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention_backend {name!r}: use 'torch' or 'triton'")
