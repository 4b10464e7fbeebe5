"""Sliding-window attention over the paged KV pool for the torch backends (Mistral, Gemma 3's local
layers, Phi-3).

A query at position ``p`` sees the keys at positions ``p - w + 1 .. p`` (transformers'
``sliding_window`` mask: ``kv > q - w``). The native and Triton backends take the window in their
kernels (``AttentionBackend.windows_in_kernel``) and never come here. For the others (the torch
cascade, the plain backend, the virtual layout's): while no request of a step is longer than
``w``, that is plain causal attention, and the layer runs on the backend unchanged;
:func:`plan_window` returns None then. Once a request's span exceeds the window, every windowed
layer of that step runs here instead: each request's window of keys is gathered from its pages
(dequantized where the pool is quantized) and attended with ``scaled_dot_product_attention`` under
the window's mask, in the queries' dtype, as transformers' SDPA path computes it.

Pages wholly outside every layer's window stay in the pool and the radix tree: full-attention
layers (Gemma 3's global layers) still read them (one page id holds every layer's K/V), a later
request that shares the prefix reuses them as any other, and the tree's eviction frees them under
pressure like any cached page (docs/design.md, "Sliding-window layers", weighs this against
SGLang's SWA pool with tombstones).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixkv.model.attention.base import ForwardBatch, read_rows, torch_store_kvcache

__all__ = ["WindowPlan", "plan_window", "windowed_attention"]


@dataclass
class _Span:
    """One request's rows of the step and the keys its window reaches."""

    start: int  # first row in q
    n: int  # new tokens
    slots: torch.Tensor  # [L] int64 pool slots of the keys, position order
    mask: torch.Tensor  # [n, L] bool, True where the query sees the key


@dataclass
class WindowPlan:
    """What one step's windowed layers attend over (built once per forward and window)."""

    window: int
    out_slots: torch.Tensor
    spans: list[_Span]


def plan_window(batch: ForwardBatch, window: int) -> WindowPlan | None:
    """The step's plan for a window of ``window`` tokens, or None when no request's span is
    longer than the window (causal attention is then the windowed attention)."""
    if not batch.seq_lens or max(batch.seq_lens) <= window:
        return None
    page = batch.page_size
    device = batch.page_table.device
    table = batch.page_table.long()
    spans = []
    for i, (p, n, s) in enumerate(zip(batch.prefix_lens, batch.extend_lens, batch.extend_starts)):
        if n == 0:
            continue
        total = p + n
        lo = max(0, p - window + 1)  # the first key any of these queries sees
        pos = torch.arange(lo, total, device=device)
        slots = table[i, pos // page] * page + pos % page
        q_pos = torch.arange(p, total, device=device)[:, None]
        mask = (pos[None, :] <= q_pos) & (pos[None, :] > q_pos - window)
        spans.append(_Span(s, n, slots, mask))
    return WindowPlan(window, batch.out_slots, spans)


def windowed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: WindowPlan,
    sm_scale: float,
) -> torch.Tensor:
    """Store ``k, v [T, Hkv, D]`` in the pool, then attend each request's queries ``q [T, Hq, D]``
    over its window; returns ``[T, Hq, D]``."""
    torch_store_kvcache(k, v, k_cache, v_cache, plan.out_slots)
    hq, d = q.shape[1], q.shape[2]
    hkv, row = k_cache.shape[2], k_cache.shape[3]
    keys, values = k_cache.view(-1, hkv, row), v_cache.view(-1, hkv, row)
    group = hq // hkv
    out = torch.empty_like(q)
    for span in plan.spans:
        kk = read_rows(keys, span.slots, q.dtype).transpose(0, 1)  # [Hkv, L, D]
        vv = read_rows(values, span.slots, q.dtype).transpose(0, 1)
        if group > 1:
            kk, vv = kk.repeat_interleave(group, 0), vv.repeat_interleave(group, 0)
        qq = q[span.start : span.start + span.n].transpose(0, 1)  # [Hq, n, D]
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=span.mask, scale=sm_scale)
        out[span.start : span.start + span.n] = o.transpose(0, 1)
    assert out.shape[-1] == d
    return out
