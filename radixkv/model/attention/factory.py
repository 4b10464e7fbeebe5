"""Picks the attention backend for a device and dtype (kept apart from the backends so that
none of them imports another)."""

from __future__ import annotations

import os

import torch

from radixkv.model.attention.base import AttentionBackend
from radixkv.model.kv_quant import is_quantized

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
    attention step for step). Off the CPU, float32 keeps the plain backend.

    A quantized pool (``kv_dtype`` int8 / uint8, :mod:`radixkv.model.kv_quant`) is read by the
    same native kernels, which dequantize its rows in registers (see :func:`_quantized_backend`).
    """
    dev = torch.device(device)
    if name is None:
        name = "triton" if dev.type == "cuda" else "torch"
    if kv_dtype is not None and is_quantized(kv_dtype):
        return _quantized_backend(name, dev, dtype, head_dim, kv_dtype)
    if name == "torch":
        mode = _fp32_mode() if dtype == torch.float32 else "native"
        if dtype == torch.float32 and (dev.type != "cpu" or mode == "plain"):
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
        if dev.type == "cpu" and mode == "native" and native_cascade_supported(dtype):
            return NativeCascadeBackend()
        from radixkv.model.attention.cascade_backend import CascadeTorchBackend

        return CascadeTorchBackend()
    if name == "triton":
        from radixkv.model.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention_backend {name!r}: use 'torch' or 'triton'")


def _quantized_backend(
    name: str, dev: torch.device, dtype: torch.dtype, head_dim: int | None, kv_dtype: torch.dtype
) -> AttentionBackend:
    """The backend over int8 / fp8 pages (:mod:`radixkv.model.kv_quant`). On the CPU the native
    kernels read the quantized rows in place and dequantize them in registers: the bf16 kernel
    (:class:`~radixkv.model.attention.native_backend.NativeAttentionBackend`) for a bfloat16
    model on AVX512-BF16 with a fast head dim, else the float32-math kernel
    (:class:`~radixkv.model.attention.native_backend.NativeCascadeBackend`). The torch paths,
    which dequantize the rows they gather, serve where the native build is unavailable or off the
    CPU, and float32 models under ``RADIXKV_FP32_ATTENTION=plain`` (the plain backend) or
    ``cascade`` (the torch cascade). The Triton kernels quantize as they store and dequantize as
    they read."""
    if name == "torch":
        mode = _fp32_mode() if dtype == torch.float32 else "native"
        if dtype == torch.float32 and mode == "plain":
            from radixkv.model.attention.torch_backend import TorchAttentionBackend

            return TorchAttentionBackend()
        if dev.type == "cpu" and mode == "native":
            from radixkv.model.attention.native_backend import (
                NativeAttentionBackend,
                NativeCascadeBackend,
                native_attention_supported,
                native_cascade_supported,
            )

            if native_attention_supported(dtype, head_dim):
                return NativeAttentionBackend()
            if native_cascade_supported(kv_dtype):
                return NativeCascadeBackend()
        from radixkv.model.attention.cascade_backend import CascadeTorchBackend

        return CascadeTorchBackend()
    if name == "triton":
        from radixkv.model.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention_backend {name!r}: use 'torch' or 'triton'")
