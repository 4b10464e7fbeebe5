"""The attention interface: :class:`ForwardBatch` (what a step computes) and
:class:`AttentionBackend` (``prepare`` once per forward, ``forward`` per layer).

Backends live beside this module (``torch_backend``, ``native_backend``, ``cascade_backend``,
``triton_backend``) and import it; :mod:`radixkv.model.attention.factory` picks one. Nothing here
imports a backend, so the package has no import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from radixkv.model.kv_quant import dequantize, is_quantized, quantize

__all__ = ["ForwardBatch", "AttentionBackend", "stored_kv", "torch_store_kvcache"]


@dataclass
class ForwardBatch:
    """One model step over a batch of requests (see docs/design.md, "Model runner").

    Attributes:
        input_ids: ``[T]`` int64, the new tokens of every request, request after request.
        positions: ``[T]`` int64, absolute positions of those tokens.
        extend_lens: new tokens per request (1 for a decode).
        prefix_lens: tokens already in the KV pool before this step, per request.
        page_table: ``[B, max_pages]`` int32 page ids (padded with 0).
        out_slots: ``[T]`` int64, the slot each new token's K/V goes to.
        virtual_keys: with the virtual KV layout, the key of each request's mapped range (set by
            the engine's ``VirtualLayout.before_forward``); None runs the paged layout.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    extend_lens: list[int]
    prefix_lens: list[int]
    page_table: torch.Tensor
    out_slots: torch.Tensor
    page_size: int = 0
    virtual_keys: list[int] | None = None
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def batch_size(self) -> int:
        """Number of requests."""
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        """Number of new tokens ``T``."""
        return int(self.input_ids.shape[0])

    @property
    def seq_lens(self) -> list[int]:
        """``prefix_lens + extend_lens`` per request."""
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    @property
    def extend_starts(self) -> list[int]:
        """Row of each request's first new token in ``input_ids``."""
        starts, acc = [], 0
        for e in self.extend_lens:
            starts.append(acc)
            acc += e
        return starts

    @property
    def last_token_rows(self) -> list[int]:
        """Row of each request's last new token."""
        rows, acc = [], 0
        for e in self.extend_lens:
            acc += e
            rows.append(acc - 1)
        return rows


# --------------------------------------------------------------------------------------------
# Pure-torch building blocks
# --------------------------------------------------------------------------------------------


def torch_store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,
    module: Any | None = None,
) -> None:
    """Write ``k, v [T, Hkv, D]`` into the slots ``out_slots [T]`` of the paged caches
    (quantized on the way into an int8 / fp8 pool, :mod:`radixkv.model.kv_quant`).

    ``module``: the native build to store with (see :func:`native_module_for`; a backend that
    holds its build passes it: finding it is a per-layer lookup otherwise)."""
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    slots = out_slots if out_slots.dtype == torch.long else out_slots.long()
    if is_quantized(k_cache):
        module = native_module_for(k, module) if k_cache.is_contiguous() else None
        if module is not None:  # the same bytes in one pass (csrc/cpu_kv_store.cpp)
            if not rows_contiguous(k, v):  # tokens may be at any stride, heads not
                k, v = k.contiguous(), v.contiguous()
            module.store_kv_quant_(k, v, k_cache, v_cache, slots)
            return
        k, v = quantize(k, k_cache.dtype), quantize(v, v_cache.dtype)
    elif k.dtype == k_cache.dtype and k_cache.is_contiguous() and v_cache.is_contiguous():
        module = native_module_for(k, module)
        if module is not None and rows_contiguous(k, v):
            module.store_kv_(k, v, k_cache, v_cache, slots)  # one pass, no copies of k, v
            return
    k_cache.view(-1, hkv, d).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slots, v.to(v_cache.dtype))


def rows_contiguous(*xs: torch.Tensor) -> bool:
    """Whether each token's ``[Hkv, D]`` row of every ``[T, Hkv, D]`` tensor is contiguous."""
    return all(x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in xs)


def split_qkv(
    qkv: torch.Tensor, heads: tuple[int, int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views ``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` of the fused QKV rows ``[T, (Hq + 2 Hkv) D]``."""
    hq, hkv, d = heads
    # two ops (``split_with_sizes``: no Python wrapper) where six slices and views cost ~10 us
    # a layer on the Zen 3 host
    q, k, v = qkv.view(qkv.shape[0], hq + 2 * hkv, d).split_with_sizes((hq, hkv, hkv), 1)
    return q, k, v


def native_module_for(x: torch.Tensor, build: Any | None = None) -> Any | None:
    """The native CPU build when ``x`` is a float32 / bfloat16 CPU tensor (what its quantized
    store and Hadamard rotation take), else None (also when the build is unavailable):
    ``build`` where the caller holds one, else :func:`radixkv.model.native.load`'s."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    if build is not None:
        return build
    from radixkv.model import native

    return native.load()


def stored_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The new tokens' ``k, v`` as the pool holds them (after :func:`torch_store_kvcache`): as
    given, or read back (dequantized) from a quantized pool. A path that attends to the new
    tokens from ``k, v`` rather than from the pages (a fresh prompt's causal attention) uses
    these, so a token sees the same K/V whether its keys are in this step or cached: the
    result does not depend on chunking or on what the prefix cache held, and it equals the
    native kernels', which read every key from the pages."""
    if not is_quantized(k_cache):
        return k, v
    slots = out_slots if out_slots.dtype == torch.long else out_slots.long()
    hkv, row = k_cache.shape[2], k_cache.shape[3]
    k = read_rows(k_cache.view(-1, hkv, row), slots, k.dtype)
    v = read_rows(v_cache.view(-1, hkv, row), slots, v.dtype)
    return k, v


def compute_dtype(cache: torch.Tensor, q_dtype: torch.dtype) -> torch.dtype:
    """The dtype the torch paths attend in: the cache's, or the queries' over quantized pages."""
    return q_dtype if is_quantized(cache) else cache.dtype


def read_rows(cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``cache.index_select(0, index)`` as values of ``dtype`` (dequantized from a quantized
    pool): the torch paths' gather of pages or slots."""
    rows = cache.index_select(0, index)
    return dequantize(rows, dtype) if is_quantized(cache) else rows.to(dtype)


class AttentionBackend:
    """Interface: ``prepare`` once per forward, then ``forward`` per layer.

    Sliding-window layers: a backend whose kernels take the window (:attr:`windows_in_kernel`,
    the native and Triton ones) is passed it, ``window`` (None or 0: full attention), and
    attends each query over its last ``window`` keys, reading only those. The others are never
    passed one: the model attends their windowed layers through
    :mod:`radixkv.model.attention.window` (a torch gather) once a request outgrows the window.
    """

    name = "base"
    #: whether ``forward`` takes a sliding ``window`` (else the model's torch gather runs them)
    windows_in_kernel = False
    #: whether ``forward_qkv`` on float32 rows over float32 pools is exactly the native
    #: ``rope_``, ``store_kv_`` and ``paged_attention_f32`` calls of the backend's build, which
    #: the native decoder stack (:mod:`radixkv.model.decoder_stack`) then makes itself
    f32_layers_native = False

    def prepare(self, batch: ForwardBatch, dtype: torch.dtype) -> Any:
        """Build the per-forward metadata."""
        raise NotImplementedError

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: Any,
        sm_scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """Store ``k, v [T, Hkv, D]`` in the caches and attend: ``q [T, Hq, D] -> [T, Hq, D]``
        (over the last ``window`` keys of each query, where the backend takes windows)."""
        raise NotImplementedError

    def forward_qkv(
        self,
        ops: Any,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        heads: tuple[int, int, int],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: Any,
        sm_scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """:meth:`forward` from the fused QKV projection's bf16 rows ``qkv [T, (Hq + 2 Hkv) D]``
        (``heads = (Hq, Hkv, D)``), RoPE not yet applied: the native fused ops' ``rope_`` on the
        q and k heads, in place (``cos``/``sin`` float32 ``[T, D]``, sin sign-folded), then
        ``forward``. Backends that change the basis of q, k, v fold it into this pass."""
        hq, hkv, d = heads
        ops.rope_(qkv, cos, sin, hq + hkv, d)
        q, k, v = split_qkv(qkv, heads)
        if window:
            return self.forward(q, k, v, k_cache, v_cache, meta, sm_scale, window)
        return self.forward(q, k, v, k_cache, v_cache, meta, sm_scale)
