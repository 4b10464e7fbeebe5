"""Paged batches for the native attention kernels' tests, and their float64 oracle.

A :class:`Case` is a random KV pool whose pages are handed to the requests in shuffled order
(``groups`` of requests share their leading pages by id, as the radix cache's prefix sharing
does), the page tables, each request's cached prefix and new tokens, and a query; it runs either
kernel over them (:meth:`Case.run`: float32 math, csrc/cpu_attention_f32.cpp;
:meth:`Case.run_bf16`: bf16, csrc/cpu_attention.cpp) and :func:`oracle` computes the same
attention in float64 from the same pages, with transformers' masks (causal; with a sliding
window ``W`` the query at position ``p`` sees keys ``p - W + 1 .. p``, ``kv > q - W``).
"""

from __future__ import annotations

import torch

from radixkv.model.attention.native_backend import (
    native_paged_attention,
    native_paged_attention_f32,
)
from radixkv.model.attention.prefix_groups import PrefixGroup

__all__ = ["BF16_MAX_ERR", "BF16_MEAN_ERR", "Case", "bf16_case", "bf16_errors", "oracle"]

# The bf16 kernel's bounds against float64 (max, mean absolute error): its output is rounded to
# bf16 (~4e-3 at |o| ~ 1) and so is P before it meets V, as in flash kernels.
BF16_MAX_ERR, BF16_MEAN_ERR = 2.5e-2, 2e-3


def oracle(q, k_cache, v_cache, table, prefix, ext, starts, scale, window=0):
    """Per-request float64 attention: token t of request b (absolute position p = prefix + t)
    sees keys 0 .. p of its pages, only p - window + 1 .. p with a sliding window (> 0)."""
    page, hkv, d = k_cache.shape[1], k_cache.shape[2], q.shape[2]
    g = q.shape[1] // hkv
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, (p, n, s) in enumerate(zip(prefix, ext, starts, strict=True)):
        if n == 0:
            continue
        total = p + n
        pages = table[b, : -(-total // page)].long()
        k, v = (c[pages].reshape(-1, hkv, d)[:total].double() for c in (k_cache, v_cache))
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        scores = torch.einsum("thd,khd->htk", q[s : s + n].double(), k) * scale
        q_pos = (p + torch.arange(n))[:, None]
        k_pos = torch.arange(total)[None, :]
        visible = k_pos <= q_pos
        if window > 0:
            visible &= k_pos > q_pos - window
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[s : s + n] = torch.einsum("htk,khd->thd", scores.softmax(-1), v)
    return out


class Case:
    """A pool and page tables where ``groups`` of requests share their leading pages by id.

    ``reqs``: ``(prefix, new)`` per request; ``groups``: ``(member indices, shared tokens)``; a
    shared part may end mid-page (the page holding the boundary is shared too). Every page a
    request's tokens need is in its table row, and four spare pages are in no row."""

    def __init__(self, page, hq, hkv, d, reqs, groups=(), dtype=torch.float32, seed=0):
        g = torch.Generator().manual_seed(seed)
        need = [-(-(p + n) // page) for p, n in reqs]
        num_pages = sum(need) + 4
        self.k_cache = torch.randn(num_pages, page, hkv, d, generator=g).to(dtype)
        self.v_cache = torch.randn(num_pages, page, hkv, d, generator=g).to(dtype)
        free = torch.randperm(num_pages, generator=g).tolist()
        self.table = torch.zeros(len(reqs), max(need), dtype=torch.int32)
        filled = [0] * len(reqs)
        for members, shared in groups:
            run = [free.pop() for _ in range(-(-shared // page))]
            for b in members:
                self.table[b, : len(run)] = torch.tensor(run)
                filled[b] = len(run)
        for b, k in enumerate(need):
            for i in range(filled[b], k):
                self.table[b, i] = free.pop()
        self.prefix = [p for p, _ in reqs]
        self.ext = [n for _, n in reqs]
        self.starts = [sum(self.ext[:b]) for b in range(len(reqs))]
        self.q = 2 * torch.randn(sum(self.ext), hq, d, generator=g)
        self.scale = d**-0.5
        self.groups = [PrefixGroup(list(m), s) for m, s in groups]

    def _args(self):
        return (self.q, self.k_cache, self.v_cache, self.table, self.prefix, self.ext, self.starts)

    def run(self, groups=None, module=None, window=None):
        """The float32-math kernel's output (the case's groups unless ``groups`` is given)."""
        groups = self.groups if groups is None else list(groups)
        return native_paged_attention_f32(*self._args(), self.scale, groups, module, window)

    def run_bf16(self, module=None, groups=None, window=None):
        """The bf16 kernel's output (the case's groups unless ``groups`` is given)."""
        groups = self.groups if groups is None else list(groups)
        return native_paged_attention(*self._args(), self.scale, module, groups, window)

    def reference(self, window=0):
        """The float64 oracle of this case's attention."""
        return oracle(*self._args(), self.scale, window)


def bf16_case(page, hq, hkv, d, reqs, groups=(), seed=0):
    """A :class:`Case` with bf16 pages and a bf16 query, for the bf16 kernel."""
    case = Case(page, hq, hkv, d, reqs, groups=groups, dtype=torch.bfloat16, seed=seed)
    case.q = case.q.to(torch.bfloat16)
    return case


def bf16_errors(out, case, window=0):
    """(max, mean) absolute error of ``out`` against the case's float64 oracle."""
    err = (out.double() - case.reference(window)).abs()
    return err.max().item(), err.mean().item()
